"""Drop-ins for ``torch.utils.cpp_extension.load_inline`` and ``load``, backed by the cache."""

from __future__ import annotations

import os
import threading
from typing import Any, Sequence

from . import _log
from .cache import Entry, StubCache
from .spec import StubSpec

_caches: dict[str, StubCache] = {}
_modules: dict[tuple, Any] = {}
_call_memo: dict[tuple, Any] = {}


def _frozen(value: Any) -> Any:
    """A hashable form of a load_inline argument (lists become tuples, dicts sorted items)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value
_lock = threading.Lock()


def default_cache() -> StubCache:
    """The process-wide :class:`StubCache` for the current ``STUBCACHE_DIR`` (or default root)."""
    from .store import default_root

    root = default_root()
    cache = _caches.get(root)
    if cache is None:
        with _lock:
            cache = _caches.setdefault(root, StubCache(root))
    return cache


def _unsupported(**kwargs: Any) -> None:
    for name, value in kwargs.items():
        if value:
            raise ValueError(f"stubcache does not support {name}={value!r}; call torch.utils.cpp_extension directly")


def _import_entry(cache: StubCache, entry: Entry, is_python_module: bool) -> Any:
    """Load an entry the way torch's ``_import_module_from_library`` would."""
    key = (entry.key, is_python_module)
    if entry.published and key in _modules:
        return _modules[key]
    # Every load below goes through the name of the verified open file, so glibc hands back the
    # checked handle even if the entry has since been replaced on disk.
    if entry.manifest.build_method == "direct":
        cache.loaded_path(entry)
        result: Any = entry.path
    else:
        import torch  # first: the library needs libtorch (and its Python bindings) loaded

        fd_path = cache.loaded_path(entry)

        if is_python_module:
            import importlib.machinery
            import importlib.util

            name = entry.manifest.module_name
            loader = importlib.machinery.ExtensionFileLoader(name, fd_path)
            spec = importlib.util.spec_from_file_location(name, fd_path, loader=loader)
            if spec is None:
                raise ImportError(f"cannot import {entry.path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.__file__ = entry.path
            result = module
        else:
            torch.ops.load_library(fd_path)
            result = entry.path
    if entry.published:
        _modules[key] = result
    return result


def load_inline(
    name: str,
    cpp_sources: str | Sequence[str],
    cuda_sources: str | Sequence[str] | None = None,
    sycl_sources: str | Sequence[str] | None = None,
    functions: Sequence[str] | dict | str | None = None,
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
    with_pytorch_error_handling: bool = True,
    keep_intermediates: bool = True,
    use_pch: bool = False,
    no_implicit_headers: bool = False,
    gil_not_used: bool = False,
) -> Any:
    """Drop-in for ``torch.utils.cpp_extension.load_inline``: same parameters, same results
    (the module for ``is_python_module=True``, the library path otherwise), but content-addressed
    and safe for concurrent processes.

    ``build_directory``, ``keep_intermediates`` and ``use_pch`` are accepted for compatibility and
    ignored: every build happens in a private staging directory and only the library is kept.
    ``no_implicit_headers`` keeps torch's default (``False``). SYCL is not supported.
    """
    _unsupported(sycl_sources=sycl_sources, extra_sycl_cflags=extra_sycl_cflags, with_sycl=with_sycl,
                 gil_not_used=gil_not_used)
    from .fingerprint import _env_snapshot
    from .store import default_root

    # Repeated calls with the same arguments (engines call this per layer or per request) skip
    # validation and hashing: torch returns the already-loaded module in that case too.
    memo_key = None
    try:
        memo_key = (default_root(), _env_snapshot(), name, _frozen(cpp_sources), _frozen(cuda_sources),
                    _frozen(functions), _frozen(extra_cflags), _frozen(extra_cuda_cflags),
                    _frozen(extra_ldflags), _frozen(extra_include_paths), with_cuda, is_python_module,
                    with_pytorch_error_handling, no_implicit_headers)
        hit = _call_memo.get(memo_key)
    except TypeError:  # unhashable odd input: the spec below reports it properly
        hit = None
    if hit is not None:
        return hit
    spec = StubSpec(
        name, cpp_sources, cuda_sources=cuda_sources, functions=functions, extra_cflags=extra_cflags,
        extra_cuda_cflags=extra_cuda_cflags, extra_ldflags=extra_ldflags,
        extra_include_paths=extra_include_paths, with_cuda=with_cuda, is_python_module=is_python_module,
        with_pytorch_error_handling=with_pytorch_error_handling,
        no_implicit_headers=bool(no_implicit_headers),
    )
    cache = default_cache()
    entry = cache.get_or_build(spec)
    if verbose:
        _log.info("stubcache: %s -> %s (%s)", name, entry.path, entry.manifest.build_method)
    result = _import_entry(cache, entry, is_python_module)
    if memo_key is not None and entry.published and not spec.tracks_headers:
        _call_memo[memo_key] = result
    return result


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

    The files' contents (and the headers they include from their own directories or
    ``extra_include_paths``) are hashed into the key. The C++ files are compiled as one
    translation unit, in the order given; each file's directory is added to the include path.
    """
    _unsupported(extra_sycl_cflags=extra_sycl_cflags, with_sycl=with_sycl, is_standalone=is_standalone)
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    cpp: list[str] = []
    cuda: list[str] = []
    dirs: list[str] = []
    for src in sources:
        path = os.path.abspath(os.fspath(src))
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        (cuda if path.endswith(_CUDA_EXT) else cpp).append(f'#line 1 "{path}"\n{text}')
        if os.path.dirname(path) not in dirs:
            dirs.append(os.path.dirname(path))
    spec = StubSpec(
        name, cpp, cuda_sources=cuda or None, extra_cflags=extra_cflags,
        extra_cuda_cflags=extra_cuda_cflags, extra_ldflags=extra_ldflags,
        extra_include_paths=[*(extra_include_paths or []), *dirs], with_cuda=with_cuda,
        is_python_module=is_python_module, no_implicit_headers=True,
    )
    cache = default_cache()
    entry = cache.get_or_build(spec)
    if verbose:
        _log.info("stubcache: %s -> %s (%s)", name, entry.path, entry.manifest.build_method)
    return _import_entry(cache, entry, is_python_module)
