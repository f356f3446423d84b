"""Host backend: reserve with ``mmap(PROT_NONE)``, commit with ``mprotect``, uncommit with
``madvise(MADV_DONTNEED)`` + ``mprotect(PROT_NONE)``, release with ``munmap``."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

from .errors import ArenaError

log = logging.getLogger("kvarena")

PROT_NONE = getattr(mmap, "PROT_NONE", 0)
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
MAP_PRIVATE = mmap.MAP_PRIVATE
MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mprotect.restype = ctypes.c_int
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = libc
    return _libc


def _oserror(call: str, extra: str = "") -> ArenaError:
    err = ctypes.get_errno()
    return ArenaError(f"{call} failed: {os.strerror(err)} (errno {err}){extra}")


class HostBackend:
    """Virtual memory of this process, reserved once, committed in ``granularity`` steps."""

    kind = "cpu"

    def __init__(self, reserve_bytes: int, granularity: int | None = None) -> None:
        page = mmap.PAGESIZE
        gran = page if granularity is None else int(granularity)
        if gran <= 0 or gran % page:
            raise ValueError(f"granularity must be a positive multiple of the page size {page}, got {gran}")
        self.granularity = gran
        self.reserved = -(-int(reserve_bytes) // gran) * gran
        libc = _lib()
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
        addr = libc.mmap(None, self.reserved, PROT_NONE, flags, -1, 0)
        if addr is None or addr == MAP_FAILED:
            raise _oserror(f"mmap(PROT_NONE, {self.reserved} bytes)", "; is the address space limited (ulimit -v)?")
        self.base = int(addr)
        self._end = 0  # committed bytes from base
        self._released = False

    def grow(self, old: int, new: int) -> None:
        """Make ``[base+old, base+new)`` readable and writable (both granularity-aligned)."""
        if _lib().mprotect(self.base + old, new - old, PROT_RW) != 0:
            raise _oserror(f"mprotect(+{old}, {new - old}, READ|WRITE)")
        self._end = new

    def shrink_target(self, keep: int) -> int:
        """What :meth:`shrink` ``(keep, ...)`` would leave committed: ``keep`` itself."""
        return keep

    def mapped_bytes(self) -> int:
        """Bytes from ``base`` that are committed right now."""
        return self._end

    def shrink(self, keep: int, old: int) -> int:
        """Drop the pages of ``[base+keep, base+old)`` and make them inaccessible; returns ``keep``."""
        libc = _lib()
        size = old - keep
        if libc.madvise(self.base + keep, size, MADV_DONTNEED) != 0:
            raise _oserror(f"madvise(+{keep}, {size}, DONTNEED)")
        if libc.mprotect(self.base + keep, size, PROT_NONE) != 0:
            raise _oserror(f"mprotect(+{keep}, {size}, NONE)")
        self._end = keep
        return keep

    def release(self) -> None:
        """Unmap the whole reservation; if that fails, say what is left (a retry tries again)."""
        if self._released:
            return
        if _lib().munmap(self.base, self.reserved) != 0:
            raise _oserror(f"munmap({self.reserved} bytes)",
                           f"; still held: the reservation at {self.base:#x} ({self.reserved} bytes, "
                           f"{self._end} committed); close() again to retry")
        self._released = True
