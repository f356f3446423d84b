"""kvarena: a KV-cache arena whose allocator stub comes from stubcache and binds into torch.

Public surface::

    KvArena                                   the arena (host or CUDA backend)
    allocator_spec, NSLOTS                    the stub (``kvarena.stub``)
    ArenaError and subclasses                 errors

``import kvarena`` imports neither torch nor ``cuda.bindings``; a host arena needs torch only
for :meth:`KvArena.tensor`, a CUDA arena imports both when it is created.
"""

from __future__ import annotations

import stubcache as _stubcache

if getattr(_stubcache, "__file__", None) is None:  # an empty namespace package, not stubcache
    raise ImportError(
        f"'stubcache' was imported from {list(getattr(_stubcache, '__path__', []))} as an empty namespace "
        "package: a directory named 'stubcache' (probably a clone of the repository) in the current "
        "directory shadows the installed package. Run Python from another directory or rename that one.")

from .arena import KvArena  # noqa: E402
from .errors import (ArenaClosedError, ArenaError, ArenaExhaustedError, CommitError, CudaUnavailableError,
                     SlotsExhaustedError)
from .stub import NSLOTS, StubTiming, allocator_spec, load_stub

__all__ = [
    "ArenaClosedError", "ArenaError", "ArenaExhaustedError", "CommitError", "CudaUnavailableError",
    "KvArena", "NSLOTS", "SlotsExhaustedError", "StubTiming", "allocator_spec", "load_stub",
]
