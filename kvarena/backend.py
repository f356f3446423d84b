"""What an arena needs from its memory: one reserved address range, committed from ``base``
upwards. Two backends provide it: :class:`kvarena.host.HostBackend` (``mmap``/``mprotect``)
and :class:`kvarena.cuda.CudaBackend` (the CUDA driver's virtual memory API). The arena talks to
them only through this protocol; ``tests/test_kvarena_backends.py`` checks both against it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class MemoryBackend(Protocol):
    """A reserved address range ``[base, base + reserved)``, committed in ``granularity`` steps.

    Offsets are bytes from ``base``; ``old``/``new``/``keep`` are multiples of ``granularity``.
    A failed call raises :class:`kvarena.ArenaError` and leaves :meth:`mapped_bytes` honest.
    """

    kind: str          # "cpu" or "cuda"
    base: int          # start address of the reservation
    reserved: int      # its size in bytes (a multiple of granularity)
    granularity: int   # the commit step in bytes

    def grow(self, old: int, new: int) -> None:
        """Back ``[base+old, base+new)`` with memory, all or nothing."""
        ...

    def shrink_target(self, keep: int) -> int:
        """What :meth:`shrink` ``(keep, ...)`` would leave committed (``keep`` or more)."""
        ...

    def shrink(self, keep: int, old: int) -> int:
        """Give back the memory of ``[base+keep, base+old)``; returns what stays committed."""
        ...

    def mapped_bytes(self) -> int:
        """Bytes from ``base`` backed without a gap right now (the truth after a failed call)."""
        ...

    def release(self) -> None:
        """Give back everything, the address range included; a failure says what is left and a
        second call retries only that."""
        ...
