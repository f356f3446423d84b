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
    from .cache.core import Entry
    from .dropin import compat as compat, patch as patch  # the submodules' names before the layer folders
    from .dropin.compat import default_cache, load
    from .dropin.patch import patch_torch, unpatch_torch
    from .edge.errors import (BuildError, CacheMissError, IntegrityError, LockTimeoutError, StubCacheError,
                              TrustError, UnsupportedError)
    from .hit.dropinfront import load_inline
    from .hit.front import StubCache
    from .key import StubSpec
    from .storage.manifest import Manifest, __version__

# Every name is imported when first used: an engine's warm ``stubcache.load_inline`` call needs
# only the drop-in's front and the compact hit path (stubcache.hit.dropinfront and the package stubcache.hit), not
# the cache, the spec or the errors, each of which costs an engine process ~0.1 ms or more.
_LAZY = {"Entry": "cache.core", "StubCache": "hit.front", "StubSpec": "key", "Manifest": "storage.manifest",
         "__version__": "storage.manifest", "BuildError": "edge.errors", "CacheMissError": "edge.errors",
         "IntegrityError": "edge.errors", "LockTimeoutError": "edge.errors", "StubCacheError": "edge.errors",
         "TrustError": "edge.errors", "UnsupportedError": "edge.errors", "load_inline": "hit.dropinfront",
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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BuildError", "CacheMissError", "Entry", "IntegrityError", "LockTimeoutError", "Manifest",
    "StubCache", "StubCacheError", "StubSpec", "TrustError", "UnsupportedError", "__version__", "default_cache",
    "load", "load_inline", "patch_torch", "unpatch_torch",
]
