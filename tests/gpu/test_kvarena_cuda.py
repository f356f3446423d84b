"""CUDA arenas on a real GPU: skipped cleanly where torch sees none.

Run them all with ``bash scripts/run_gpu_tests.sh``. Each test runs in its own process
(tests/gpu/conftest.py): one illegal address poisons the CUDA context for the whole process.
Every check here asks the driver, torch's allocator or the stub itself, so a broken arena
cannot pass by accident: "mapped" is the driver's ``CU_POINTER_ATTRIBUTE_MAPPED`` (an error
other than "no such address" fails the test instead of reading as unmapped), "from the arena"
is the stub's own allocation count and torch's snapshot of the pool.
"""

from __future__ import annotations

import gc
import inspect
import re
import threading

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA-enabled torch"),
]

MiB = 1 << 20
# From the signature alone (the name imports on a CPU-only torch too), so that without CUDA the
# skip says "needs a CUDA GPU", not a torch version this torch is past.
HAS_NO_SPLIT = "no_split" in inspect.signature(torch.cuda.MemPool.__init__).parameters
needs_no_split = pytest.mark.skipif(not HAS_NO_SPLIT, reason="MemPool(no_split=) needs torch>=2.10")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (cuda:N other than the current)")

# What the driver answers for an address it knows nothing about (a range already freed).
# Anything else (INVALID_CONTEXT, NOT_INITIALIZED, ...) is a broken check, not "unmapped".
NOT_MAPPED = ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_NOT_FOUND")


@pytest.fixture
def driver():
    return pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings (pip install 'stubcache[cuda]')")


@pytest.fixture
def cache(cache_root, driver):
    import stubcache

    return stubcache.StubCache(cache_root)


@pytest.fixture
def stub(cache):
    from kvarena import load_stub

    return load_stub(cache)


def _err_name(driver, err) -> str:
    _, name = driver.cuGetErrorName(err)
    return name.decode() if isinstance(name, bytes) else str(name)


def _mapped(driver, ptr: int, device_index: int = 0) -> bool:
    """Whether the driver says ``ptr`` is mapped, asked with the device's primary context current."""
    ok = driver.CUresult.CUDA_SUCCESS
    err, dev = driver.cuDeviceGet(device_index)
    assert err == ok, _err_name(driver, err)
    err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    assert err == ok, _err_name(driver, err)
    try:
        res = driver.cuCtxPushCurrent(ctx)
        err = res[0] if isinstance(res, tuple) else res
        assert err == ok, _err_name(driver, err)
        try:
            err, value = driver.cuPointerGetAttribute(
                driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MAPPED, ptr)
        finally:
            driver.cuCtxPopCurrent()
    finally:
        driver.cuDevicePrimaryCtxRelease(dev)
    if err == ok:
        return bool(value)
    name = _err_name(driver, err)
    if name in NOT_MAPPED:
        return False
    raise AssertionError(f"cuPointerGetAttribute(MAPPED, {ptr:#x}) failed with {name}: neither mapped nor unmapped")


def _block(arena) -> int:
    """A tensor size (a multiple of the granularity, >= 12 MiB) for which torch's caching
    allocator asks for exactly that much: requests under 10 MiB get a 20 MiB segment, larger
    ones are rounded to 2 MiB. Tensors of this size then lie back to back in the arena."""
    return -(-12 * MiB // arena.granularity) * arena.granularity


def _span(t) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _assert_in(arena, t) -> None:
    lo, hi = _span(t)
    assert arena.base <= lo and hi <= arena.base + arena.reserved, (hex(lo), hex(arena.base))
    assert t.device == torch.device(arena.device)


def test_the_cuda_backend_satisfies_the_backend_protocol(driver):
    from kvarena.cuda import CudaBackend

    from ..test_kvarena_backends import check_instance

    backend = CudaBackend(64 * MiB, torch.cuda.current_device())
    try:
        check_instance(backend)
        backend.grow(0, backend.granularity)
        assert backend.mapped_bytes() == backend.granularity
    finally:
        backend.release()


def test_tensors_come_from_the_arena_at_aligned_offsets_and_hold_data(cache, driver):
    from kvarena import KvArena

    with KvArena(512 * MiB, device="cuda", cache=cache) as a:
        assert a.reserved % a.granularity == 0 and a.alignment == a.granularity
        assert not _mapped(driver, a.base)  # reserved, not committed
        a.commit(256 * MiB)
        assert _mapped(driver, a.base) and _mapped(driver, a.base + 256 * MiB - 1)
        before = a.stats()["nalloc"]
        with a.use():
            ts = [torch.empty((n,), dtype=torch.float32, device=a.device) for n in (1 << 20, 3 << 20, 5 << 18)]
        if HAS_NO_SPLIT:  # one stub call per tensor; older torch may carve several from one segment
            assert a.stats()["nalloc"] - before == 3
        for t in ts:
            _assert_in(a, t)
            assert (t.data_ptr() - a.base) % a.granularity == 0
        assert len({t.data_ptr() for t in ts}) == 3
        a.check_pool()  # torch's own view: every segment of the pool lies in the arena
        from kvarena import pool as torch_pool

        segs = torch_pool.segments(torch_pool.snapshot(a.pool))
        assert segs and all(s.device == torch.device(a.device).index for s in segs)
        assert len(segs) == a.stats()["nalloc"]  # each segment is one allocation the stub made
        for i, t in enumerate(ts):
            t.copy_(torch.arange(t.numel(), dtype=torch.float32) + i)
        for i, t in enumerate(ts):
            assert torch.equal(t.cpu(), torch.arange(t.numel(), dtype=torch.float32) + i)
        del ts, t


@needs_no_split
def test_no_split_gives_each_tensor_its_own_allocation(cache):
    from kvarena import KvArena

    with KvArena(256 * MiB, device="cuda", cache=cache) as a:
        a.commit(64 * MiB)
        with a.use():
            x = torch.empty(256, device=a.device)
            y = torch.empty(256, device=a.device)
        assert a.stats()["nalloc"] == 2
        assert x.data_ptr() != y.data_ptr()
        assert (x.data_ptr() - a.base) % a.granularity == 0 and (y.data_ptr() - a.base) % a.granularity == 0
        x.fill_(1.0)
        y.fill_(2.0)
        assert float(x.sum()) == 256.0 and float(y.sum()) == 512.0
        del x, y


def test_two_arenas_in_one_process(cache):
    from kvarena import KvArena

    a = KvArena(256 * MiB, device="cuda", cache=cache)
    b = KvArena(256 * MiB, device="cuda", cache=cache)
    try:
        assert a.slot != b.slot
        assert a.base + a.reserved <= b.base or b.base + b.reserved <= a.base
        a.commit(32 * MiB)
        b.commit(32 * MiB)
        ta = a.tensor((1024, 1024), torch.float16)
        tb = b.tensor((1024, 1024), torch.float16)
        _assert_in(a, ta)
        _assert_in(b, tb)
        ta.fill_(1.5)
        tb.fill_(-2.0)
        assert float(ta.float().mean()) == 1.5 and float(tb.float().mean()) == -2.0
        del ta, tb
    finally:
        a.close()
        b.close()


def _load_kernels() -> None:
    # The kernels these tests run load on first use and keep device memory for good (CUDA's lazy
    # module loading: ~90 MiB on an H200 with torch 2.11): load them before a free-memory baseline.
    warm = torch.empty((16,), dtype=torch.uint8, device="cuda")
    warm.fill_(7)
    assert int(warm[-1]) == 7
    del warm
    torch.cuda.synchronize()


def test_commit_uses_memory_and_close_unmaps_it(cache, driver):
    from kvarena import ArenaClosedError, CommitError, KvArena

    torch.cuda.init()
    _load_kernels()
    free0 = torch.cuda.mem_get_info()[0]
    a = KvArena(1024 * MiB, device="cuda", cache=cache)
    base = a.base
    a.commit(512 * MiB)
    assert _mapped(driver, base) and _mapped(driver, base + 511 * MiB)
    assert not _mapped(driver, base + 512 * MiB)
    assert free0 - torch.cuda.mem_get_info()[0] >= 500 * MiB
    t = a.tensor((128 * MiB,), torch.uint8)
    t.fill_(7)
    assert int(t[-1]) == 7
    del t
    a.close()
    assert a.released
    assert not _mapped(driver, base)
    assert free0 - torch.cuda.mem_get_info()[0] < 64 * MiB
    with pytest.raises(ArenaClosedError):
        a.commit(1)
    with KvArena(64 * MiB, device="cuda", cache=cache) as b:
        with pytest.raises(CommitError):
            b.commit(b.reserved + 1)


def test_closing_returns_the_pools_memory(cache, stub):
    """Blocks torch caches in the pool go back through the stub when the arena closes."""
    from kvarena import KvArena

    torch.cuda.init()
    dev = torch.cuda.current_device()
    _load_kernels()
    reserved0 = torch.cuda.memory_reserved(dev)
    free0 = torch.cuda.mem_get_info(dev)[0]
    a = KvArena(1024 * MiB, device="cuda", cache=cache)
    slot = a.slot
    a.commit(512 * MiB)
    with a.use():
        # >= 10 MiB each: one segment per tensor, whatever torch's split policy
        xs = [torch.empty((n * MiB,), dtype=torch.uint8, device=a.device) for n in (12, 16, 24, 32)]
    for x in xs:
        x.fill_(1)
    del x  # (the loop's name would keep the last tensor, and its block, alive past close)
    del xs[0], xs[1]  # two freed: torch keeps their blocks cached in the pool
    torch.cuda.synchronize()
    st = a.stats()
    assert st["nalloc"] == 4 and st["live"] == 4  # cached blocks are still the stub's allocations
    del xs
    a.close()
    st = stub.slot_stats(slot)
    assert st["live"] == 0 and st["nfree"] == 4, st  # every block came back through the stub
    assert slot not in stub.retired_slots()
    assert torch.cuda.memory_reserved(dev) <= reserved0
    assert free0 - torch.cuda.mem_get_info(dev)[0] < 64 * MiB


def test_slot_reuse_after_close_with_the_old_pool_still_referenced(cache, stub):
    """A pool that outlives close() keeps its slot: a late free must not rewind another arena."""
    from kvarena import KvArena

    a = KvArena(256 * MiB, device="cuda", cache=cache)
    a.commit(64 * MiB)
    old_pool = a.pool
    with a.use():
        x = torch.empty((16 * MiB,), dtype=torch.uint8, device=a.device)
    del x  # cached in old_pool, at a.base: its free would rewind a cursor to 0
    a.close()
    assert a.slot in stub.retired_slots()
    with KvArena(256 * MiB, device="cuda", cache=cache) as b:
        assert b.slot != a.slot
        b.commit(64 * MiB)
        tb = b.tensor((16 * MiB,), torch.uint8)
        tb.fill_(5)
        nfree_a = stub.slot_stats(a.slot)["nfree"]
        del old_pool  # the pool goes now: torch hands the cached block back through a's slot
        gc.collect()
        assert stub.slot_stats(a.slot)["nfree"] == nfree_a + 1 and stub.slot_stats(a.slot)["live"] == 0
        tb2 = b.tensor((16 * MiB,), torch.uint8)
        assert _span(tb2)[0] >= _span(tb)[1]  # b's cursor did not move back under tb
        tb2.fill_(9)
        assert int(tb.min()) == 5 == int(tb.max())
        assert a.slot not in stub.retired_slots()
        with KvArena(64 * MiB, device="cuda", cache=cache) as c:
            assert c.slot == a.slot and c.cursor == 0
        del tb, tb2


def test_commit_and_uncommit_from_another_thread(cache, driver):
    from kvarena import KvArena

    with KvArena(256 * MiB, device="cuda", cache=cache) as a:
        b = _block(a)
        errors: list[BaseException] = []

        def run(fn):
            def body():
                try:
                    fn()
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)
            th = threading.Thread(target=body)  # a thread that never touched CUDA before
            th.start()
            th.join()
            assert not errors, errors

        run(lambda: a.commit(b))
        assert a.committed == b and _mapped(driver, a.base + b - 1) and not _mapped(driver, a.base + b)
        t = a.tensor((b,), torch.uint8)
        t.fill_(11)
        assert int(t.sum()) == 11 * b
        run(lambda: a.commit(2 * b))
        u = a.tensor((b,), torch.uint8)
        assert _span(u)[0] == a.base + b
        u.fill_(1)
        torch.cuda.synchronize()
        run(lambda: a.uncommit_beyond(b))  # u stays alive over unmapped memory: allowed
        assert a.committed == b and not _mapped(driver, a.base + b)
        assert int(t.sum()) == 11 * b
        run(lambda: a.commit(2 * b))
        u.fill_(2)
        assert int(u.sum()) == 2 * b
        del t, u


def test_uncommit_refuses_to_unmap_cached_blocks(cache, driver):
    from kvarena import ArenaError, KvArena

    with KvArena(256 * MiB, device="cuda", cache=cache) as a:
        b = _block(a)
        a.commit(b)
        a.commit(2 * b)  # two mappings: uncommit releases whole mappings only
        keep = a.tensor((b,), torch.uint8)
        gone = a.tensor((b,), torch.uint8)
        assert _span(gone)[0] == a.base + b
        del gone  # its block is cached in the pool at [b, 2b)
        with pytest.raises(ArenaError, match=r"cached block\(s\) of torch's pool 1: .*inactive"):
            a.uncommit_beyond(b)
        assert a.committed == 2 * b and _mapped(driver, a.base + b)
        again = a.tensor((b,), torch.uint8)  # torch hands the cached block out again
        assert _span(again)[0] == a.base + b
        again.fill_(3)
        assert a.uncommit_beyond(b) == b  # live, not cached: allowed
        assert not _mapped(driver, a.base + b)
        del again  # now cached over unmapped memory: use() refuses before routing anything
        nalloc = a.stats()["nalloc"]
        with pytest.raises(ArenaError, match=r"caches freed block\(s\) in uncommitted memory \(1: .*inactive\)"):
            with a.use():  # torch would hand the block out and the body would write to it at once
                pytest.fail("use() routed allocations with a cached block over unmapped memory")
        with pytest.raises(ArenaError, match=r"caches freed block\(s\) in uncommitted memory"):
            a.tensor((b,), torch.uint8)
        assert a.stats()["nalloc"] == nalloc
        gc.collect()
        late = a.tensor((b,), torch.uint8, check_committed=False)  # asked for: the upper-bound pattern
        assert _span(late)[0] == a.base + b
        a.commit(2 * b)
        late.fill_(2)
        assert int(late.sum()) == 2 * b
        keep.fill_(1)
        assert int(keep.sum()) == b
        del keep, late


def test_uncommit_and_recommit(cache, driver):
    from kvarena import KvArena

    with KvArena(512 * MiB, device="cuda", cache=cache) as a:
        g = a.granularity
        a.commit(4 * g)
        a.commit(8 * g)  # a second mapping
        assert a.committed == 8 * g
        assert a.uncommit_beyond(4 * g) == 4 * g and a.committed == 4 * g
        assert _mapped(driver, a.base) and not _mapped(driver, a.base + 4 * g)
        a.commit(8 * g)
        assert _mapped(driver, a.base + 4 * g)
        t = a.tensor((8 * g,), torch.uint8)
        t.fill_(3)
        assert int(t.sum()) == 3 * 8 * g
        del t


def test_exhaustion_is_a_clear_error(cache):
    from kvarena import ArenaExhaustedError, KvArena

    with KvArena(64 * MiB, device="cuda", cache=cache) as a:
        a.commit(64 * MiB)
        with pytest.raises(ArenaExhaustedError, match="does not fit in the arena"):
            with a.use():
                torch.empty((128 * MiB,), dtype=torch.uint8, device=a.device)
        assert a.stats()["nfail"] >= 1


@two_gpus
@pytest.mark.parametrize("arena_dev,current", [(1, 0), (0, 1)])
def test_arena_on_a_device_other_than_the_current_one(cache, driver, arena_dev, current):
    from kvarena import KvArena

    torch.cuda.set_device(current)
    with KvArena(256 * MiB, device=f"cuda:{arena_dev}", cache=cache) as a:
        assert a.device == f"cuda:{arena_dev}"
        a.commit(64 * MiB)
        assert _mapped(driver, a.base, arena_dev)
        with a.use():
            x = torch.empty((4 * MiB,), dtype=torch.uint8, device=a.device)
        assert torch.cuda.current_device() == current
        assert a.stats()["nalloc"] == 1  # the stub made it, not plain cudaMalloc on cuda:N
        _assert_in(a, x)
        y = a.tensor((1024,), torch.float32)
        _assert_in(a, y)
        x.fill_(4)
        y.fill_(0.5)
        assert int(x.sum()) == 16 * MiB and float(y.sum()) == 512.0
        a.check_pool()
        del x, y


@two_gpus
def test_the_pool_check_catches_the_wrong_device_binding(cache):
    """The old bug, built on purpose: a pool made while cuda:0 is current and used on cuda:1."""
    from torch.cuda.memory import CUDAPluggableAllocator

    from kvarena import KvArena
    from kvarena import pool as torch_pool

    torch.cuda.set_device(0)
    with KvArena(256 * MiB, device="cuda:1", cache=cache) as a:
        a.commit(64 * MiB)
        alloc = CUDAPluggableAllocator(a.stub_path, a.alloc_fn_name, a.free_fn_name)
        bad = torch.cuda.MemPool(alloc.allocator())  # bound to cuda:0, the current device
        with torch.cuda.use_mem_pool(bad, device=1):
            x = torch.empty((4 * MiB,), dtype=torch.uint8, device="cuda:1")
        lo, hi = _span(x)
        in_arena = a.base <= lo and hi <= a.base + a.reserved
        found = torch_pool.foreign_segments(torch_pool.snapshot(bad), 1, a.base, a.reserved)
        assert bool(found) == (not in_arena), (found, hex(lo))
        print(f"wrong binding: tensor {'in' if in_arena else 'outside'} the arena; detector found {len(found)}")
        del x, bad, alloc


def test_demo_on_cuda(cache_root, driver):
    from tests.conftest import run_py

    runs = []
    for _ in range(2):
        proc = run_py("from kvarena.demo import main; raise SystemExit(main(['--device', 'cuda']))", timeout=300)
        print(proc.stdout)
        runs.append(proc.stdout)
    cold, warm = runs
    assert "cache miss, built now" in cold and "cache hit" in warm
    for out in runs:
        m = re.search(r"^arena +(cuda:\d+): reserved (\d+) MiB at (0x[0-9a-f]+), granularity (\d+) B", out, re.M)
        assert m, out
        dev, reserved, gran = m.group(1), int(m.group(2)) * MiB, int(m.group(4))
        k = re.search(r"^kv tensor +\(4, 2, 4096, 8, 128\) torch.float16 on (cuda:\d+): offset (\d+), "
                      r"([\d.]+) MiB, sum=([\d.]+)$", out, re.M)
        assert k, out
        assert k.group(1) == dev
        offset, size = int(k.group(2)), float(k.group(3)) * MiB
        assert offset % gran == 0 and offset + size <= reserved
        assert float(k.group(4)) == 8 * 128  # kv[0, 0, 0] = 1 over heads x head_dim
        assert re.search(r"^check +in arena: True, committed: True, stub allocations: [1-9]", out, re.M), out
        assert "closed         ok" in out
