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
    # command. Dropped before anything else is imported. PYTHONPATH entries stay.
    import os as _os

    if _sys.path and not _sys.flags.safe_path and _sys.path[0] in ("", _os.getcwd()):
        del _sys.path[0]

from ._version import __version__
from .cache import Entry, StubCache
from .compat import default_cache, load, load_inline
from .errors import (BuildError, CacheMissError, IntegrityError, LockTimeoutError, StubCacheError,
                     TrustError)
from .manifest import Manifest
from .patch import patch_torch, unpatch_torch
from .spec import StubSpec

__all__ = [
    "BuildError", "CacheMissError", "Entry", "IntegrityError", "LockTimeoutError", "Manifest",
    "StubCache", "StubCacheError", "StubSpec", "TrustError", "__version__", "default_cache", "load",
    "load_inline", "patch_torch", "unpatch_torch",
]
