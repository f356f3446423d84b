"""The key layer: what a key is made of. Its package module holds the spec, what the caller
asked to build: :class:`StubSpec`, its validation and canonical form; the flags (``flagscan``),
the toolchain fingerprint and probes (``fingerprint``, ``toolchain``, ``probememo``), the hash
(``derive``) and the tracked inputs (``inputs``, ``tracking``) are its submodules.

The spec is the package module because it is on the hit path (``StubCache().load(spec)``), where
every module imported costs an engine process ~0.2 ms whatever it holds. For the same reason it
avoids ``dataclasses`` (which imports ``inspect``) and keeps :class:`StubSpec` a small slotted
record. Its fields are one table, :data:`FIELDS`, from which the rest (slots, checks, JSON form,
key rules, torch mapping) is derived; docs/cache.md "Adding a spec field" says how to add one.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Iterable, Sequence


def _is_c_name(text: str) -> bool:
    """``[A-Za-z_][A-Za-z0-9_]{0,99}``: an ASCII identifier is exactly that, and this costs no
    regex compile at import (~0.1 ms, on every fresh process's hit path)."""
    return len(text) <= 100 and text.isascii() and text.isidentifier()


# A source that mentions any of these needs torch's implicit headers (or includes them itself):
# a token not preceded by an identifier character, or an include of a torch-family header.
_TORCH_TOKENS = ("torch::", "at::", "c10::", "TORCH_", "PYBIND11_", "py::")
# An include of a torch-family header: what r'#\s*include\s*[<"](?:torch|ATen|c10|pybind11|caffe2)/'
# matches, found without re (see _includes_torch_header).
_TORCH_DIRS = ("torch/", "ATen/", "c10/", "pybind11/", "caffe2/")

# Flags that make the compiler driver run another assembler or linker than its default one.
FunctionsT = "Sequence[str] | Mapping[str, str] | str | None"


def _str_list(value: Any, field: str) -> tuple[str, ...]:
    """Normalise a ``str | list[str] | None`` argument the way torch does, with clear errors."""
    if value is None:
        return ()
    if isinstance(value, str):
        if "\x00" in value or not value.isascii():
            _check_text(value, field)
        return (value,)
    if isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{field} must be str or a list of str, not bytes; decode it first")
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{field} must be str or a list of str, got {type(value).__name__}")
    out = []
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{field} must contain only str, got {type(item).__name__}")
        if "\x00" in item or not item.isascii():  # else _check_text has nothing to say
            _check_text(item, field)
        out.append(item)
    return tuple(out)


def _flag_list(value: Any, field: str) -> tuple[str, ...]:
    """Flags must be a list: a bare string would be split into characters by torch."""
    if value is None:
        return ()
    if isinstance(value, str):
        raise TypeError(f"{field} must be a list of str, got a single str {value!r}; wrap it in a list")
    return tuple([f.strip() for f in _str_list(value, field)])


def _flag_words(value: Any, field: str) -> tuple[str, ...]:
    """Flags as torch's build file hands them to the compiler: each stripped, and one holding
    spaces or tabs but no quote (``"-O0 -Wall"``) split into its words, as the shell that runs
    torch's ninja line would split it (here by ``str.split``: nothing is expanded or run). A flag
    with a quote is kept as one word, quotes included, and a line break inside a flag is left
    for the builder to refuse (see docs/cache.md, "Deliberate differences")."""
    flags = _flag_list(value, field)
    out: list[str] = []
    for flag in flags:
        if (" " in flag or "\t" in flag) and not any(c in flag for c in "'\"\n\r"):
            out.extend(flag.split())
        else:
            out.append(flag)
    return tuple(out)


def _check_text(text: str, field: str) -> None:
    if "\x00" in text:
        raise ValueError(f"{field} contains a NUL character")
    if text.isascii():  # O(1) in CPython; ASCII text always encodes (callers test it first)
        return
    try:
        # surrogateescape: undecodable bytes of a source file read by load() are kept as such
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} is not valid UTF-8 text ({exc.reason} at {exc.start})") from None


def _functions(value: Any, field: str = "functions") -> tuple[tuple[str, str], ...] | None:
    """Canonical ``functions``: a tuple of (name, docstring) pairs, as torch generates bindings."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        pairs = [(f, f) for f in value]
    else:
        raise TypeError(f"{field} must be a list of names or a dict name->docstring, got {type(value).__name__}")
    for fname, doc in pairs:
        if not isinstance(fname, str) or not isinstance(doc, str):
            raise TypeError(f"{field} must map str names to str docstrings")
        if not _is_c_name(fname):
            raise ValueError(f"function name {fname!r} is not a C identifier")
        if "\x00" in doc or not doc.isascii():
            _check_text(doc, f"{field} docstring")
    if len({f for f, _ in pairs}) != len(pairs):
        raise ValueError(f"{field} lists a name twice")
    return tuple(sorted(pairs))  # binding order is irrelevant, so it must not change the key


def _optional_bool(value: Any, field: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise TypeError(f"{field} must be True, False or None, got {type(value).__name__}")


def _bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"{field} must be True or False, got {type(value).__name__}")


def validate_name(name: Any, field: str = "name") -> str:
    """Return ``name`` if it is usable as a module name and file name, else raise."""
    if not isinstance(name, str):
        raise TypeError(f"{field} must be str, got {type(name).__name__}")
    if not _is_c_name(name):
        raise ValueError(
            f"invalid stub name {name!r}: use 1-100 characters from [A-Za-z0-9_], not starting "
            "with a digit (it becomes a C identifier and a file name)"
        )
    return name


def _mentions_one(src: str) -> bool:
    # str.find per token: ~50x faster than one alternation regex over a 10 KB source.
    for tok in _TORCH_TOKENS:
        i = src.find(tok)
        while i != -1:
            if i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_"):
                return True
            i = src.find(tok, i + 1)
    return _includes_torch_header(src)


def _includes_torch_header(src: str) -> bool:
    """``#``, whitespace, ``include``, whitespace, ``<`` or ``"``, then a torch-family directory:
    checked around each ``include`` (a few per source) instead of a regex over the whole text."""
    n = len(src)
    i = src.find("include")
    while i != -1:
        j = i - 1
        while j >= 0 and src[j].isspace():
            j -= 1
        if j >= 0 and src[j] == "#":
            k = i + 7
            while k < n and src[k].isspace():
                k += 1
            if k < n and src[k] in "<\"" and src.startswith(_TORCH_DIRS, k + 1):
                return True
        i = src.find("include", i + 1)
    return False


def mentions_torch(sources: Iterable[str]) -> bool:
    """True if any source refers to torch, ATen, c10 or pybind11."""
    for src in sources:  # a loop, not any(genexpr): this runs once per spec on the hit path
        if _mentions_one(src):
            return True
    return False


def _include_paths(value: Any, field: str) -> tuple[str, ...]:
    # Absolute, but `current/../shared` kept: the compiler resolves `..` from where a symlinked
    # `current` points, and os.path.abspath would name another directory.
    paths = _flag_list(value, field)
    if not paths:
        return ()
    from ..edge import kpath  # include paths only: a spec without them never imports it

    return tuple([kpath.absolute(p) for p in paths])


def _builder(value: Any, field: str) -> str | None:
    if value not in (None, "direct", "load_inline"):
        raise ValueError(f"{field} must be None, 'direct' or 'load_inline', got {value!r}")
    return value  # type: ignore[no-any-return]  # None or one of the two strings, checked above


def _pairs_to_dict(pairs: Any) -> dict[str, str] | None:
    return dict(pairs) if pairs is not None else None


def _functions_key(spec: "StubSpec") -> list[list[str]] | None:
    return [list(p) for p in spec.functions] if spec.functions is not None else None


def _only_with_functions(field: str) -> Any:
    """Key rule of an option that changes nothing without ``functions``: torch then generates no
    bindings and both values leave the library byte-identical (tests/test_key_soundness.py), so
    it must not split the key. (``is_python_module`` only changes how the caller loads it.)"""
    get = attrgetter(field)
    return lambda spec: get(spec) if spec.functions is not None else None


REQUIRED: Any = object()  # the default of a field that has none

# How the builder and the drop-in map a field onto torch's ``load_inline`` (``Field.torch``):
PASS = "pass"  # a ``load_inline`` parameter of the same name: the drop-in forwards its argument,
#                the builder hands torch the field's JSON value unchanged
REWRITE = "rewrite"  # a ``load_inline`` parameter the drop-in forwards, that the builder rewrites
#                      (sources written out, flags quoted, a value torch must not decide)


class Field:
    """One row of :data:`FIELDS`: a :class:`StubSpec` field and every rule derived from it.

    ``check(value, name)`` validates and normalises a constructor argument (raising
    ``TypeError``/``ValueError``) into the stored, immutable value; ``data(stored)`` gives its
    JSON form for :meth:`StubSpec.to_dict` (``None``: the value itself); ``key(spec)`` gives its
    value in the key pre-image :meth:`StubSpec.canonical`, stored under ``key_name`` (``None``:
    the JSON form); ``from_key(value)`` turns that value back into a constructor argument
    (``None``: unchanged); ``torch`` is :data:`PASS`, :data:`REWRITE` or ``None`` (not a
    parameter of torch's ``load_inline``).
    """

    __slots__ = ("name", "default", "check", "data", "key", "key_name", "from_key", "torch")

    def __init__(self, name: str, default: Any, check: Any, *, data: Any = None, key: Any = None,
                 key_name: str | None = None, from_key: Any = None, torch: str | None) -> None:
        self.name = name
        self.default = default
        self.check = check
        self.data = data
        self.key = key
        self.key_name = key_name or name
        self.from_key = from_key
        self.torch = torch

    def __repr__(self) -> str:
        return f"Field({self.name!r})"


# Every field of a spec, in constructor order. Every field enters the key: one that provably does
# not change the library gets a key rule mapping it to a constant (as is_python_module does
# without functions), never leaves the key. docs/cache.md "Adding a spec field" says what else to do.
FIELDS: tuple[Field, ...] = (
    Field("name", REQUIRED, validate_name, torch=PASS),
    Field("cpp_sources", (), _str_list, data=list, torch=REWRITE),
    Field("cuda_sources", None, _str_list, data=list, torch=REWRITE),
    # sorted (name, docstring) pairs: the binding order is irrelevant, so it must not split the key
    Field("functions", None, _functions, data=_pairs_to_dict, key=_functions_key, from_key=_pairs_to_dict,
          torch=PASS),
    Field("extra_cflags", None, _flag_words, data=list, torch=REWRITE),
    Field("extra_cuda_cflags", None, _flag_words, data=list, torch=REWRITE),
    Field("extra_ldflags", None, _flag_words, data=list, torch=REWRITE),
    Field("extra_include_paths", None, _include_paths, data=list, torch=REWRITE),
    Field("with_cuda", None, _optional_bool, key=attrgetter("effective_with_cuda"), torch=PASS),
    Field("is_python_module", False, _bool, key=_only_with_functions("is_python_module"), from_key=bool,
          torch=REWRITE),
    Field("with_pytorch_error_handling", True, _bool, key=_only_with_functions("with_pytorch_error_handling"),
          from_key=lambda value: value is not False, torch=PASS),
    Field("no_implicit_headers", None, _optional_bool, key=attrgetter("skips_implicit_headers"), torch=REWRITE),
    Field("builder", None, _builder, key=attrgetter("build_method"), key_name="build_method", torch=None),
    # load()'s files: each source its own translation unit (one object per file, one link)
    Field("separate_units", False, _bool, torch=None),
)
FIELD_NAMES = frozenset(f.name for f in FIELDS)

# Precomputed rows for the per-call paths (a spec is built on every first load_inline call).
# A default argument skips its check: checks are pure, so its stored value is computed once, here.
_CHECKS = tuple((f.name, f.check, f.default, None if f.default is REQUIRED else f.check(f.default, f.name))
                for f in FIELDS)
_DATA = tuple((f.name, attrgetter(f.name), f.data) for f in FIELDS)
_KEY = tuple((f.key_name, f.key, None) if f.key else (f.key_name, attrgetter(f.name), f.data) for f in FIELDS)


def spec_from_canonical(data: Mapping[str, Any]) -> "StubSpec":
    """The spec whose :meth:`StubSpec.canonical` is ``data`` (a manifest's ``preimage.spec``);
    raises ``KeyError``/``TypeError``/``ValueError`` for data that is not such a form."""
    args: dict[str, Any] = {}
    for f in FIELDS:
        value = data[f.key_name] if f.default is REQUIRED else data.get(f.key_name)
        args[f.name] = value if f.from_key is None else f.from_key(value)
    return StubSpec(**args)


class StubSpec:
    """A stub to build: the sources and options of a ``load_inline`` call.

    Args:
        name: module/library name, ``[A-Za-z_][A-Za-z0-9_]*``, at most 100 characters.
        cpp_sources: C++ source text (a string or list of strings, concatenated into one file).
        cuda_sources: CUDA source text, compiled by nvcc into the same library.
        functions: names (or a dict name -> docstring) to bind as a Python module; needs torch headers.
        extra_cflags, extra_cuda_cflags, extra_ldflags: lists of extra flags.
        extra_include_paths: ``-I`` directories. Every header a build reads (from these or from
            anywhere else the fingerprint does not pin) is tracked by content.
        with_cuda: add CUDA headers/libraries; ``None`` means "if there are ``cuda_sources``".
        is_python_module: the library is a Python extension module (default ``False``: a plain
            shared library for ``ctypes``/``torch.ops``).
        with_pytorch_error_handling: as in torch (only matters with ``functions``).
        no_implicit_headers: skip torch's prepended ``#include <torch/extension.h>``. ``None``
            (default) decides automatically: skip them only when ``functions`` is empty and no
            source mentions torch, ATen, c10 or pybind11.
        builder: ``None`` (automatic), ``"direct"`` or ``"load_inline"``; see :attr:`build_method`.
            ``"direct"`` is refused for specs that need torch headers, a Python module or CUDA.
        separate_units: compile each source as its own translation unit and link the objects,
            as torch's ``load()`` does with its files (default ``False``: ``load_inline``'s one
            file). With more than one source it takes torch's build path.

    Invalid input raises ``TypeError``/``ValueError`` here, before anything touches disk. A
    spec is immutable (a cache remembers its key): use :meth:`replace` for a changed copy.
    """

    __slots__ = tuple(f.name for f in FIELDS) + (
        "_canonical",
        "_mentions", "_host_targets", "_tool_flags", "_reads_user_files",
    )
    # The slots' stored types, for type checkers (the fields are FIELDS, in order, as their checks
    # store them; tests/test_spec_fields.py checks the names). No values: slots, not class attributes.
    name: str
    cpp_sources: tuple[str, ...]
    cuda_sources: tuple[str, ...]
    functions: tuple[tuple[str, str], ...] | None
    extra_cflags: tuple[str, ...]
    extra_cuda_cflags: tuple[str, ...]
    extra_ldflags: tuple[str, ...]
    extra_include_paths: tuple[str, ...]
    with_cuda: bool | None
    is_python_module: bool
    with_pytorch_error_handling: bool
    no_implicit_headers: bool | None
    builder: str | None
    separate_units: bool
    _canonical: dict[str, Any] | None
    _mentions: bool | None
    _host_targets: tuple[str, ...]
    _tool_flags: tuple[str, ...]
    _reads_user_files: bool

    def __init__(
        self,
        name: str,
        cpp_sources: str | Sequence[str] = (),
        cuda_sources: str | Sequence[str] | None = None,
        functions: Sequence[str] | Mapping[str, str] | str | None = None,
        extra_cflags: Sequence[str] | None = None,
        extra_cuda_cflags: Sequence[str] | None = None,
        extra_ldflags: Sequence[str] | None = None,
        extra_include_paths: Sequence[str] | None = None,
        with_cuda: bool | None = None,
        is_python_module: bool = False,
        with_pytorch_error_handling: bool = True,
        no_implicit_headers: bool | None = None,
        builder: str | None = None,
        separate_units: bool = False,
    ) -> None:
        # The parameters above are FIELDS, in order and with its defaults (tests/test_spec_fields.py
        # checks it): spelled out so that callers and type checkers see them.
        args = locals()
        _set = object.__setattr__  # immutable: every field is set once, here (see __setattr__)
        _set(self, "_canonical", None)
        _set(self, "_mentions", None)
        for field, check, default, stored_default in _CHECKS:
            value = args[field]
            _set(self, field, stored_default if value is default else check(value, field))
        # Every list that reaches a compiler or linker, scanned once (stubcache.key.flagscan): on
        # the direct path compile and link are one command, so ldflags search headers too.
        if self.extra_cflags or self.extra_cuda_cflags or self.extra_ldflags:
            from .flagscan import scan  # flags only: a spec without them never imports it

            found = scan(self.extra_cflags, self.extra_cuda_cflags, self.extra_ldflags)
            _set(self, "_host_targets", found.host_targets)
            # The tools the C++ driver runs: nvcc's flags do not reach it.
            _set(self, "_tool_flags", (scan(self.extra_cflags, self.extra_ldflags) if self.extra_cuda_cflags
                                       else found).tool_flags)
            _set(self, "_reads_user_files", found.reads_user_files)
        else:  # what scan() finds in no flags
            _set(self, "_host_targets", ())
            _set(self, "_tool_flags", ())
            _set(self, "_reads_user_files", False)
        if builder == "direct" and not self._direct_ok():
            raise ValueError(f"stub {name!r} cannot take the direct build path: it needs torch headers, "
                             "a Python module or CUDA")
        if not self.cpp_sources and not self.cuda_sources:
            raise ValueError("a stub needs at least one of cpp_sources or cuda_sources")

    def __setattr__(self, name: str, value: Any) -> None:
        # A spec memoises its canonical form, and a cache its key: a field changed after use
        # would keep the old key and serve the old library. Only the private memo slots may be
        # (re)set.
        if name in ("_canonical", "_mentions"):
            object.__setattr__(self, name, value)
            return
        raise AttributeError(f"StubSpec is immutable: cannot set {name!r}; build a new StubSpec instead")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"StubSpec is immutable: cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # pickle and copy rebuild through __init__ (validation included), never by setattr.
        return (StubSpec.from_dict, (self.to_dict(),))

    def replace(self, **changes: Any) -> "StubSpec":
        """A new spec equal to this one except for ``changes`` (fields as in :meth:`to_dict`)."""
        data = self.to_dict()
        data.update(changes)
        return StubSpec.from_dict(data)

    # --- derived properties (pure) ---------------------------------------------------------

    @property
    def effective_with_cuda(self) -> bool:
        return bool(self.cuda_sources) if self.with_cuda is None else self.with_cuda

    @property
    def skips_implicit_headers(self) -> bool:
        """Whether torch's implicit headers are left out (the automatic rule when ``None``)."""
        if self.no_implicit_headers is not None:
            return self.no_implicit_headers
        return not self.functions and not self._mentions_torch()

    def _mentions_torch(self) -> bool:
        if self._mentions is None:
            mentions = mentions_torch(self.cpp_sources + self.cuda_sources)
            object.__setattr__(self, "_mentions", mentions)
            return mentions
        return self._mentions

    @property
    def build_method(self) -> str:
        """``"direct"`` (one compiler call, no torch import) or ``"load_inline"``.

        The direct path is taken only for a plain C/C++ library that needs neither torch's
        headers nor a Python module nor CUDA; the flags mirror what torch would pass.
        """
        if self.builder is not None:
            return self.builder
        return "direct" if self._direct_ok() else "load_inline"

    def _direct_ok(self) -> bool:
        return (
            not (self.separate_units and len(self.cpp_sources) + len(self.cuda_sources) > 1)
            and self.skips_implicit_headers
            and not self.is_python_module
            and not self.cuda_sources
            and not self.effective_with_cuda
            and not self._mentions_torch()
        )

    @property
    def host_targets(self) -> tuple[str, ...]:
        """Flags whose meaning depends on this machine's CPU (``-march=native`` and friends)."""
        return self._host_targets

    @property
    def tool_flags(self) -> tuple[str, ...]:
        """Flags that choose which assembler or linker the compiler driver runs (``-fuse-ld=``,
        ``--ld-path=``, ``-B``): the programs they select are identified in the key."""
        return self._tool_flags

    @property
    def tracks_headers(self) -> bool:
        """True when the flags name user include directories or files. Such a spec is looked up
        again on every call in a process (its headers may change); others are memoised per
        process. Either way every header a build read is part of the entry key."""
        return bool(self.extra_include_paths) or self._reads_user_files

    def canonical(self) -> dict[str, Any]:
        """The spec's part of the key pre-image: plain JSON data, independent of option order."""
        if self._canonical is None:
            canonical: dict[str, Any] = {}
            for key_name, get, data in _KEY:
                value = get(self)
                canonical[key_name] = value if data is None else data(value)
            object.__setattr__(self, "_canonical", canonical)  # a memo slot: skips the guard
            return canonical
        return self._canonical

    def to_json(self) -> str:
        """The spec as a JSON string (a spec file ``stubcache warm`` reads); :meth:`from_json`
        turns it back into an equal spec."""
        import json

        return json.dumps(self.to_dict(), sort_keys=True, ensure_ascii=False)

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain JSON-ready data; :meth:`from_dict` turns it back into an equal spec."""
        out = {}
        for field, get, data in _DATA:
            value = get(self)
            out[field] = value if data is None else data(value)
        return out

    @classmethod
    def from_json(cls, data: "str | bytes | Mapping[str, Any]") -> "StubSpec":
        """Build a spec from :meth:`to_json` output (a string; a mapping is read as
        :meth:`from_dict` does); unknown fields are an error."""
        if isinstance(data, (str, bytes, bytearray)):
            import json

            return cls.from_dict(json.loads(data))
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StubSpec":
        """Build a spec from :meth:`to_dict` output; unknown fields are an error."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a spec must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - FIELD_NAMES
        if unknown:
            raise ValueError(f"unknown spec field(s): {', '.join(sorted(unknown))}")
        return cls(**data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StubSpec) and self.canonical() == other.canonical() and (
            self.no_implicit_headers == other.no_implicit_headers
        )

    def __hash__(self) -> int:
        return hash((self.name, self.cpp_sources, self.cuda_sources, self.extra_cflags))

    def __repr__(self) -> str:
        size = sum(len(s) for s in self.cpp_sources + self.cuda_sources)
        return (
            f"StubSpec(name={self.name!r}, {len(self.cpp_sources)} cpp/{len(self.cuda_sources)} cuda "
            f"source(s), {size} chars, method={self.build_method})"
        )
