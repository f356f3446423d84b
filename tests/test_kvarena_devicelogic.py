"""The CUDA arena's bookkeeping without a GPU: small fakes of the driver and of the two torch
calls that bind a pool to a device, and torch's pool snapshots as plain data.

These check our logic only. The real driver and torch run in tests/gpu (scripts/run_gpu_tests.sh);
a fake never stands in for those.
"""

from __future__ import annotations

import contextlib
import types

import pytest

from kvarena import ArenaError
from kvarena import pool as torch_pool

MiB = 1 << 20
GRAN = 2 * MiB
BASE = 0x7F0000000000


class _Names:
    """An enum namespace of the fake driver: every member is its own name."""

    def __getattr__(self, name: str) -> str:
        return name


class FakeDriver:
    """The driver calls CudaBackend makes, with state, call counts, and failures on demand."""

    class CUresult:
        CUDA_SUCCESS = 0

    ERR = 999

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}  # call name -> how many of its next calls fail
        self.calls: list[str] = []
        self.ctx_refs = 0
        self.pushed = 0
        self.handles: set[int] = set()
        self.mapped: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self._next = 1
        for enum in ("CUmemAllocationType", "CUmemLocationType", "CUmemAllocationHandleType",
                     "CUmemAccess_flags", "CUmemAllocationGranularity_flags"):
            setattr(self, enum, _Names())

    def _call(self, name: str) -> bool:
        self.calls.append(name)
        if self.fail.get(name):
            self.fail[name] -= 1
            return False
        return True

    @staticmethod
    def CUmemAllocationProp():
        return types.SimpleNamespace(location=types.SimpleNamespace())

    @staticmethod
    def CUmemAccessDesc():
        return types.SimpleNamespace(location=types.SimpleNamespace())

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_FAKE"

    def cuInit(self, flags):
        return (0,) if self._call("cuInit") else (self.ERR,)

    def cuDeviceGet(self, index):
        return 0, index

    def cuDevicePrimaryCtxRetain(self, dev):
        self.ctx_refs += 1
        return 0, "ctx"

    def cuDevicePrimaryCtxRelease(self, dev):
        self.calls.append("cuDevicePrimaryCtxRelease")
        self.ctx_refs -= 1
        return (0,)

    def cuCtxPushCurrent(self, ctx):
        if not self._call("cuCtxPushCurrent"):
            return (self.ERR,)
        self.pushed += 1
        return (0,)

    def cuCtxPopCurrent(self):
        self.pushed -= 1
        return 0, "ctx"

    def cuMemGetAllocationGranularity(self, prop, flag):
        return 0, GRAN

    def cuMemAddressReserve(self, size, align, addr, flags):
        self.reserved[BASE] = size
        return 0, BASE

    def cuMemAddressFree(self, addr, size):
        if not self._call("cuMemAddressFree") or self.mapped:
            return (self.ERR,)
        del self.reserved[addr]
        return (0,)

    def cuMemCreate(self, size, prop, flags):
        if not self._call("cuMemCreate"):
            return self.ERR, None
        h = self._next
        self._next += 1
        self.handles.add(h)
        return 0, h

    def cuMemMap(self, addr, size, offset, handle, flags):
        if not self._call("cuMemMap"):
            return (self.ERR,)
        self.mapped[addr] = handle
        return (0,)

    def cuMemSetAccess(self, addr, size, desc, count):
        return (0,) if self._call("cuMemSetAccess") else (self.ERR,)

    def cuMemUnmap(self, addr, size):
        if not self._call("cuMemUnmap"):
            return (self.ERR,)
        del self.mapped[addr]
        return (0,)

    def cuMemRelease(self, handle):
        if not self._call("cuMemRelease"):
            return (self.ERR,)
        self.handles.remove(handle)
        return (0,)


@pytest.fixture
def fake(monkeypatch):
    from kvarena import cuda

    drv = FakeDriver()
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    monkeypatch.setattr(cuda.CudaBackend, "_synchronize", lambda self: drv.calls.append("synchronize"))
    return drv


def test_release_retries_only_what_failed_and_keeps_the_context_until_the_end(fake):
    from kvarena.cuda import CudaBackend

    b = CudaBackend(64 * MiB, 0)
    for old, new in ((0, GRAN), (GRAN, 3 * GRAN), (3 * GRAN, 4 * GRAN)):
        b.grow(old, new)
    assert len(fake.handles) == 3 and fake.ctx_refs == 1
    fake.fail = {"cuMemUnmap": 1, "cuMemRelease": 1}  # the last mapping won't unmap, the next won't release
    with pytest.raises(ArenaError) as err:
        b.release()
    msg = str(err.value)
    assert "cuMemUnmap(+6291456, 2097152) failed: CUDA_ERROR_FAKE" in msg
    assert "cuMemRelease(+2097152, 4194304) failed" in msg
    assert ("still held: 2 physical allocation(s) of 6291456 bytes (1 unmapped but not released), the address "
            f"range {BASE:#x} (67108864 bytes), a reference on cuda:0's primary context; close() again") in msg
    assert fake.ctx_refs == 1 and BASE in fake.reserved  # nothing dropped that a retry still needs
    assert b.mapped_bytes() == 0  # the lowest mapping went: nothing is backed from base on
    fake.calls.clear()
    b.release()
    assert fake.calls.count("cuMemUnmap") == 1  # the unmapped one is only released
    assert fake.calls.count("cuMemRelease") == 2
    assert not fake.handles and not fake.mapped and not fake.reserved
    assert fake.ctx_refs == 0 and fake.pushed == 0
    b.release()  # done: nothing more
    assert fake.ctx_refs == 0


def test_release_reports_a_failed_address_free(fake):
    from kvarena.cuda import CudaBackend

    b = CudaBackend(8 * MiB, 0)
    b.grow(0, GRAN)
    fake.fail = {"cuMemAddressFree": 1}
    with pytest.raises(ArenaError, match=r"still held: the address range .* primary context"):
        b.release()
    assert not fake.handles and fake.ctx_refs == 1
    b.release()
    assert not fake.reserved and fake.ctx_refs == 0


def test_shrink_failure_leaves_an_honest_mapped_size(fake):
    from kvarena.cuda import CudaBackend

    b = CudaBackend(64 * MiB, 0)
    b.grow(0, GRAN)
    b.grow(GRAN, 2 * GRAN)
    b.grow(2 * GRAN, 3 * GRAN)
    assert b.shrink_target(GRAN + 1) == 2 * GRAN and b.shrink_target(GRAN) == GRAN
    fake.fail = {"cuMemRelease": 1}
    with pytest.raises(ArenaError):
        b.shrink(GRAN, 3 * GRAN)
    assert b.mapped_bytes() == 2 * GRAN  # the top one is unmapped: never counted as committed
    assert b.shrink(GRAN, 2 * GRAN) == GRAN
    b.release()
    assert fake.ctx_refs == 0 and not fake.handles


def test_a_failed_grow_undoes_its_part(fake):
    from kvarena.cuda import CudaBackend

    b = CudaBackend(64 * MiB, 0)
    fake.fail = {"cuMemSetAccess": 1}
    with pytest.raises(ArenaError, match="cuMemSetAccess"):
        b.grow(0, GRAN)
    assert not fake.handles and not fake.mapped and b.mapped_bytes() == 0
    b.release()


# --- the pool: bound to the arena's device ----------------------------------------------------


def test_the_pool_is_created_with_the_arenas_device_current(monkeypatch):
    """torch binds a MemPool to the device current at creation; fake exactly those two calls."""
    torch = pytest.importorskip("torch")
    import torch.cuda.memory as tcm

    state = {"current": 0}
    made = []

    @contextlib.contextmanager
    def device(index):
        prev, state["current"] = state["current"], index
        try:
            yield
        finally:
            state["current"] = prev

    class MemPool:
        def __init__(self, allocator, use_on_oom=False, no_split=False):
            made.append((allocator, state["current"], no_split))

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            self.args = (path, alloc_fn_name, free_fn_name)

        def allocator(self):
            return ("allocator", self.args)

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "MemPool", MemPool)
    monkeypatch.setattr(tcm, "CUDAPluggableAllocator", CUDAPluggableAllocator)
    pool, alloc = torch_pool.make_pool("/proc/self/fd/7", "kvarena_alloc_3", "kvarena_free_3", 1)
    assert made == [(("allocator", ("/proc/self/fd/7", "kvarena_alloc_3", "kvarena_free_3")), 1, True)]
    assert state["current"] == 0  # the caller's current device is back
    assert isinstance(pool, MemPool) and alloc.args[1] == "kvarena_alloc_3"


def _seg(device, address, size, blocks):
    return {"device": device, "address": address, "total_size": size, "segment_pool_id": (0, 1),
            "blocks": [{"address": a, "size": s, "state": st} for a, s, st in blocks]}


def test_foreign_segments_catch_memory_that_did_not_come_from_the_arena():
    reserved = 64 * MiB
    ours = _seg(0, BASE, GRAN, [(BASE, GRAN, "active_allocated")])
    assert torch_pool.foreign_segments([ours], 0, BASE, reserved) == []
    # the bug: use_mem_pool(pool, device=1) on a pool made on device 0 -> plain cudaMalloc on cuda:1
    other_device = _seg(1, 0x7E0000000000, GRAN, [(0x7E0000000000, GRAN, "active_allocated")])
    # a device-0 address of the right device but outside the range (another allocator)
    outside = _seg(0, BASE + reserved, GRAN, [])
    straddling = _seg(0, BASE + reserved - GRAN, 2 * GRAN, [])
    snap = [ours, other_device, outside, straddling]
    found = torch_pool.foreign_segments(snap, 0, BASE, reserved)
    assert [(s.device, s.address) for s in found] == [(1, 0x7E0000000000), (0, BASE + reserved),
                                                       (0, BASE + reserved - GRAN)]
    assert torch_pool.describe(found, BASE).startswith("3: 0x7e0000000000")


def test_cached_blocks_are_found_where_a_release_would_unmap():
    snap = [
        _seg(0, BASE, GRAN, [(BASE, GRAN, "active_allocated")]),
        _seg(0, BASE + GRAN, 2 * GRAN, [(BASE + GRAN, 2 * GRAN, "inactive")]),
        _seg(0, BASE + 3 * GRAN, GRAN, [(BASE + 3 * GRAN, GRAN, "active_pending_free")]),
        _seg(0, BASE + 4 * GRAN, GRAN, [(BASE + 4 * GRAN, GRAN, "active_allocated")]),
    ]
    hits = torch_pool.cached_blocks(snap, BASE + 2 * GRAN, BASE + 5 * GRAN)
    assert [(b.address - BASE) // GRAN for b in hits] == [1, 3]  # overlapping, not the live ones
    assert torch_pool.cached_blocks(snap, BASE + 4 * GRAN, BASE + 5 * GRAN) == []
    assert torch_pool.cached_blocks(snap, BASE, BASE + GRAN) == []
    # blocks without an address field are laid out from the segment start, as torch orders them
    snap2 = [{"device": 0, "address": BASE, "total_size": 2 * GRAN,
              "blocks": [{"size": GRAN, "state": "active_allocated"}, {"size": GRAN, "state": "inactive"}]}]
    assert [b.address for b in torch_pool.cached_blocks(snap2, BASE, BASE + 2 * GRAN)] == [BASE + GRAN]


def test_reused_blocks_are_the_cached_ones_handed_out_again():
    before = [
        _seg(0, BASE, GRAN, [(BASE, GRAN, "active_allocated")]),
        _seg(0, BASE + GRAN, 2 * GRAN, [(BASE + GRAN, 2 * GRAN, "inactive")]),
        _seg(0, BASE + 3 * GRAN, GRAN, [(BASE + 3 * GRAN, GRAN, "inactive")]),
    ]
    after = [
        _seg(0, BASE, GRAN, [(BASE, GRAN, "active_allocated")]),  # was live already
        _seg(0, BASE + GRAN, 2 * GRAN, [(BASE + GRAN, GRAN, "active_allocated"),  # carved from a cached one
                                        (BASE + 2 * GRAN, GRAN, "inactive")]),
        _seg(0, BASE + 3 * GRAN, GRAN, [(BASE + 3 * GRAN, GRAN, "active_allocated")]),  # reused whole
        _seg(0, BASE + 4 * GRAN, GRAN, [(BASE + 4 * GRAN, GRAN, "active_allocated")]),  # fresh from the stub
    ]
    everywhere = torch_pool.reused_blocks(before, after, BASE, BASE + 8 * GRAN)
    assert [(b.address - BASE) // GRAN for b in everywhere] == [1, 3]
    beyond_commit = torch_pool.reused_blocks(before, after, BASE + 2 * GRAN, BASE + 8 * GRAN)
    assert [(b.address - BASE) // GRAN for b in beyond_commit] == [3]  # a fresh block past commit is allowed
    assert torch_pool.reused_blocks([], after, BASE, BASE + 8 * GRAN) == []


def test_use_refuses_before_routing_anything_when_torch_caches_a_block_over_uncommitted_memory(
        cache_root, monkeypatch):
    """A block cached over unmapped memory (a tensor alive at uncommit_beyond, freed later)
    is handed out again by torch without asking the arena, and the body of ``with use():``
    writes to it at once (``torch.zeros``): a check on leaving comes too late, the CUDA context
    is already broken. So use() refuses on entry. Fakes: torch's snapshot of the pool and
    use_mem_pool (the arena is a host arena given a pool); the GPU test does it for real."""
    torch = pytest.importorskip("torch")
    import stubcache
    from kvarena import KvArena

    entered = []

    @contextlib.contextmanager
    def use_mem_pool(pool, device=None):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    with KvArena(64 * MiB, cache=stubcache.StubCache(cache_root), granularity=GRAN) as a:
        a.commit(2 * GRAN)
        state = {"cached": "inactive"}

        def snapshot(pool):
            return [_seg(-1, a.base, GRAN, [(a.base, GRAN, "active_allocated")]),
                    _seg(-1, a.base + GRAN, 2 * GRAN, [(a.base + GRAN, 2 * GRAN, state["cached"])])]

        monkeypatch.setattr(torch_pool, "snapshot", snapshot)
        pool = types.SimpleNamespace(id=(0, 1))
        a._res.pool = pool
        try:
            with pytest.raises(ArenaError, match=r"caches freed block\(s\) in uncommitted memory \(1: .*"
                                                 r"\+0x200000, 4194304 B, .*inactive\).*commit\(6291456\)"):
                with a.use():
                    pytest.fail("use() routed allocations with a cached block over unmapped memory")
            assert entered == []
            a.commit(3 * GRAN)
            with a.use():  # committed now: nothing to fear
                pass
            assert entered == [-1]
            state["cached"] = "active_allocated"  # live, not cached: the upper-bound pattern
            assert a.uncommit_beyond(GRAN) == 2 * GRAN
            with a.use():
                pass
            assert len(entered) == 2
        finally:
            a._res.pool = None
