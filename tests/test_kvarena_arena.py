"""KvArena on the host backend: real mmap/mprotect, real stub, real faults in child processes."""

from __future__ import annotations

import mmap
import os
import signal
import threading

import pytest
import torch

import stubcache
from kvarena import (ArenaClosedError, ArenaError, ArenaExhaustedError, CommitError, CudaUnavailableError,
                     KvArena, SlotsExhaustedError, load_stub)
from tests.conftest import run_py

PAGE = mmap.PAGESIZE


@pytest.fixture
def cache(cache_root):
    return stubcache.StubCache(cache_root)


def _mapped(base: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= base < hi:
                return True
    return False


def test_several_arenas_are_independent_and_disjoint(cache):
    arenas = [KvArena(1 << 20, cache=cache) for _ in range(3)]
    try:
        assert len({a.slot for a in arenas}) == 3
        spans = sorted((a.base, a.base + a.reserved) for a in arenas)
        for (_, hi), (lo, _) in zip(spans, spans[1:]):
            assert hi <= lo
        for a in arenas:
            a.commit(64 << 10)
        tensors = []
        for i, a in enumerate(arenas):
            for _ in range(i + 1):
                t = a.tensor((10,), torch.float32)
                t.fill_(i)
                tensors.append((a, t))
        assert [a.cursor for a in arenas] == [40, 64 + 40, 128 + 40]
        for a, t in tensors:
            assert a.base <= t.data_ptr() < a.base + a.committed
            assert float(t.sum()) == 10 * arenas.index(a)
    finally:
        for a in arenas:
            a.close()


def test_alignment_holds(cache):
    with KvArena(1 << 20, alignment=4096, cache=cache) as a:
        a.commit(a.reserved)
        kept = [a.tensor(n, torch.uint8) for n in (1, 5000, 3, 4097)]
        ptrs = [t.data_ptr() for t in kept]
        assert ptrs == [a.base + k * 4096 for k in (0, 1, 3, 4)]
    with KvArena(1 << 16, cache=cache) as a:
        a.commit(1 << 16)
        kept = [a.tensor(n, torch.uint8) for n in (1, 7, 65)]
        assert [t.data_ptr() - a.base for t in kept] == [0, 64, 128]


def test_exhaustion_is_a_clear_error(cache):
    with KvArena(2 * PAGE, cache=cache) as a:
        a.commit(2 * PAGE)
        first = a.tensor(PAGE, torch.uint8)  # kept alive: a dropped tensor gives its range back
        with pytest.raises(ArenaExhaustedError, match=r"does not fit in the arena: \d+ of \d+ bytes"):
            a.tensor(PAGE + 1, torch.uint8)
        assert a.stats()["nfail"] == 1
        keep = a.tensor(PAGE, torch.uint8)  # exactly what is left still fits
        assert keep.data_ptr() + PAGE == a.base + a.reserved
        assert first.data_ptr() == a.base


def test_commit_rounds_is_monotonic_and_bounded(cache):
    with KvArena(10 * PAGE + 1, cache=cache) as a:
        assert a.reserved == 11 * PAGE and a.committed == 0
        assert a.commit(1) == PAGE
        assert a.commit(PAGE) == PAGE  # idempotent
        assert a.commit(3 * PAGE + 5) == 4 * PAGE
        assert a.commit(PAGE) == 4 * PAGE  # monotonic: never shrinks
        with pytest.raises(CommitError, match="exceeds the reservation"):
            a.commit(a.reserved + 1)
        with pytest.raises(CommitError):
            a.commit(-1)
        assert a.uncommit_beyond(PAGE + 1) == 2 * PAGE
        assert a.committed == 2 * PAGE
        assert a.uncommit_beyond(5 * PAGE) == 0


def test_tensor_must_lie_in_committed_memory(cache):
    with KvArena(4 * PAGE, cache=cache) as a:
        a.commit(PAGE)
        with pytest.raises(ArenaError, match="past the .* committed bytes"):
            a.tensor(PAGE + 1, torch.uint8)
        assert a.cursor == 0  # the refused allocation was given back
        t = a.tensor(2 * PAGE, torch.uint8, check_committed=False)  # the KV pattern: commit later
        a.commit(2 * PAGE)
        t.fill_(7)
        assert int(t.sum()) == 7 * 2 * PAGE


_FAULT_CHILD = """
import mmap, os, sys, torch, kvarena
PAGE = mmap.PAGESIZE
a = kvarena.KvArena(8 * PAGE)
t = a.tensor(4 * PAGE, torch.uint8, check_committed=False)
step = sys.argv[-1] if len(sys.argv) > 1 else os.environ["STEP"]
a.commit(2 * PAGE)
t[: 2 * PAGE].fill_(5)
print("committed-read", int(t[: 2 * PAGE].sum()), flush=True)
if step == "uncommitted":
    print("touching", flush=True)
    t[3 * PAGE] = 1
elif step == "uncommit":
    a.uncommit_beyond(PAGE)
    print("first-page", int(t[:PAGE].sum()), flush=True)
    print("touching", flush=True)
    int(t[PAGE])
elif step == "recommit":
    a.uncommit_beyond(PAGE)
    a.commit(2 * PAGE)
    print("recommitted", int(t[PAGE: 2 * PAGE].sum()), int(t[:PAGE].sum()), flush=True)
"""


@pytest.mark.parametrize("step", ["uncommitted", "uncommit"])
def test_touching_uncommitted_memory_faults(cache_root, step):
    proc = run_py(_FAULT_CHILD, env={"STEP": step}, check=False, timeout=120)
    assert f"committed-read {5 * 2 * PAGE}" in proc.stdout
    assert "touching" in proc.stdout
    if step == "uncommit":
        assert f"first-page {5 * PAGE}" in proc.stdout
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)


def test_recommit_is_readable_and_zeroed(cache_root):
    proc = run_py(_FAULT_CHILD, env={"STEP": "recommit"}, timeout=120)
    assert f"recommitted 0 {5 * PAGE}" in proc.stdout


def test_many_threads_allocating_tensors_never_overlap(cache):
    with KvArena(8 << 20, cache=cache) as a:
        a.commit(a.reserved)
        got: list[list[torch.Tensor]] = [[] for _ in range(8)]
        barrier = threading.Barrier(8)

        def work(k: int) -> None:
            barrier.wait()
            for j in range(200):
                got[k].append(a.tensor(1 + (k * 7 + j) % 300, torch.uint8))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        spans = sorted((t.data_ptr(), t.numel()) for ts in got for t in ts)
        assert len(spans) == 1600
        for (p0, n0), (p1, _) in zip(spans, spans[1:]):
            assert p0 + n0 <= p1
        for k, ts in enumerate(got):  # each thread writes its own ranges; nobody else's changed
            for t in ts:
                t.fill_(k)
        for k, ts in enumerate(got):
            assert all(int(t.max()) == k == int(t.min()) for t in ts)


def test_closed_arena_errors_and_slot_is_reused(cache):
    a = KvArena(1 << 16, cache=cache)
    slot = a.slot
    a.close()
    a.close()  # idempotent
    for call in (lambda: a.commit(1), lambda: a.tensor(1), lambda: a.uncommit_beyond(0), a.stats):
        with pytest.raises(ArenaClosedError, match="is closed"):
            call()
    assert not _mapped(a.base)
    with KvArena(1 << 16, cache=cache) as b:
        assert b.slot == slot and b.cursor == 0


def test_close_with_live_tensor_keeps_the_mapping_until_it_is_gone(cache):
    a = KvArena(1 << 16, cache=cache)
    a.commit(PAGE)
    t = a.tensor(16, torch.int32)
    view = t[4:]
    t.fill_(3)
    a.close()
    del t
    assert _mapped(a.base) and int(view.sum()) == 36  # still valid memory
    del view
    assert not _mapped(a.base)


def test_slots_run_out_with_a_clear_error(cache):
    stub = load_stub(cache)
    arenas = []
    try:
        while stub.free_slots():
            arenas.append(KvArena(PAGE, cache=cache))
        with pytest.raises(SlotsExhaustedError, match="allocator slots"):
            KvArena(PAGE, cache=cache)
        arenas.pop().close()
        arenas.append(KvArena(PAGE, cache=cache))
    finally:
        for a in arenas:
            a.close()


def test_use_is_cuda_only(cache):
    with KvArena(PAGE, cache=cache) as a:
        with pytest.raises(ArenaError, match="host arena"):
            with a.use():
                pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_cuda_without_gpu_is_a_clear_error(cache, device):
    with pytest.raises(CudaUnavailableError, match="device='cpu'"):
        KvArena(1 << 20, device=device, cache=cache)


def test_bad_arguments(cache):
    with pytest.raises(ValueError):
        KvArena(0, cache=cache)
    with pytest.raises(ValueError, match="power of two"):
        KvArena(PAGE, alignment=48, cache=cache)
    with pytest.raises(ValueError, match="page size"):
        KvArena(PAGE, granularity=100, cache=cache)
    with pytest.raises(ValueError, match="cpu' or 'cuda"):
        KvArena(PAGE, device="meta", cache=cache)


def test_demo_runs(cache_root):
    proc = run_py("from kvarena.demo import main; raise SystemExit(main(['--device', 'cpu', '--tokens', '64']))")
    assert "cache miss, built now" in proc.stdout and "kv tensor" in proc.stdout
    proc = run_py("from kvarena.demo import main; raise SystemExit(main(['--device', 'cpu', '--tokens', '64']))")
    assert "cache hit" in proc.stdout and "closed         ok" in proc.stdout
    assert os.path.isdir(cache_root)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where the driver is missing")
def test_cuda_backend_without_driver_is_a_clear_error():
    pytest.importorskip("cuda.bindings.driver")
    from kvarena.cuda import CudaBackend

    with pytest.raises(CudaUnavailableError, match="CUDA driver initialisation failed"):
        CudaBackend(1 << 20, 0)


def test_import_does_not_import_torch_or_cuda_bindings():
    proc = run_py("import sys, kvarena; print('torch' in sys.modules, 'cuda.bindings' in sys.modules)")
    assert proc.stdout.split() == ["False", "False"]


def test_closed_arenas_slot_waits_for_its_live_tensors(cache):
    """A host arena's tensors are its allocations: a late free must never reach a reused slot."""
    stub = load_stub(cache)
    a = KvArena(1 << 16, cache=cache)
    a.commit(PAGE)
    t = a.tensor(PAGE, torch.uint8)  # at offset 0; its free would rewind a cursor to 0
    t.fill_(1)
    a.close()
    assert a.slot in stub.retired_slots()
    with KvArena(1 << 16, cache=cache) as b:
        assert b.slot != a.slot
        b.commit(2 * PAGE)
        tb = b.tensor(PAGE, torch.uint8)
        tb.fill_(2)
        del t  # the late free: counted on a's slot, a's mapping goes
        assert not _mapped(a.base)
        assert a.slot not in stub.retired_slots()
        tb2 = b.tensor(PAGE, torch.uint8)
        assert tb2.data_ptr() == tb.data_ptr() + PAGE
        tb2.fill_(3)
        assert int(tb.sum()) == 2 * PAGE
        with KvArena(1 << 16, cache=cache) as c:
            assert c.slot == a.slot and c.cursor == 0


class _FailingMunmap:
    """libc, except that munmap fails the first ``n`` times (a release that hits an error)."""

    def __init__(self, libc, n: int) -> None:
        self._libc, self.n = libc, n

    def __getattr__(self, name):
        return getattr(self._libc, name)

    def munmap(self, addr, size):
        if self.n:
            self.n -= 1
            import ctypes
            import errno

            ctypes.set_errno(errno.EINVAL)
            return -1
        return self._libc.munmap(addr, size)


def test_a_failed_release_says_what_is_left_and_close_retries_it(cache, monkeypatch):
    from kvarena import host

    a = KvArena(1 << 16, cache=cache)
    a.commit(PAGE)
    monkeypatch.setattr(host, "_libc", _FailingMunmap(host._lib(), 1))
    with pytest.raises(ArenaError, match=r"munmap\(65536 bytes\) failed.*still held: the reservation at "
                                         rf"{a.base:#x} \(65536 bytes, 4096 committed\); close\(\) again"):
        a.close()
    assert a.closed and not a.released and _mapped(a.base)
    with pytest.raises(ArenaClosedError):
        a.commit(1)
    a.close()  # the retry
    assert a.released and not _mapped(a.base)
    a.close()


def test_a_slot_held_only_by_a_reference_cycle_comes_back_when_needed(cache):
    """A closed arena's tensor kept alive by a cycle (a traceback, say): opening an arena when
    every other slot is taken collects it instead of failing."""
    import gc

    stub = load_stub(cache)
    arenas = []
    gc.disable()
    try:
        a = KvArena(1 << 16, cache=cache)
        a.commit(PAGE)
        cycle: list = [a.tensor(16, torch.uint8)]
        cycle.append(cycle)
        del cycle
        a.close()
        while stub.free_slots():
            arenas.append(KvArena(PAGE, cache=cache))
        assert stub.retired_slots() == [a.slot]
        b = KvArena(PAGE, cache=cache)  # collects the cycle, frees the tensor, takes a's slot
        arenas.append(b)
        assert b.slot == a.slot and not _mapped(a.base)
    finally:
        gc.enable()
        for x in arenas:
            x.close()


def test_arenas_dropped_in_reference_cycles_neither_deadlock_nor_use_up_the_slots(cache_root):
    """Arenas dropped without close() inside reference cycles are closed by the garbage
    collector, at whatever allocation it runs, including one inside kvarena's own slot
    bookkeeping (a collection there used to wait forever on the lock it was called under).
    Opening an arena when every slot is held by such garbage collects it instead of failing."""
    proc = run_py("""
        import faulthandler, gc
        faulthandler.dump_traceback_later(40, exit=True)  # a deadlock fails with its stack
        from kvarena import KvArena, load_stub
        stub = load_stub()
        gc.disable()
        a = KvArena(1 << 16)
        a.cycle = a  # never closed, unreachable: only the collector can close it
        del a
        with stub._lock:  # deterministic: a collection inside the critical section
            gc.collect()
        print("collected inside the lock")
        gc.enable()
        for threshold in (1, 2, 3, 5, 8):  # collections at many different allocations
            gc.set_threshold(threshold)
            for _ in range(2 * 64):
                a = KvArena(1 << 16)
                a.cycle = a
                del a
                stub.free_slots()
        gc.set_threshold(700)
        gc.disable()
        arenas = []
        for _ in range(64):  # every slot held by unreachable, unclosed arenas
            a = KvArena(1 << 16)
            a.cycle = a
            arenas.append(a)
        del a, arenas
        b = KvArena(1 << 16)  # collects them instead of raising SlotsExhaustedError
        b.close()
        gc.collect()
        print("free slots", stub.free_slots())
    """, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "collected inside the lock" in out and "free slots 64" in out, out
