"""``KvArena``: a reserved address range, committed on demand, allocated by the cached stub."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from . import pool as torch_pool
from .backend import MemoryBackend
from .errors import ArenaClosedError, ArenaError, ArenaExhaustedError, CommitError, SlotsExhaustedError
from .stub import Slot, StubLibrary, StubTiming, load_stub

if TYPE_CHECKING:
    import stubcache
    import torch
    from torch.cuda.memory import CUDAPluggableAllocator

log = logging.getLogger("kvarena")

DEFAULT_HOST_ALIGNMENT = 64


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _parse_device(device: Any) -> tuple[str, int]:
    """``("cpu", -1)`` or ``("cuda", index)``; "cpu" needs no torch import."""
    if isinstance(device, str) and device == "cpu":
        return "cpu", -1
    from .cuda import cuda_device_index

    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda", cuda_device_index(f"cuda:{device}")
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu", -1
    if dev.type != "cuda":
        raise ValueError(f"KvArena supports device='cpu' or 'cuda[:N]', got {device!r}")
    return "cuda", cuda_device_index(dev)


class _Resources:
    """What an arena owns, released once (by ``close`` or when the arena is collected)."""

    def __init__(self, backend: MemoryBackend, slot: Slot) -> None:
        self.backend = backend
        self.slot = slot
        self.pool: "torch.cuda.MemPool | None" = None
        self.allocator: "CUDAPluggableAllocator | None" = None
        self.backend_released = False

    def release_allocator(self) -> None:
        # Dropping the last reference to the pool makes torch hand its cached segments back
        # through the slot's free function. Whatever keeps the pool alive (a user's reference,
        # a traceback) keeps the slot retired: torch may still call into it. The allocator is
        # kept with the retired slot until its last block is freed: a tensor that outlives the
        # pool is freed through it, and a torch without PR #171962 does not keep it alive.
        keepers = [weakref.ref(self.pool)] if self.pool is not None else []
        hold = (self.allocator,) if self.allocator is not None else ()
        self.pool = None
        self.allocator = None
        self.slot.release(keepers, hold)

    def release_backend(self) -> None:
        """Release the memory; on failure raise with what is left, and retry on the next call."""
        if not self.backend_released:
            self.backend.release()
            self.backend_released = True

    def release(self) -> None:
        try:
            self.release_allocator()
        finally:
            self.release_backend()


class KvArena:
    """A KV-cache arena: reserve ``reserve_bytes`` of address space, commit it on demand, and
    allocate tensors inside it through a bump allocator that stubcache builds once per host.

    Args:
        reserve_bytes: size of the address range to reserve (rounded up to ``granularity``).
            Reserving costs address space only; memory is used by :meth:`commit`.
        device: ``"cpu"`` (host memory: ``mmap``/``mprotect``) or ``"cuda"``/``"cuda:N"``/an
            ordinal (CUDA virtual memory via ``cuda-bindings``).
        alignment: alignment of every allocation (a power of two). Default: the commit
            granularity on CUDA (so each tensor starts at a mappable address), 64 on the host.
        granularity: host only: the commit step, a multiple of the page size (default: page).
        cache: the :class:`stubcache.StubCache` to get the stub from (default: stubcache's
            process-wide default cache, ``STUBCACHE_DIR`` or the user cache directory).

    Raises:
        CudaUnavailableError: a CUDA arena without a GPU, a CUDA torch or ``cuda-bindings``.
        SlotsExhaustedError: this process already has ``kvarena.NSLOTS`` open arenas.

    Use as a context manager or call :meth:`close`. On CUDA, free the tensors allocated under
    :meth:`use` before closing: closing unmaps their memory.
    """

    def __init__(self, reserve_bytes: int, device: Any = "cpu", *, alignment: Optional[int] = None,
                 granularity: Optional[int] = None, cache: Optional["stubcache.StubCache"] = None) -> None:
        if not isinstance(reserve_bytes, int) or isinstance(reserve_bytes, bool) or reserve_bytes <= 0:
            raise ValueError(f"reserve_bytes must be a positive int, got {reserve_bytes!r}")
        kind, index = _parse_device(device)
        if alignment is not None and (alignment <= 0 or alignment & (alignment - 1)):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self._lock = threading.RLock()
        self._stub: StubLibrary = load_stub(cache)
        self._device_index = index
        if kind == "cuda":
            if granularity is not None:
                raise ValueError("granularity is set by the CUDA driver; pass it only for a host arena")
            from .cuda import CudaBackend

            backend: MemoryBackend = CudaBackend(reserve_bytes, index)
        else:
            from .host import HostBackend

            backend = HostBackend(reserve_bytes, granularity)
        try:
            slot = self._acquire_slot(kind)
        except BaseException:
            backend.release()
            raise
        self._res = _Resources(backend, slot)
        self._finalizer = weakref.finalize(self, _Resources.release, self._res)
        self._finalizer.atexit = False  # at exit the OS reclaims it; torch may be half torn down
        try:
            self.alignment = int(alignment or (backend.granularity if kind == "cuda" else DEFAULT_HOST_ALIGNMENT))
            slot.configure(backend.base, backend.reserved, self.alignment)
            if kind == "cuda":
                self._make_pool()
        except BaseException:
            self._finalizer()
            raise
        self.base: int = backend.base
        self.reserved: int = backend.reserved
        self.granularity: int = backend.granularity
        self.device: str = "cpu" if kind == "cpu" else f"cuda:{index}"
        self._committed = 0
        self._closed = False
        self._live = 0  # host tensors still referencing arena memory
        self._last_cursor = 0
        log.info("kvarena: %s arena reserved %d bytes at %#x (granularity %d, alignment %d, slot %d)",
                 self.device, self.reserved, self.base, self.granularity, self.alignment, slot.index)

    def _acquire_slot(self, kind: str) -> Slot:
        try:
            return self._stub.acquire_slot()
        except SlotsExhaustedError:
            pass
        # Arenas dropped without close() in a reference cycle hold their slots until the
        # collector runs; closed arenas whose pool died in a cycle, or whose blocks torch still
        # caches in a released pool, hold retired slots: collect, let torch hand them back, retry.
        gc.collect()
        if kind == "cuda":
            import torch

            torch.cuda.empty_cache()
        return self._stub.acquire_slot()

    def _make_pool(self) -> None:
        slot = self._res.slot
        # The name of the verified open file: torch's dlopen then returns the very handle whose
        # slot table we configured, even if the cache entry was replaced on disk meanwhile.
        self._res.pool, self._res.allocator = torch_pool.make_pool(
            self._stub.loaded_path, slot.alloc_name, slot.free_name, self._device_index)

    # --- state -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    @property
    def released(self) -> bool:
        """True once the arena's memory and address range are given back (see :meth:`close`)."""
        return self._res.backend_released

    @property
    def committed(self) -> int:
        """Bytes from ``base`` that are backed by memory (a multiple of ``granularity``)."""
        return self._committed

    @property
    def cursor(self) -> int:
        """Bytes handed out so far by the arena's bump allocator (the stub's cursor)."""
        return self._last_cursor if self._closed else self._res.slot.cursor()

    @property
    def slot(self) -> int:
        """The stub slot this arena allocates through."""
        return self._res.slot.index

    @property
    def alloc_fn_name(self) -> str:
        """Exported name of this arena's ``void* alloc(size_t, int, void*)``."""
        return self._res.slot.alloc_name

    @property
    def free_fn_name(self) -> str:
        """Exported name of this arena's ``void free(void*, size_t, int, void*)``."""
        return self._res.slot.free_name

    @property
    def stub_path(self) -> str:
        """Path of the cached stub library (what ``CUDAPluggableAllocator`` loads)."""
        return self._stub.path

    @property
    def stub_timing(self) -> StubTiming:
        """How this process obtained the stub (built or hit, and how long it took)."""
        return self._stub.timing

    @property
    def pool(self) -> "torch.cuda.MemPool | None":
        """The ``torch.cuda.MemPool`` of a CUDA arena (``None`` on the host)."""
        self._check_open()
        return self._res.pool

    def stats(self) -> dict[str, Any]:
        """The allocator's own view: base, reserved, align, cursor, nalloc, nfree, nfail,
        live (allocations not freed yet) and gen (the slot's configuration count)."""
        self._check_open()
        return self._res.slot.stats()

    def _check_open(self) -> None:
        if self._closed:
            raise ArenaClosedError(f"this {self.device} arena (base {self.base:#x}) is closed")

    # --- commit ----------------------------------------------------------------------------

    def commit(self, nbytes: int) -> int:
        """Make the first ``nbytes`` usable (rounded up to ``granularity``); returns ``committed``.

        Idempotent and monotonic: asking for no more than is committed does nothing. Raises
        :class:`CommitError` past the reservation. A failed step leaves nothing half-mapped.
        """
        with self._lock:
            self._check_open()
            nbytes = int(nbytes)
            if nbytes < 0:
                raise CommitError(f"commit({nbytes}): size must be >= 0")
            if nbytes > self.reserved:
                raise CommitError(f"commit({nbytes}) exceeds the reservation of {self.reserved} bytes; "
                                  "create the arena with a larger reserve_bytes")
            target = _align_up(nbytes, self.granularity)
            if target > self._committed:
                self._res.backend.grow(self._committed, target)
                log.debug("kvarena: committed %d -> %d bytes", self._committed, target)
                self._committed = target
            return self._committed

    def uncommit_beyond(self, nbytes: int) -> int:
        """Release the memory beyond the first ``nbytes`` (rounded up); returns bytes released.

        Live tensors keep their addresses; touching their uncommitted part faults (host) or is
        an illegal address (CUDA) until it is committed again, when it reads as zeros (host).
        On CUDA, raises :class:`ArenaError` and releases nothing if torch's pool holds a *cached*
        block (a freed tensor's memory, which torch would hand out again without asking the
        arena) in the range that would be unmapped.
        """
        with self._lock:
            self._check_open()
            keep = _align_up(max(int(nbytes), 0), self.granularity)
            if keep >= self._committed:
                return 0
            target = self._res.backend.shrink_target(keep)
            if target >= self._committed:
                return 0
            if self._res.pool is not None:
                cached = torch_pool.cached_blocks(torch_pool.snapshot(self._res.pool),
                                                  self.base + target, self.base + self._committed)
                if cached:
                    raise ArenaError(
                        f"uncommit_beyond({nbytes}) would unmap [{target}, {self._committed}) under cached "
                        f"block(s) of torch's pool {torch_pool.describe(cached, self.base)}; torch hands "
                        "those out again without asking the arena, and the first write to one would be an "
                        "illegal address that breaks the CUDA context. Keep the tensors there alive across "
                        "uncommit (a live tensor may extend past the commit point), or close and recreate "
                        "the arena")
            try:
                new = self._res.backend.shrink(keep, self._committed)
            except BaseException:
                # Part of the range may be gone already: never claim memory that is unmapped.
                self._committed = self._res.backend.mapped_bytes()
                raise
            freed = self._committed - new
            self._committed = new
            log.debug("kvarena: uncommitted down to %d bytes (%d released)", new, freed)
            return freed

    # --- allocation ------------------------------------------------------------------------

    def use(self) -> contextlib.AbstractContextManager[torch.cuda.MemPool]:
        """CUDA only: route this thread's torch allocations on the arena's device into the arena.

        ``with arena.use(): kv = torch.empty(shape, dtype=..., device=arena.device)``. An
        allocation that does not fit in the reservation raises :class:`ArenaExhaustedError`.
        On leaving, torch's view of the pool is checked, and :class:`ArenaError` is raised
        instead of passing silently if the pool holds memory that did not come from the arena
        (:meth:`check_pool`), or if torch handed out a *cached* block (a freed tensor's memory,
        reused without asking the arena) that lies in uncommitted memory; tensors allocated in
        that block must then not be used. The check sees the tensors still alive when the block
        exits. If the pool already caches such a block on entry, :class:`ArenaError` is raised
        before anything is routed (the body would write to it before any check on leaving).
        A fresh allocation past ``committed`` is allowed: commit before touching it.
        """
        return self._use(check_reuse=True)

    @contextlib.contextmanager
    def _use(self, check_reuse: bool) -> "Iterator[torch.cuda.MemPool]":
        self._check_open()
        pool = self._res.pool
        if pool is None:
            raise ArenaError("use() routes torch's CUDA allocator into the arena; a host arena has no "
                             "such hook: allocate with arena.tensor(shape, dtype)")
        import torch

        slot = self._res.slot
        failed_before = slot.stats()["nfail"]
        before = torch_pool.snapshot(pool) if check_reuse else []
        # Refuse before routing anything: torch would hand such a block out without asking the
        # arena, and the body writes to what it gets at once (torch.zeros), long before a check
        # on leaving could warn. Checked again on leaving, for a block cached meanwhile.
        hazard = torch_pool.cached_blocks(before, self.base + self._committed, self.base + self.reserved)
        if hazard:
            del pool
            end = max(b.address + b.size for b in hazard) - self.base
            raise ArenaError(
                f"torch's pool of this arena caches freed block(s) in uncommitted memory "
                f"({torch_pool.describe(hazard, self.base)}; {self._committed} bytes committed): tensors freed "
                "after uncommit_beyond() or allocated past the commit point. torch would hand them out again "
                "without asking the arena, and the first write to one would be an illegal address that breaks "
                f"the CUDA context. commit({end}) first, or close and recreate the arena")
        try:
            with torch.cuda.use_mem_pool(pool, device=self._device_index):
                yield pool
        except RuntimeError as exc:
            if not isinstance(exc, ArenaError) and slot.stats()["nfail"] > failed_before:
                raise self._exhausted("a torch allocation") from exc
            raise
        finally:
            del pool  # a traceback holding this frame must not keep the pool (and the slot) alive
        after = self.check_pool()
        reused = torch_pool.reused_blocks(before, after, self.base + self._committed, self.base + self.reserved)
        if reused:
            raise ArenaError(
                f"torch handed out cached block(s) of this arena's pool that lie in uncommitted memory "
                f"({torch_pool.describe(reused, self.base)}; {self._committed} bytes committed): a freed "
                "tensor's block, reused without asking the arena; writing to it would be an illegal address. "
                f"commit() up to the end of those blocks before using the tensors allocated here")

    def check_pool(self) -> list[Any]:
        """CUDA: raise :class:`ArenaError` if torch's pool holds memory the arena did not hand out.

        torch binds a pool to one device; allocations routed to it on another device, or by a
        pool torch made behind our back, come from plain ``cudaMalloc``. Every segment of the
        pool must lie in ``[base, base + reserved)`` on the arena's device. Returns torch's
        snapshot of the pool (a list of segment dicts; empty for a host arena).
        """
        self._check_open()
        if self._res.pool is None:
            return []
        snap = torch_pool.snapshot(self._res.pool)
        foreign = torch_pool.foreign_segments(snap, self._device_index, self.base, self.reserved)
        if foreign:
            raise ArenaError(
                f"torch's pool of this {self.device} arena holds memory that did not come from the arena "
                f"(segments {torch_pool.describe(foreign, self.base)}; arena [{self.base:#x}, "
                f"{self.base + self.reserved:#x})): allocations were routed to the pool on another device "
                "or the pool is bound to the wrong device; those tensors are plain cudaMalloc memory")
        return snap

    def _exhausted(self, what: str) -> ArenaExhaustedError:
        st = self._res.slot.stats()
        return ArenaExhaustedError(
            f"{what} does not fit in the arena: {st['cursor']} of {self.reserved} bytes are handed out "
            f"(alignment {self.alignment}); reserve more, or close and recreate the arena")

    def tensor(self, shape: Sequence[int] | int, dtype: "torch.dtype | None" = None, *,
               check_committed: bool = True) -> "torch.Tensor":
        """A new uninitialised tensor whose memory is allocated inside the arena by the stub.

        On CUDA this is ``torch.empty`` under :meth:`use`. On the host the stub's allocation
        function is called directly and the memory wrapped with ``torch.frombuffer``; the range
        is given back to the allocator when the tensor (and every view of it) is gone. With
        ``check_committed`` (default) the tensor must lie in committed memory (on CUDA, torch
        may hand back a cached block anywhere in the arena, so it is checked after the fact).
        """
        import torch

        self._check_open()
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        if self._res.pool is not None:
            try:
                with self._use(check_reuse=check_committed):
                    t = torch.empty(shape, dtype=dtype, device=self.device)
            except ArenaError:
                t = None  # a traceback must not keep a tensor in unusable memory alive
                raise
            off, nbytes = t.data_ptr() - self.base, t.numel() * t.element_size()  # type: ignore[union-attr]  # None: raised
            if check_committed and nbytes and off + nbytes > self._committed:
                del t
                raise ArenaError(f"a tensor of {nbytes} bytes at offset {off} would end at {off + nbytes}, "
                                 f"past the {self._committed} committed bytes; commit({off + nbytes}) first "
                                 "or pass check_committed=False")
            return t  # type: ignore[return-value]  # None only where it raised
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            self._check_open()
            slot = self._res.slot
            ptr = slot.alloc(nbytes)
            if not ptr:
                raise self._exhausted(f"a tensor of {nbytes} bytes")
            end = ptr - self.base + nbytes
            if check_committed and end > self._committed:
                slot.free(ptr, nbytes)
                raise ArenaError(f"a tensor of {nbytes} bytes at offset {ptr - self.base} would end at "
                                 f"{end}, past the {self._committed} committed bytes; commit({end}) first "
                                 "or pass check_committed=False")
            buf = (ctypes.c_char * nbytes).from_address(ptr)
            self._live += 1
        weakref.finalize(buf, self._host_freed, slot, ptr, nbytes)
        return torch.frombuffer(buf, dtype=dtype, count=numel).view(shape)

    def _host_freed(self, slot: Slot, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._live -= 1
            slot.free(ptr, nbytes)  # also after close: the slot is not reused until this count drops
            if self._closed and self._live == 0:
                log.debug("kvarena: last host tensor gone; releasing the closed arena's mapping")
                self._res.release_backend()

    # --- teardown --------------------------------------------------------------------------

    def close(self) -> None:
        """Release the slot, the pool and the reservation. Idempotent, and retryable.

        A host arena whose tensors are still alive keeps its mapping until the last one is
        gone; a CUDA arena synchronizes the device and unmaps at once. If giving the memory
        back fails, :class:`ArenaError` says what is still held (mappings, the address range,
        the context reference) and a later ``close()`` retries just that; :attr:`released`
        tells whether it is done. The slot is reused only when torch can no longer call into
        it: once the pool is gone and every block it got from the slot has been freed.
        """
        with self._lock:
            if not self._closed:
                self._last_cursor = self._res.slot.cursor()
                self._closed = True
                self._finalizer.detach()
                try:
                    self._res.release_allocator()
                finally:
                    if self._live:
                        log.info("kvarena: arena closed with %d live host tensor(s); unmapping when they are "
                                 "gone", self._live)
                    else:
                        self._res.release_backend()
            elif not self._live:
                self._res.release_backend()

    def __enter__(self) -> "KvArena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"committed={self._committed}, cursor={self.cursor}"
        return (f"KvArena(device={self.device!r}, base={self.base:#x}, reserved={self.reserved}, "
                f"{state}, slot={self._res.slot.index})")
