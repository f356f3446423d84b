"""CUDA arenas: skipped cleanly where torch sees no GPU. Run them all with scripts/run_gpu_tests.sh."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA-enabled torch"),
]

MiB = 1 << 20


@pytest.fixture
def driver():
    return pytest.importorskip("cuda.bindings.driver", reason="needs cuda-bindings (pip install 'stubcache[cuda]')")


@pytest.fixture
def cache(cache_root, driver):
    import stubcache

    return stubcache.StubCache(cache_root)


def _free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _mapped(driver, ptr: int) -> bool:
    err, *_ = driver.cuMemGetAddressRange(ptr)
    return err == driver.CUresult.CUDA_SUCCESS


def test_tensors_lie_in_the_arena_at_aligned_offsets_and_hold_data(cache):
    from kvarena import KvArena

    with KvArena(512 * MiB, device="cuda", cache=cache) as a:
        assert a.reserved % a.granularity == 0 and a.alignment == a.granularity
        a.commit(256 * MiB)
        with a.use():
            ts = [torch.empty((n,), dtype=torch.float32, device=a.device) for n in (1 << 20, 3 << 20, 5 << 18)]
        for t in ts:
            off = t.data_ptr() - a.base
            assert 0 <= off and off + t.numel() * 4 <= a.reserved, off
            assert off % a.granularity == 0, off
        ptrs = sorted(t.data_ptr() for t in ts)
        assert len(set(ptrs)) == 3
        for i, t in enumerate(ts):
            t.copy_(torch.arange(t.numel(), dtype=torch.float32) + i)
        for i, t in enumerate(ts):
            assert torch.equal(t.cpu(), torch.arange(t.numel(), dtype=torch.float32) + i)
        assert a.stats()["nalloc"] >= 3
        del ts, t


@pytest.mark.skipif("no_split" not in inspect.signature(torch.cuda.MemPool.__init__).parameters,
                    reason="MemPool(no_split=) needs torch>=2.10")
def test_no_split_gives_each_tensor_its_own_allocation(cache):
    from kvarena import KvArena

    with KvArena(256 * MiB, device="cuda", cache=cache) as a:
        a.commit(64 * MiB)
        with a.use():
            x = torch.empty(256, device=a.device)
            y = torch.empty(256, device=a.device)
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
        assert a.base <= ta.data_ptr() < a.base + a.reserved
        assert b.base <= tb.data_ptr() < b.base + b.reserved
        ta.fill_(1.5)
        tb.fill_(-2.0)
        assert float(ta.float().mean()) == 1.5 and float(tb.float().mean()) == -2.0
        del ta, tb
    finally:
        a.close()
        b.close()


def test_commit_uses_memory_and_close_releases_the_mapping(cache, driver):
    from kvarena import ArenaClosedError, KvArena

    before = _free_bytes()
    a = KvArena(1024 * MiB, device="cuda", cache=cache)
    base = a.base
    a.commit(512 * MiB)
    assert _mapped(driver, base)
    assert before - _free_bytes() >= 500 * MiB
    t = a.tensor((128 * MiB,), torch.uint8)
    t.fill_(7)
    assert int(t[-1]) == 7
    del t
    a.close()
    assert not _mapped(driver, base)
    assert before - _free_bytes() < 64 * MiB
    with pytest.raises(ArenaClosedError):
        a.commit(1)


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
        with pytest.raises(Exception):
            a.commit(a.reserved + 1)


def test_demo_on_cuda(cache_root, driver):
    from tests.conftest import run_py

    proc = run_py("from kvarena.demo import main; raise SystemExit(main(['--device', 'cuda']))", timeout=300)
    assert "kv tensor" in proc.stdout and "cuda" in proc.stdout
    print(proc.stdout)
