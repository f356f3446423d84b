"""The manifest stored beside every library: the key's readable pre-image and the build record."""

from __future__ import annotations

from ..edge import cjson
from ..hit import MANIFEST_NAME as MANIFEST_NAME  # one spelling, shared with the compact hit path

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any

# The package version, in one place: every manifest records it, ``stubcache.__version__``
# re-exports it and ``pyproject.toml`` reads this line (setuptools ``attr:``, parsed without
# importing). A warm hit through the compact hit path never imports this module.
__version__ = "0.1.0"


class Manifest:
    """A published entry's ``manifest.json`` (written once, never modified).

    Attributes:
        key: the entry key (equals ``base_key`` unless user headers were tracked).
        base_key: hash of the spec and fingerprint, known before building.
        name: stub name; ``module_name`` the actual module/library stem.
        library: file name of the library inside the entry directory.
        sha256, size: checksum and size of the library.
        preimage: ``{"spec": ..., "fingerprint": ...}``, the readable key inputs.
        headers: every tracked file the build read (headers from anywhere the fingerprint does
            not pin, linker inputs), ``{path: sha256}``; part of the entry key.
        inputs: how to re-check them cheaply: ``{"sigs": {path: stat signature},
            "shadows": {dir: [dir signature, [names relative to dir]]}}`` (see
            :mod:`stubcache.key.inputs`); may be
            absent (``None``) in entries written before it existed.
        build_method: ``"direct"`` or ``"load_inline"``; build_seconds; build_log.
        created: creation time (seconds since the epoch); stubcache_version.
    """

    __slots__ = (
        "key", "base_key", "name", "module_name", "library", "sha256", "size", "preimage",
        "headers", "build_method", "build_seconds", "build_log", "created", "stubcache_version",
        "inputs",
    )
    _OPTIONAL = ("inputs",)
    # The slots' types as the builder writes them, for type checkers (no values: slots; a test
    # keeps the names the slots'); loads() checks library, sha256, size, headers and inputs.
    key: str
    base_key: str
    name: str
    module_name: str
    library: str
    sha256: str
    size: int
    preimage: dict[str, Any]
    headers: dict[str, str]
    build_method: str
    build_seconds: float
    build_log: str
    created: float
    stubcache_version: str
    inputs: dict[str, Any] | None

    def __init__(self, **fields: Any) -> None:
        missing = [f for f in self.__slots__ if f not in fields and f not in self._OPTIONAL]
        extra = set(fields) - set(self.__slots__)
        if missing or extra:
            raise ValueError(f"manifest fields: missing {missing}, unknown {sorted(extra)}")
        for f in self.__slots__:
            setattr(self, f, fields.get(f))

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}

    def dumps(self) -> str:
        import json  # written when publishing, never on a hit

        text = json.dumps(self.to_dict(), indent=1, sort_keys=True, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # undecodable source bytes (load() of a non-UTF-8 file): escape them
            text = json.dumps(self.to_dict(), indent=1, sort_keys=True, ensure_ascii=True)
        return text

    @classmethod
    def loads(cls, text: str) -> "Manifest":
        """Parse a manifest; raises ``ValueError`` on anything malformed."""
        data = cjson.loads(text)
        if not isinstance(data, dict):
            raise ValueError("manifest is not a JSON object")
        required = set(cls.__slots__) - set(cls._OPTIONAL)
        m = cls(**{f: data.get(f) for f in cls.__slots__}) if required <= set(data) else None
        if m is None:
            raise ValueError(f"manifest lacks fields {sorted(required - set(data))}")
        if not isinstance(m.library, str) or "/" in m.library or m.library.startswith("."):
            raise ValueError(f"manifest names a bad library file {m.library!r}")
        if not isinstance(m.sha256, str) or not isinstance(m.size, int):
            raise ValueError("manifest checksum fields are malformed")
        if not isinstance(m.headers, dict):
            raise ValueError("manifest headers field is malformed")
        if m.inputs is not None and not isinstance(m.inputs, dict):
            raise ValueError("manifest inputs field is malformed")
        return m

    def __repr__(self) -> str:
        return f"Manifest(key={self.key!r}, name={self.name!r}, method={self.build_method!r})"
