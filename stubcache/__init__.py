"""stubcache: build each native stub once per host, share it safely, load it in microseconds.

Public surface::

    StubSpec, StubCache, Entry           the cache
    load_inline, load                    drop-ins for torch.utils.cpp_extension
    patch_torch, unpatch_torch           route torch's own loaders through the cache
    StubCacheError, BuildError, ...      errors

``import stubcache`` does not import torch; torch is imported only when a build needs it.
"""

from __future__ import annotations

import sys as _sys

if "-m" in _sys.orig_argv and _sys.orig_argv[_sys.orig_argv.index("-m") + 1:][:1] == ["stubcache"]:
    # `python -m stubcache` put the working directory first on sys.path; a module planted there
    # (json.py, ctypes.py, a spec module for `warm`) must not be imported by an administrator's
    # command. Dropped before anything else is imported. PYTHONPATH entries stay. (-P, which
    # sets sys.flags.safe_path, is 3.11+.)
    import os as _os

    if _sys.path and not getattr(_sys.flags, "safe_path", False) and _sys.path[0] in ("", _os.getcwd()):
        del _sys.path[0]

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:  # what __getattr__ below returns for each name, for type checkers
    from typing import Any, Sequence

    from .cache.core import Entry
    from .dropin import compat as compat, patch as patch  # the submodules' names before the layer folders
    from .dropin.compat import default_cache, load
    from .dropin.patch import patch_torch, unpatch_torch
    from .edge.errors import (BuildError, CacheMissError, IntegrityError, LockTimeoutError, StubCacheError,
                              TrustError, UnsupportedError)
    from .hit.front import StubCache
    from .key import StubSpec
    from .storage.manifest import Manifest, __version__

# The compact hit path (the package stubcache.hit) is imported with the package: a process's first
# load needs it anyway, and one that imported stubcache before it forked (a pool of engine
# workers, a herd starting at once) then shares it with its children, which would otherwise each
# pay its import (~1.5 ms of CPU in a child forked after `import torch`).
from . import hit  # noqa: E402  (after the working directory is dropped from sys.path, above)

# Every other name but load_inline is imported when first used: an engine's warm
# ``stubcache.load_inline`` call needs only its front (below) and the compact hit path, not the
# cache, the spec or the errors, each of which costs an engine process ~0.1 ms or more.
_LAZY = {"Entry": "cache.core", "StubCache": "hit.front", "StubSpec": "key", "Manifest": "storage.manifest",
         "__version__": "storage.manifest", "BuildError": "edge.errors", "CacheMissError": "edge.errors",
         "IntegrityError": "edge.errors", "LockTimeoutError": "edge.errors", "StubCacheError": "edge.errors",
         "TrustError": "edge.errors", "UnsupportedError": "edge.errors",
         "default_cache": "dropin.compat", "load": "dropin.compat", "patch_torch": "dropin.patch",
         "unpatch_torch": "dropin.patch"}


# ``stubcache.compat`` and ``stubcache.patch`` named these modules before the package had layer
# folders (docs/cache.md quoted ``stubcache.compat.Unsupported``): kept for code written then.
_MOVED = {"compat": "dropin.compat", "patch": "dropin.patch"}


def __getattr__(name: str) -> object:
    # __import__, not importlib.import_module: the same import, but one `python -X importtime` reports
    if name in _MOVED:
        value = __import__(f"{__name__}.{_MOVED[name]}", fromlist=["_"])
    elif name in _LAZY:
        value = getattr(__import__(f"{__name__}.{_LAZY[name]}", fromlist=[name]), name)
    else:
        raise AttributeError(f"module 'stubcache' has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain attribute reads
    return value


# The drop-in's front lives in the package module: an engine process pays ~0.2 ms for every
# module a warm call imports, and this one is imported anyway. A warm call is served by the
# compact hit path (stubcache.hit.dropin_call: the record the full drop-in left for the very same
# call, every check made there); anything else goes to the full drop-in, which leaves the record.
def load_inline(
    name: str,
    cpp_sources: str | Sequence[str],
    cuda_sources: str | Sequence[str] | None = None,
    sycl_sources: str | Sequence[str] | None = None,
    functions: Sequence[str] | dict[str, str] | str | None = None,
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

    As torch does, a second call in one process with the same ``name`` and different inputs loads
    the new code as module ``name_v1`` (then ``name_v2``, ...); ``verbose=True`` shows torch's build
    output (commands and compiler output, live, on stdout); a failed build raises
    :class:`stubcache.BuildError`, a ``RuntimeError`` with torch's message shape.

    With a ``build_directory``, the library is also at ``<build_directory>/<name>.so`` when this
    returns, and that file is the one loaded (a later ``dlopen`` of that path gets the same
    handle, as with torch); the build itself happens in a private staging directory, never there
    (see :mod:`stubcache.dropin.builddir` for the checks on the directory). ``keep_intermediates`` and
    ``use_pch`` are accepted and ignored; flags are split into words as torch's build file does,
    but never seen by a shell; ``functions`` may also be a tuple. SYCL and ``gil_not_used`` are not
    supported (:class:`stubcache.UnsupportedError`, a ``ValueError``; a patched torch hands such
    calls to torch).
    """
    args = locals()
    served = hit.dropin_call(args)
    if type(served) is not hit.Miss:
        return served
    try:
        if served.turn is not None:  # this process serves the call: its compile may begin now
            from .hit import early

            early.begin(name, args, served)
        from .dropin import compat

        return compat.load_inline_recording(served.digest, args, served.since, served.take_begun())
    finally:
        served.release()


setattr(load_inline, "__stubcache_dropin__", True)  # stubcache.hit.DROPIN_MARK (stubcache.build.torchjit reads it)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BuildError", "CacheMissError", "Entry", "IntegrityError", "LockTimeoutError", "Manifest",
    "StubCache", "StubCacheError", "StubSpec", "TrustError", "UnsupportedError", "__version__", "default_cache",
    "load", "load_inline", "patch_torch", "unpatch_torch",
]
