"""stubcache: build each native stub once per host, share it safely, load it in microseconds.

Public surface::

    StubSpec, StubCache, Entry           the cache
    load_inline, load                    drop-ins for torch.utils.cpp_extension
    StubCacheError, BuildError, ...      errors

``import stubcache`` does not import torch; torch is imported only when a build needs it.
"""

from __future__ import annotations

from .cache import Entry, StubCache, __version__
from .compat import default_cache, load, load_inline
from .errors import (BuildError, CacheMissError, IntegrityError, LockTimeoutError, StubCacheError,
                     TrustError)
from .manifest import Manifest
from .spec import StubSpec

__all__ = [
    "BuildError", "CacheMissError", "Entry", "IntegrityError", "LockTimeoutError", "Manifest",
    "StubCache", "StubCacheError", "StubSpec", "TrustError", "__version__", "default_cache", "load",
    "load_inline",
]
