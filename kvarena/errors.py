"""Exception types. Every error kvarena raises on purpose derives from :class:`ArenaError`."""

from __future__ import annotations


class ArenaError(RuntimeError):
    """Base class of all kvarena errors."""


class ArenaClosedError(ArenaError):
    """The arena was used after :meth:`KvArena.close`."""


class ArenaExhaustedError(ArenaError, MemoryError):
    """An allocation does not fit in what is left of the arena's reservation."""


class CommitError(ArenaError, ValueError):
    """``commit`` was asked for more than the reservation, or a negative size."""


class SlotsExhaustedError(ArenaError):
    """Every allocator slot of the stub is held by an open arena in this process."""


class CudaUnavailableError(ArenaError):
    """A CUDA arena was requested where there is no GPU, no CUDA torch or no ``cuda-bindings``."""
