"""Drop-ins for ``torch.utils.cpp_extension.load_inline`` and ``load``, backed by the cache."""

from __future__ import annotations

import os
import sys
import threading

from ..edge import kpath
from ..cache.core import Entry
from ..hit.front import StubCache
from ..hit import frozen, versioned, versions as _versions, versions_lock
from ..key.fingerprint import env_snapshot
from ..build.torchjit import mark
from ..edge.errors import UnsupportedError
from ..key import FIELDS, StubSpec
from ..storage.store import default_root  # all three loaded with .cache: a function-level import costs ~1.5 us a call

Unsupported = UnsupportedError  # its name before errors.py held it (docs/cache.md quoted it)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Sequence

    from ..hit.early import Begun


_caches: dict[str, StubCache] = {}
_modules: dict[tuple[Any, ...], Any] = {}
_call_memo: dict[tuple[Any, ...], Any] = {}
# The spec fields load_inline takes from torch's parameters of the same name (FIELDS' torch
# column), in order; ``name`` is not among them: the drop-in versions it first.
_FORWARDED = tuple(f.name for f in FIELDS if f.torch and f.name != "name")


_frozen = frozen
_versioned = versioned
_lock = threading.Lock()


def _functions_like_torch(functions: Any) -> Any:
    """``functions`` as torch's ``load_inline`` reads it, with its error for other types."""
    if functions is None or isinstance(functions, dict):
        return functions
    if isinstance(functions, str):
        functions = [functions]
    if isinstance(functions, (list, tuple)):  # torch takes lists only; a tuple is read the same
        return {f: f for f in functions}
    raise ValueError(f"Expected 'functions' to be a list or dict, but was {type(functions)}")


def default_cache() -> StubCache:
    """The process-wide :class:`StubCache` for the current ``STUBCACHE_DIR`` (or default root)."""
    root = default_root()
    cache = _caches.get(root)
    if cache is None:
        with _lock:
            cache = _caches.setdefault(root, StubCache(root))
    return cache


def _unsupported(**kwargs: Any) -> None:
    for name, value in kwargs.items():
        if value:
            raise UnsupportedError(f"stubcache does not support {name}={value!r}; call torch.utils.cpp_extension "
                              "directly (a patched torch does so by itself)")


def _import_entry(cache: StubCache, entry: Entry, is_python_module: bool, build_directory: Any = None) -> Any:
    """Load an entry the way torch's ``_import_module_from_library`` would: from the cache, or,
    with a ``build_directory``, from the copy placed at ``<build_directory>/<name>.so``."""
    if build_directory is not None:
        # Placed and loaded on every call, as torch imports from there on every call: the caller
        # may have removed the file or the directory since.
        return _import_placed(cache, entry, is_python_module, build_directory)
    key = (entry.key, is_python_module)
    if entry.published and key in _modules:
        return _modules[key]
    # Every load below is by the path load_entry verified and loaded, so glibc hands back that
    # checked handle even if the entry has since been replaced on disk.
    elif entry.manifest.build_method == "direct":
        result = cache.loaded_path(entry)  # the real path it was loaded (and checked) by
    else:
        import torch  # first: the library needs libtorch (and its Python bindings) loaded

        path = cache.loaded_path(entry)
        result = _import_module(entry.manifest.module_name, path) if is_python_module else path
        if not is_python_module:
            torch.ops.load_library(path)  # type: ignore[no-untyped-call]  # torch leaves it untyped
    if entry.published:
        _modules[key] = result
    return result


def _import_module(name: str, path: str) -> Any:
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]  # the loader given above
    # `import name` after load() (Megatron, transformers' kernels, nvdiffrast): CPython registers
    # a single-phase extension module there itself; a multi-phase one is put there as well.
    sys.modules.setdefault(name, module)
    return module


def _import_placed(cache: StubCache, entry: Entry, is_python_module: bool, build_directory: Any) -> Any:
    """Place the library in ``build_directory`` (see :mod:`stubcache.dropin.builddir`) and load that
    very file, so that a later ``dlopen`` of ``<build_directory>/<name>.so`` gets this handle."""
    import ctypes

    from . import builddir
    from ..storage.mapped import check_mapped

    placed = builddir.place(build_directory, entry.path, entry.manifest, entry.manifest.module_name)
    try:
        real = os.path.realpath(placed.path)
        if entry.manifest.build_method == "direct":
            result: Any = placed.path
        else:
            import torch  # the library needs libtorch (and its Python bindings) loaded first

            if is_python_module:
                result = _import_module(entry.manifest.module_name, os.path.abspath(placed.path))
            else:
                torch.ops.load_library(placed.path)  # type: ignore[no-untyped-call]  # torch leaves it untyped
                result = placed.path
        lib = ctypes.CDLL(real)  # the handle already loaded by that name (or the first load)
        check_mapped(real, placed.st, entry.manifest.sha256, lib._handle, placed.fd)
    finally:
        os.close(placed.fd)
    return result


def load_inline_recording(record: str | None, args: dict[str, Any], since: float | None = None,
                          begun: Begun | None = None) -> Any:
    """The full path of :func:`stubcache.load_inline` (the public drop-in, documented there),
    taken when no hit record answers the call; ``args`` are its arguments by name. With ``record`` (a digest from
    :func:`stubcache.hit.request_digest`), a hit record is left for that call where the
    entry qualifies (see :meth:`StubCache.remember_hit`), so the next process's identical call
    takes the compact hit path (:func:`stubcache.hit.dropin_call`). ``since``: when the caller
    began waiting for another process serving the same call (see
    :meth:`stubcache.cache.core.CacheCore.get_or_build_since`). ``begun``: the call's compile,
    begun by the compact path (:mod:`stubcache.hit.early`): taken over by the build if it is that
    build's, else stopped."""
    try:
        return _load_inline_recording(record, args, since, begun)
    finally:
        if begun is not None:
            begun.discard()  # (nothing if the build took it)


def _load_inline_recording(record: str | None, args: dict[str, Any], since: float | None, begun: Begun | None) -> Any:
    _unsupported(sycl_sources=args["sycl_sources"], extra_sycl_cflags=args["extra_sycl_cflags"],
                 with_sycl=args["with_sycl"], gil_not_used=args["gil_not_used"])
    args = dict(args, functions=_functions_like_torch(args["functions"]))
    name, cpp_sources, build_directory = args["name"], args["cpp_sources"], args["build_directory"]
    if cpp_sources is None:  # torch fails joining it: a TypeError there too
        raise TypeError("cpp_sources must be str or a list of str, got None")
    if not cpp_sources and not args["cuda_sources"] and isinstance(cpp_sources, (str, list, tuple)):
        args["cpp_sources"] = [""]  # torch builds an empty main.cpp (its headers only): so does the spec
    root = default_root()
    # Repeated calls with the same arguments (engines call this per layer or per request) skip
    # validation and hashing: torch returns the already-loaded module in that case too.
    memo_key = call = None
    try:
        call = tuple([_frozen(args[f]) for f in _FORWARDED])
        module_name = _versioned(name, call) if isinstance(name, str) else name
        memo_key = (root, env_snapshot(), module_name, call)
        # With a build_directory the library is placed there again on every call (the caller
        # may have removed it): no memo.
        hit = _call_memo.get(memo_key) if build_directory is None else None
    except TypeError:  # unhashable odd input: the spec below reports it properly
        hit = None
        module_name = name
    if hit is not None:
        return hit
    fields = {f: args[f] for f in _FORWARDED}
    fields["no_implicit_headers"] = bool(args["no_implicit_headers"])  # torch's False keeps the headers; None would decide
    spec = StubSpec(module_name, **fields)
    entry, result = _get_and_import(spec, args["verbose"], name, call, build_directory, since, begun)
    if memo_key is not None and build_directory is None and entry.published and not spec.tracks_headers:
        _call_memo[memo_key] = result
    if record is not None and module_name == name:
        default_cache().remember_hit(spec, entry, record)
    else:
        default_cache().leave_start_template()
    return result


_imported: dict[str, str] = {}  # Python module name -> key of the library imported under it


class _Quiet:
    """The scope of a quiet call in a process that never asked for verbose output (so no
    from ..edge import progress

    thread's flag is set): nothing to set or restore, and no need to import progress."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_QUIET = _Quiet()


def _verbose_scope(verbose: bool) -> Any:
    if verbose or "stubcache.edge.progress" in sys.modules:
        from ..edge import progress

        return progress.verbose_scope(verbose)
    return _QUIET


def _get_and_import(spec: StubSpec, verbose: bool, name: Any = None, call: Any = None,
                    build_directory: Any = None, since: float | None = None,
                    begun: Begun | None = None) -> tuple[Entry, Any]:
    cache = default_cache()
    with _verbose_scope(verbose):
        entry = cache.get_or_build_since(spec, since, begun)  # (the caller leaves the start template)
        while spec.is_python_module and isinstance(name, str):
            with versions_lock:
                prev = _imported.setdefault(spec.name, entry.key)
                if prev == entry.key:
                    break
                # Same arguments, another library under a name already imported (a header it
                # includes changed, the compiler changed): Python would hand back the module
                # imported first, so the new library gets the next name, as a change of sources does.
                version = _versions.get(name, (0, None))[0] + 1
                _versions[name] = (version, call)
            spec = spec.replace(name=f"{name}_v{version}")
            entry = cache.get_or_build(spec)
    if verbose:
        from ..edge import progress

        progress.echo(f"stubcache: loading extension module {spec.name} from {entry.path} "
                      f"({entry.manifest.build_method} build)\n")
    return entry, _import_entry(cache, entry, spec.is_python_module, build_directory)


_CUDA_EXT = (".cu", ".cuh")


def load(
    name: str,
    sources: str | Sequence[str],
    extra_cflags: Sequence[str] | None = None,
    extra_cuda_cflags: Sequence[str] | None = None,
    extra_sycl_cflags: Sequence[str] | None = None,
    extra_ldflags: Sequence[str] | None = None,
    extra_include_paths: Sequence[str] | None = None,
    build_directory: str | None = None,
    verbose: bool = False,
    with_cuda: bool | None = None,
    with_sycl: bool | None = None,
    is_python_module: bool = True,
    is_standalone: bool = False,
    keep_intermediates: bool = True,
) -> Any:
    """Drop-in for ``torch.utils.cpp_extension.load`` over source files on disk.

    The files' contents, read as bytes (a file need not be UTF-8), and the headers they include
    from their own directories or ``extra_include_paths`` are hashed into the key. As in torch,
    each file is its own translation unit (one object per file, one link); each file's
    directory is added to the include path (torch compiles the files where they are, so their
    quoted includes find their neighbours). A name loaded again with changed inputs becomes ``name_v1``, ... as in
    torch; ``build_directory`` is kept as :func:`load_inline` keeps it, ``keep_intermediates`` is
    ignored;
    ``is_standalone`` and SYCL raise :class:`UnsupportedError`.
    """
    _unsupported(extra_sycl_cflags=extra_sycl_cflags, with_sycl=with_sycl, is_standalone=is_standalone)
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    cpp: list[str] = []
    cuda: list[str] = []
    dirs: list[str] = []
    for src in sources:
        path = kpath.absolute(os.fspath(src))  # `link/../x.cpp` as the kernel reads it
        with open(path, "rb") as fh:  # bytes, as torch reads them: a source need not be UTF-8
            data = fh.read()
        # surrogateescape keeps undecodable bytes; the key and the build see the original bytes
        text = data.decode("utf-8", "surrogateescape")
        (cuda if path.endswith(_CUDA_EXT) else cpp).append(f'#line 1 "{path}"\n{text}')
        if os.path.dirname(path) not in dirs:
            dirs.append(os.path.dirname(path))
    call = (tuple(cpp), tuple(cuda), _frozen(extra_cflags), _frozen(extra_cuda_cflags), _frozen(extra_ldflags),
            _frozen(extra_include_paths), with_cuda, is_python_module)
    try:
        module_name = _versioned(name, call) if isinstance(name, str) else name
    except TypeError:
        module_name = name
    spec = StubSpec(
        module_name, cpp, cuda_sources=cuda or None, extra_cflags=extra_cflags,
        extra_cuda_cflags=extra_cuda_cflags, extra_ldflags=extra_ldflags,
        extra_include_paths=[*(extra_include_paths or []), *dirs], with_cuda=with_cuda,
        is_python_module=is_python_module, no_implicit_headers=True, separate_units=True,
    )
    result = _get_and_import(spec, verbose, name, call, build_directory)[1]
    default_cache().leave_start_template()
    return result


mark(load)
