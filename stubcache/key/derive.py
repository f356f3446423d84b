"""Key computation: pure functions from (spec, fingerprint, used headers) to a hex key."""

from __future__ import annotations

from ..edge import cjson
from hashlib import sha256

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Mapping, Sequence

KEY_LEN = 32  # hex characters (128 bits)


def preimage(spec_canonical: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """The readable key pre-image kept in every manifest."""
    return {"spec": spec_canonical, "fingerprint": fingerprint}


def _digest(data: Any) -> str:
    blob = cjson.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()[:KEY_LEN]


def base_key(spec_canonical: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> str:
    """Key of everything known before building: the spec and the toolchain fingerprint."""
    return _digest(preimage(spec_canonical, fingerprint))


def entry_key(base: str, headers: Mapping[str, str], absent: Sequence[str] = ()) -> str:
    """Key of a built entry: the base key plus the contents of the files it read (``headers``)
    and the paths that did not exist when it was built and would shadow one of them
    (``absent``).

    The absent paths are in the key because a lookup misses when one appears: the rebuild that
    follows records a different set and so publishes beside the old entry, never onto it (the
    old one hits again once the path is gone). With no tracked files and no
    absent paths the entry key is the base key itself.
    """
    if not headers and not absent:
        return base
    doc: dict[str, Any] = {"base": base, "headers": dict(sorted(headers.items()))}
    if absent:
        doc["absent"] = sorted(absent)
    return _digest(doc)


def diff_preimages(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Field-by-field differences between two pre-images, as (dotted path, a, b) tuples."""
    out: list[tuple[str, Any, Any]] = []
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            out += diff_preimages(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
    elif a != b:
        out.append((prefix, a, b))
    return out
