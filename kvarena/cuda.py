"""CUDA backend: the driver's virtual memory API through ``cuda-bindings`` (``pip install stubcache[cuda]``).

Reserve once with ``cuMemAddressReserve``; each ``commit`` step creates one physical
allocation (``cuMemCreate``), maps it (``cuMemMap``) and grants read-write access
(``cuMemSetAccess``), undoing whatever part succeeded if a later call fails. Uncommit unmaps
and releases whole mappings; teardown unmaps everything, then frees the address range.
``cuda.bindings.driver`` is imported only here, and only when a CUDA arena is created.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

from .errors import ArenaError, CudaUnavailableError

log = logging.getLogger("kvarena")


def cuda_device_index(device: Any) -> int:
    """The ordinal of a ``"cuda"``/``"cuda:N"``/``torch.device`` spec, checking torch can use it."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"not a CUDA device: {device!r}")
    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA GPU (driver missing or CUDA_VISIBLE_DEVICES empty)")
        raise CudaUnavailableError(f"a CUDA arena was requested on {device!r} but {why}; "
                                   "use device='cpu' for a host arena")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise CudaUnavailableError(f"no CUDA device {index}: torch sees {torch.cuda.device_count()}")
    return index


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaUnavailableError(
            f"a CUDA arena needs the cuda-bindings package ({exc}); install it with "
            "`pip install 'stubcache[cuda]'`") from None
    return driver


@dataclass
class _Mapping:
    """One physical allocation mapped at ``base + offset``; undone in two steps that can fail."""

    offset: int
    size: int
    handle: Any
    mapped: bool = True  # False once cuMemUnmap succeeded but cuMemRelease has not


class CudaBackend:
    """A CUDA virtual address range on one device, committed in granularity-aligned mappings."""

    kind = "cuda"

    def __init__(self, reserve_bytes: int, device_index: int) -> None:
        self.device_index = device_index
        cu = self._cu = _driver()
        try:
            self._check(cu.cuInit(0), "cuInit")
        except CudaUnavailableError:
            raise
        except Exception as exc:  # no driver: cuda.pathfinder raises instead of returning an error
            raise CudaUnavailableError(f"CUDA driver initialisation failed: {exc}") from None
        self._dev = self._check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        self._ctx = self._check(cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._ctx_held = True
        self._mappings: list[_Mapping] = []  # ascending offsets
        self.base = 0
        self.reserved = 0
        self._range_held = False
        try:
            prop = cu.CUmemAllocationProp()
            prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = device_index
            prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
            self._prop = prop
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device_index
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access = [access]
            with self._current():
                flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                self.granularity = int(self._check(cu.cuMemGetAllocationGranularity(prop, flag),
                                                   "cuMemGetAllocationGranularity"))
                self.reserved = -(-int(reserve_bytes) // self.granularity) * self.granularity
                ptr = self._check(cu.cuMemAddressReserve(self.reserved, self.granularity, 0, 0),
                                  f"cuMemAddressReserve({self.reserved})")
                self.base = int(ptr)
                self._range_held = True
        except BaseException:
            cu.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx_held = False
            raise

    def _check(self, result: Any, what: str) -> Any:
        if not isinstance(result, tuple):
            result = (result,)
        err = result[0]
        if err != self._cu.CUresult.CUDA_SUCCESS:
            _, name = self._cu.cuGetErrorName(err)
            raise ArenaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} ({int(err)})")
        return result[1] if len(result) == 2 else result[1:] or None

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        self._check(self._cu.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._cu.cuCtxPopCurrent()

    def grow(self, old: int, new: int) -> None:
        """Back ``[base+old, base+new)`` with one new physical allocation; all or nothing."""
        cu, size, addr = self._cu, new - old, self.base + old
        with self._current():
            handle = self._check(cu.cuMemCreate(size, self._prop, 0), f"cuMemCreate({size})")
            mapped = False
            try:
                self._check(cu.cuMemMap(addr, size, 0, handle, 0), f"cuMemMap(+{old}, {size})")
                mapped = True
                self._check(cu.cuMemSetAccess(addr, size, self._access, len(self._access)),
                            f"cuMemSetAccess(+{old}, {size})")
            except BaseException:
                if mapped:
                    cu.cuMemUnmap(addr, size)  # best effort: the original error is what matters
                cu.cuMemRelease(handle)
                raise
        self._mappings.append(_Mapping(old, size, handle))

    def shrink_target(self, keep: int) -> int:
        """What :meth:`shrink` ``(keep, ...)`` would leave mapped (whole mappings only)."""
        end = self.mapped_bytes()
        for m in reversed(self._mappings):
            if m.offset < keep:
                break
            end = m.offset
        return end

    def _undo(self, m: _Mapping) -> None:
        """Unmap and release one mapping; each step is done once, so a failed one can be retried."""
        if m.mapped:
            self._check(self._cu.cuMemUnmap(self.base + m.offset, m.size), f"cuMemUnmap(+{m.offset}, {m.size})")
            m.mapped = False
        self._check(self._cu.cuMemRelease(m.handle), f"cuMemRelease(+{m.offset}, {m.size})")
        self._mappings.remove(m)

    def shrink(self, keep: int, old: int) -> int:
        """Unmap and release every mapping that starts at or after ``keep``.

        A mapping that straddles ``keep`` stays whole (the driver unmaps only whole mappings),
        so the returned new committed size can be larger than ``keep``.
        """
        self._synchronize()
        with self._current():
            while self._mappings and self._mappings[-1].offset >= keep:
                self._undo(self._mappings[-1])
        return self.mapped_bytes()

    def mapped_bytes(self) -> int:
        """How much of the range, from ``base``, is backed without a gap right now."""
        end = 0
        for m in self._mappings:
            if not m.mapped or m.offset != end:
                break
            end += m.size
        return end

    def _synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device_index)

    def leftover(self) -> str:
        """What this backend still holds, in words (empty when everything is released)."""
        parts = []
        if self._mappings:
            nbytes = sum(m.size for m in self._mappings)
            unmapped = sum(1 for m in self._mappings if not m.mapped)
            parts.append(f"{len(self._mappings)} physical allocation(s) of {nbytes} bytes"
                         + (f" ({unmapped} unmapped but not released)" if unmapped else ""))
        if self._range_held:
            parts.append(f"the address range {self.base:#x} ({self.reserved} bytes)")
        if self._ctx_held:
            parts.append(f"a reference on cuda:{self.device_index}'s primary context")
        return ", ".join(parts)

    def release(self) -> None:
        """Unmap and release everything, free the address range, then drop the context reference.

        Each step is recorded as it succeeds. If one fails, the others still run where they
        can, and :class:`ArenaError` names what is still held; calling again retries only that.
        The context reference is dropped last, only when nothing else is left.
        """
        if not self._ctx_held:
            return
        errors: list[str] = []
        try:
            self._synchronize()
        except Exception as exc:  # a broken context: unmapping may still work, and must be tried
            errors.append(f"synchronize: {exc}")
        try:
            with self._current():
                for m in reversed(list(self._mappings)):
                    try:
                        self._undo(m)
                    except ArenaError as exc:
                        errors.append(str(exc))
                if self._range_held and not self._mappings:
                    try:
                        self._check(self._cu.cuMemAddressFree(self.base, self.reserved), "cuMemAddressFree")
                        self._range_held = False
                    except ArenaError as exc:
                        errors.append(str(exc))
        except ArenaError as exc:  # cuCtxPushCurrent itself
            errors.append(str(exc))
        if self._mappings or self._range_held:
            raise ArenaError(f"releasing the CUDA arena on cuda:{self.device_index} failed ({'; '.join(errors)}); "
                             f"still held: {self.leftover()}; close() again to retry")
        if errors:
            log.warning("kvarena: CUDA arena on cuda:%d released after: %s", self.device_index, "; ".join(errors))
        self._cu.cuDevicePrimaryCtxRelease(self._dev)
        self._ctx_held = False
