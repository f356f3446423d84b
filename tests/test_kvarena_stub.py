"""The allocator stub on its own, through ctypes: spec, slots, alignment, bounds, threads."""

from __future__ import annotations

import ctypes
import threading
import weakref

import pytest

import stubcache
from kvarena import stub as kstub
from kvarena.errors import SlotsExhaustedError


@pytest.fixture
def stub(cache_root):
    return kstub.load_stub(stubcache.StubCache(cache_root))


def test_spec_is_lean_and_direct():
    spec = kstub.allocator_spec()
    assert isinstance(spec, stubcache.StubSpec)
    assert spec.build_method == "direct"
    assert spec.skips_implicit_headers and not spec.is_python_module
    src = "\n".join(spec.cpp_sources)
    includes = sorted(line.split()[1] for line in src.splitlines() if line.startswith("#include"))
    assert includes == ["<stddef.h>", "<stdint.h>"]  # builtins instead of <atomic>/<mutex>
    assert kstub.allocator_spec() == spec  # deterministic: one key for every arena and process


def test_exports_every_slot_pair_with_torch_signatures(stub):
    lib = ctypes.CDLL(stub.path)
    assert stub.nslots == kstub.NSLOTS
    for i in (0, kstub.NSLOTS - 1):
        getattr(lib, kstub.alloc_symbol(i))
        getattr(lib, kstub.free_symbol(i))
    with pytest.raises(AttributeError):
        getattr(lib, kstub.alloc_symbol(kstub.NSLOTS))


def test_torch_dlopen_of_the_path_shares_state(stub):
    """CUDAPluggableAllocator dlopens entry.path; it must see the state we configured."""
    slot = stub.acquire_slot()
    try:
        buf = ctypes.create_string_buffer(4096)
        base = ctypes.addressof(buf)
        slot.configure(base, 4096, 16)
        other = ctypes.CDLL(stub.path)
        fn = getattr(other, slot.alloc_name)
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        p = fn(100, 0, None)
        assert p is not None and base <= p < base + 4096
        assert slot.cursor() == p - base + 100
    finally:
        slot.release()


def test_alignment_bounds_and_null_past_the_range(stub):
    slot = stub.acquire_slot()
    try:
        buf = ctypes.create_string_buffer(1 << 16)
        base = (ctypes.addressof(buf) + 255) & ~255
        slot.configure(base, 4096, 256)
        ptrs = [slot.alloc(n) for n in (1, 300, 17, 1000)]
        assert all(p % 256 == 0 for p in ptrs)
        assert ptrs == sorted(ptrs) and ptrs[0] == base
        assert slot.alloc(4096) is None  # would pass the reserved end
        assert slot.stats()["nfail"] == 1
        rest = base + 4096 - (base + slot.cursor() + 255 & ~255)
        p = slot.alloc(rest)
        assert p is not None and p + rest == base + 4096
        assert slot.alloc(1) is None
    finally:
        slot.release()


def test_lifo_free_rewinds_and_unconfigured_slot_fails(stub):
    slot = stub.acquire_slot()
    buf = ctypes.create_string_buffer(4096)
    slot.configure(ctypes.addressof(buf), 4096, 1)
    a = slot.alloc(10)
    b = slot.alloc(20)
    slot.free(a, 10)  # not the latest: only counted
    assert slot.cursor() == 30
    slot.free(b, 20)
    assert slot.cursor() == 10
    slot.release()
    assert slot.alloc(1) is None
    with pytest.raises(ValueError, match="power of two"):
        stub.acquire_slot().configure(ctypes.addressof(buf), 4096, 3)


def test_slots_are_independent_and_exhaust_clearly(stub):
    held = []
    try:
        while stub.free_slots():
            held.append(stub.acquire_slot())
        assert len({s.index for s in held}) == len(held)
        with pytest.raises(SlotsExhaustedError, match="close an arena"):
            stub.acquire_slot()
        held.pop().release()
        held.append(stub.acquire_slot())
    finally:
        for s in held:
            s.release()


def test_many_threads_never_overlap(stub):
    """ctypes drops the GIL around each foreign call, so the threads really race in C."""
    slot = stub.acquire_slot()
    size, nthreads, per = 1 << 22, 16, 1500
    buf = ctypes.create_string_buffer(size)
    slot.configure(ctypes.addressof(buf), size, 8)
    results: list[list[tuple[int, int]]] = [[] for _ in range(nthreads)]
    barrier = threading.Barrier(nthreads)

    def work(k: int) -> None:
        barrier.wait()
        for j in range(per):
            n = 1 + (k * 131 + j * 17) % 200
            p = slot.alloc(n)
            if p is not None:
                results[k].append((p, n))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        spans = sorted(x for r in results for x in r)
        assert len(spans) == nthreads * per
        for (p0, n0), (p1, _) in zip(spans, spans[1:]):
            assert p0 + n0 <= p1
        assert all(p % 8 == 0 for p, _ in spans)
        assert slot.cursor() == spans[-1][0] + spans[-1][1] - ctypes.addressof(buf)
    finally:
        slot.release()


class _Keeper:
    """Stands in for what can still call into a slot (torch's MemPool and its allocator)."""


def _torch_side(stub, slot):
    """The slot's exported pair through a second dlopen, as CUDAPluggableAllocator calls them."""
    lib = ctypes.CDLL(stub.loaded_path)
    alloc = getattr(lib, slot.alloc_name)
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    free = getattr(lib, slot.free_name)
    free.restype = None
    free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return alloc, free


def test_a_late_free_cannot_rewind_another_arenas_cursor(stub):
    """The reuse bug: arena A closes while torch still caches a block A's slot handed out and
    still holds A's pool; the slot must not serve arena B until both are gone."""
    buf = ctypes.create_string_buffer((1 << 16) + 64)
    base = (ctypes.addressof(buf) + 63) & ~63
    a = stub.acquire_slot()
    a.configure(base, 1 << 15, 64)
    alloc, free = _torch_side(stub, a)
    cached = alloc(4096, 0, None)  # a freed tensor's block, cached in A's pool
    assert cached == base and a.stats()["live"] == 1
    pool = _Keeper()
    a.release([weakref.ref(pool)])
    assert alloc(64, 0, None) is None  # a closed arena's slot hands out nothing more
    assert a.index in stub.retired_slots()

    held = []
    while stub.free_slots():  # every other slot: none of them may be A's
        held.append(stub.acquire_slot())
    try:
        assert a.index not in {s.index for s in held}
        with pytest.raises(SlotsExhaustedError, match="1 of them belong to closed arenas"):
            stub.acquire_slot()
        # the stub itself refuses too: reconfiguring under a live allocation is what corrupts
        assert stub._configure(a.index, base + (1 << 15), 1 << 15, 64) == -3

        b = held[0]
        b.configure(base + (1 << 15), 1 << 15, 64)
        tb = b.alloc(4096)
        del pool  # the pool goes; torch empties its cache through A's free function
        free(cached, 4096, 0, None)
        assert b.cursor() == 4096 and b.alloc(64) == tb + 4096  # B's cursor never moved back
        assert a.stats()["live"] == 0
        assert stub.retired_slots() == []  # now, and only now, A's slot is free again
        again = stub.acquire_slot()
        assert again.index == a.index
        again.configure(base, 1 << 15, 64)
        assert again.stats()["gen"] == a.gen + 1 and again.cursor() == 0
        held.append(again)
    finally:
        for s in held:
            s.release()


def test_a_slot_stays_retired_while_its_pool_lives(stub):
    slot = stub.acquire_slot()
    buf = ctypes.create_string_buffer(4096)
    slot.configure(ctypes.addressof(buf), 4096, 16)
    pool = _Keeper()
    slot.release([weakref.ref(pool)])  # nothing allocated, but the pool could still allocate
    assert slot.index in stub.retired_slots()
    assert stub.reclaim() == 0
    del pool
    assert stub.reclaim() == 1 and slot.index not in stub.retired_slots()


def test_a_stale_owner_cannot_disarm_the_slot_of_another_arena(stub):
    buf = ctypes.create_string_buffer(8192)
    old = stub.acquire_slot()
    old.configure(ctypes.addressof(buf), 4096, 16)
    old_gen = old.gen
    old.release()
    new = stub.acquire_slot()
    assert new.index == old.index
    try:
        new.configure(ctypes.addressof(buf) + 4096, 4096, 16)
        assert new.gen == old_gen + 1
        assert stub._unconfigure(new.index, old_gen) == -4
        assert new.alloc(16) == ctypes.addressof(buf) + 4096  # still armed
        assert stub._configure(new.index, ctypes.addressof(buf), 4096, 16) == -4  # configured: refuse
    finally:
        new.release()


def test_live_counts_every_unfreed_allocation_across_threads(stub):
    slot = stub.acquire_slot()
    size = 1 << 20
    buf = ctypes.create_string_buffer(size)
    slot.configure(ctypes.addressof(buf), size, 8)
    got: list[list[int]] = [[] for _ in range(8)]

    def work(k: int) -> None:
        for _ in range(500):
            got[k].append(slot.alloc(8))
        for p in got[k][::2]:
            slot.free(p, 8)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    st = slot.stats()
    assert st["nalloc"] == 4000 and st["nfree"] == 2000 and st["live"] == 2000
    for ps in got:
        for p in ps[1::2]:
            slot.free(p, 8)
    assert slot.stats()["live"] == 0
    slot.free(ctypes.addressof(buf), 8)  # a stray free never wraps the count below zero
    assert slot.stats()["live"] == 0
    slot.release()
    assert slot.index not in stub.retired_slots()


def test_the_allocator_outlives_every_allocation_it_made(stub):
    """A torch without PR #171962 (MemPool's private pool holds a raw pointer to the custom
    allocator) calls the allocator's free for a tensor that outlived its pool: the allocator
    object must stay alive until the slot's last allocation is freed, not die at close()."""
    from kvarena.arena import _Resources
    from kvarena.host import HostBackend

    class Obj:
        pass

    backend = HostBackend(1 << 16)
    slot = stub.acquire_slot()
    slot.configure(backend.base, backend.reserved, 64)
    res = _Resources(backend, slot)
    res.pool, res.allocator = Obj(), Obj()
    pool_ref, alloc_ref = weakref.ref(res.pool), weakref.ref(res.allocator)
    alloc, free = _torch_side(stub, slot)
    ptr = alloc(4096, 0, None)  # a tensor still alive at close()
    res.release()
    assert pool_ref() is None  # the pool is dropped at close (torch frees its cached blocks then)
    assert alloc_ref() is not None and slot.index in stub.retired_slots()
    free(ptr, 4096, 0, None)  # the tensor goes; torch frees its block through the allocator
    assert slot.index not in stub.retired_slots()
    assert alloc_ref() is None  # and only now may the allocator go
