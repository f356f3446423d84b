"""The allocator stub: its C source, its :class:`stubcache.StubSpec`, and process-local slots.

One compiled library serves every arena on the host. It exports a fixed table of
:data:`NSLOTS` independent bump allocators ("slots"); slot ``i`` has its own state and its
own pair of functions with the exact signatures torch's ``CUDAPluggableAllocator`` casts to::

    void* kvarena_alloc_<i>(size_t size, int device, void* stream);
    void  kvarena_free_<i>(void* ptr, size_t size, int device, void* stream);

The state is file-static, and a library is loaded once per process (glibc hands back the same
handle for the same file), so slots are a per-process resource: this module hands them out
to arenas and takes them back on close. The source never changes with the number of arenas or
processes, so the cache key never does either: one compile per host.

A closed arena's slot is not handed out again while anything can still call into it: torch
may free a block it cached long after ``close()`` (the pool outlived the arena), and that free
would rewind the next arena's cursor under a live tensor. So the stub counts each slot's
unfreed allocations (``live``) and refuses to reconfigure a slot while any are left, each
configuration has a generation that an unconfigure must name, and the Python side keeps a
closed slot *retired* until its ``live`` count is 0 and the objects that could still allocate
through it (torch's pool and allocator, held by weak reference) are gone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from typing import Any, Optional, Sequence

import stubcache

from .errors import ArenaError, SlotsExhaustedError

log = logging.getLogger("kvarena")

#: Number of allocator slots (independent arenas per process) the stub provides.
NSLOTS = 64
#: Bumped whenever the C interface below changes.
ABI_VERSION = 2
STUB_NAME = "kvarena_alloc_stub"

_HEADER = r"""// kvarena allocator stub: NSLOTS independent, thread-safe bump allocators.
// No torch, no CUDA, no libstdc++ headers: compiler builtins only (keeps the compile short).
#include <stddef.h>
#include <stdint.h>

#define KVA_NSLOTS %(nslots)d
#define KVA_ABI %(abi)d

typedef struct {
  uintptr_t base;      // first byte of the range
  size_t reserved;     // bytes in the range; 0 = slot not configured (every alloc fails)
  size_t align;        // power of two; every returned pointer is a multiple of it
  size_t cursor;       // bytes handed out so far (offset from base)
  size_t nalloc, nfree, nfail;
  size_t live;         // allocations not freed yet; survives unconfigure, blocks reconfigure
  size_t gen;          // bumped by every configure; unconfigure must name the current one
} __attribute__((aligned(64))) kva_slot;

static kva_slot g_slots[KVA_NSLOTS];

static void* kva_alloc(kva_slot* s, size_t size) {
  size_t reserved = __atomic_load_n(&s->reserved, __ATOMIC_ACQUIRE);
  uintptr_t base = __atomic_load_n(&s->base, __ATOMIC_RELAXED);
  size_t align = __atomic_load_n(&s->align, __ATOMIC_RELAXED);
  if (size == 0) size = 1;  // distinct pointers, like malloc
  size_t cur = __atomic_load_n(&s->cursor, __ATOMIC_RELAXED);
  for (;;) {
    uintptr_t addr = base + cur;
    uintptr_t aligned = (addr + (align - 1)) & ~(uintptr_t)(align - 1);
    size_t off = (size_t)(aligned - base);
    if (reserved == 0 || aligned < addr || off > reserved || size > reserved - off) {
      __atomic_fetch_add(&s->nfail, 1, __ATOMIC_RELAXED);
      return NULL;  // never hand out memory past the reserved range
    }
    if (__atomic_compare_exchange_n(&s->cursor, &cur, off + size, 1,
                                    __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
      __atomic_fetch_add(&s->nalloc, 1, __ATOMIC_RELAXED);
      __atomic_fetch_add(&s->live, 1, __ATOMIC_ACQ_REL);
      return (void*)aligned;
    }
  }
}

static void kva_free(kva_slot* s, void* ptr, size_t size) {
  if (ptr == NULL) return;
  if (size == 0) size = 1;
  size_t off = (size_t)((uintptr_t)ptr - __atomic_load_n(&s->base, __ATOMIC_RELAXED));
  size_t end = off + size;
  // Freeing the most recent allocation rewinds the cursor (LIFO); other frees only count.
  __atomic_compare_exchange_n(&s->cursor, &end, off, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
  __atomic_fetch_add(&s->nfree, 1, __ATOMIC_RELAXED);
  size_t live = __atomic_load_n(&s->live, __ATOMIC_RELAXED);
  while (live != 0 && !__atomic_compare_exchange_n(&s->live, &live, live - 1, 1,
                                                   __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
  }
}

extern "C" {
int kvarena_abi(void) { return KVA_ABI; }
int kvarena_nslots(void) { return KVA_NSLOTS; }

// Point slot at [base, base+reserved) with the given alignment; resets cursor and counters and
// returns the slot's new generation (> 0). Refused (-3) while allocations of an earlier
// configuration are not freed: a late free from that arena's pool would otherwise rewind this one.
long kvarena_configure(int slot, uintptr_t base, size_t reserved, size_t align) {
  if (slot < 0 || slot >= KVA_NSLOTS) return -1;
  if (align == 0 || (align & (align - 1)) != 0 || reserved == 0) return -2;
  kva_slot* s = &g_slots[slot];
  if (__atomic_load_n(&s->reserved, __ATOMIC_ACQUIRE) != 0) return -4;  // configured: unconfigure first
  if (__atomic_load_n(&s->live, __ATOMIC_ACQUIRE) != 0) return -3;
  __atomic_store_n(&s->base, base, __ATOMIC_RELAXED);
  __atomic_store_n(&s->align, align, __ATOMIC_RELAXED);
  __atomic_store_n(&s->cursor, (size_t)0, __ATOMIC_RELAXED);
  __atomic_store_n(&s->nalloc, (size_t)0, __ATOMIC_RELAXED);
  __atomic_store_n(&s->nfree, (size_t)0, __ATOMIC_RELAXED);
  __atomic_store_n(&s->nfail, (size_t)0, __ATOMIC_RELAXED);
  size_t gen = __atomic_add_fetch(&s->gen, 1, __ATOMIC_ACQ_REL);
  __atomic_store_n(&s->reserved, reserved, __ATOMIC_RELEASE);
  return (long)gen;
}

// Stop slot from allocating (every later alloc returns NULL); frees are still counted. Only the
// configuration that is current may do this (-4 otherwise), so a stale owner cannot disarm a
// slot that already serves another arena.
int kvarena_unconfigure(int slot, size_t gen) {
  if (slot < 0 || slot >= KVA_NSLOTS) return -1;
  kva_slot* s = &g_slots[slot];
  if (__atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) != gen) return -4;
  __atomic_store_n(&s->reserved, (size_t)0, __ATOMIC_SEQ_CST);
  return 0;
}

size_t kvarena_cursor(int slot) {
  if (slot < 0 || slot >= KVA_NSLOTS) return (size_t)-1;
  return __atomic_load_n(&g_slots[slot].cursor, __ATOMIC_ACQUIRE);
}

// out[0..8] = base, reserved, align, cursor, nalloc, nfree, nfail, live, gen
int kvarena_stats(int slot, size_t* out) {
  if (slot < 0 || slot >= KVA_NSLOTS || out == NULL) return -1;
  kva_slot* s = &g_slots[slot];
  out[0] = __atomic_load_n(&s->base, __ATOMIC_RELAXED);
  out[1] = __atomic_load_n(&s->reserved, __ATOMIC_ACQUIRE);
  out[2] = __atomic_load_n(&s->align, __ATOMIC_RELAXED);
  out[3] = __atomic_load_n(&s->cursor, __ATOMIC_ACQUIRE);
  out[4] = __atomic_load_n(&s->nalloc, __ATOMIC_RELAXED);
  out[5] = __atomic_load_n(&s->nfree, __ATOMIC_RELAXED);
  out[6] = __atomic_load_n(&s->nfail, __ATOMIC_RELAXED);
  out[7] = __atomic_load_n(&s->live, __ATOMIC_ACQUIRE);
  out[8] = __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE);
  return 0;
}

#define KVA_PAIR(i)                                                              \
  void* kvarena_alloc_##i(size_t size, int device, void* stream) {              \
    (void)device; (void)stream; return kva_alloc(&g_slots[i], size);            \
  }                                                                              \
  void kvarena_free_##i(void* ptr, size_t size, int device, void* stream) {     \
    (void)device; (void)stream; kva_free(&g_slots[i], ptr, size);               \
  }
"""


def stub_source(nslots: int = NSLOTS) -> str:
    """The complete C++ source of the stub (pure; deterministic for a given ``nslots``)."""
    pairs = "\n".join(f"KVA_PAIR({i})" for i in range(nslots))
    return _HEADER % {"nslots": nslots, "abi": ABI_VERSION} + pairs + "\n}  // extern \"C\"\n"


def allocator_spec() -> stubcache.StubSpec:
    """The :class:`stubcache.StubSpec` of the allocator stub (``stubcache warm kvarena.stub:allocator_spec``).

    A plain C-ABI library: no Python module, no torch headers (``no_implicit_headers``), so
    stubcache builds it with one direct compiler call. No ``-O`` flag, like torch's own
    default: the allocator runs once per segment, and ``-O2`` would double the compile.
    """
    return stubcache.StubSpec(
        name=STUB_NAME,
        cpp_sources=stub_source(),
        is_python_module=False,
        no_implicit_headers=True,
        with_cuda=False,
    )


def alloc_symbol(index: int) -> str:
    """Name of slot ``index``'s allocation function."""
    return f"kvarena_alloc_{index}"


def free_symbol(index: int) -> str:
    """Name of slot ``index``'s free function."""
    return f"kvarena_free_{index}"


class StubTiming:
    """How the stub was obtained in this process: ``seconds`` for get_or_build + dlopen,
    ``built`` (True if it was compiled during this call, by this process or by a concurrent
    one that this process waited for; False for a cache hit), ``build_seconds`` (the compile,
    from the manifest), ``method`` (stubcache's build path) and the entry ``key``."""

    __slots__ = ("seconds", "built", "build_seconds", "method", "key")

    def __init__(self, seconds: float, built: bool, build_seconds: float, method: str, key: str) -> None:
        self.seconds = seconds
        self.built = built
        self.build_seconds = build_seconds
        self.method = method
        self.key = key

    def __repr__(self) -> str:
        what = "built" if self.built else "hit"
        return (f"StubTiming({what}, {self.seconds * 1e3:.1f} ms this process, compile "
                f"{self.build_seconds * 1e3:.1f} ms via {self.method}, key={self.key[:12]})")


STAT_NAMES = ("base", "reserved", "align", "cursor", "nalloc", "nfree", "nfail", "live", "gen")


class Slot:
    """One allocator slot of a loaded stub, held by one arena until :meth:`release`."""

    def __init__(self, stub: "StubLibrary", index: int) -> None:
        self.stub = stub
        self.index = index
        self.alloc_name = alloc_symbol(index)
        self.free_name = free_symbol(index)
        self._alloc = getattr(stub.lib, self.alloc_name)
        self._alloc.restype = ctypes.c_void_p
        self._alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._free = getattr(stub.lib, self.free_name)
        self._free.restype = None
        self._free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self.gen = 0  # the stub's generation of this slot while we hold it configured
        self.released = False

    def configure(self, base: int, reserved: int, align: int) -> None:
        """Point the slot at ``[base, base + reserved)``; resets its cursor and counters."""
        rc = int(self.stub._configure(self.index, base, reserved, align))
        if rc > 0:
            self.gen = rc
            return
        if rc == -2:
            raise ValueError(f"kvarena_configure(slot={self.index}, reserved={reserved}, align={align}) "
                             "failed: alignment must be a power of two and the range non-empty")
        if rc == -3:
            raise ArenaError(f"allocator slot {self.index} still has {self.stats()['live']} allocation(s) of a "
                             "closed arena outstanding; it must not serve a new arena before they are freed")
        raise ArenaError(f"kvarena_configure(slot={self.index}) failed ({rc}): the slot is already configured")

    def alloc(self, size: int, device: int = -1) -> Optional[int]:
        """Allocate ``size`` bytes through the slot's exported function; ``None`` when full."""
        return self._alloc(size, device, None)  # type: ignore[no-any-return]  # restype c_void_p: int or None

    def free(self, ptr: int, size: int, device: int = -1) -> None:
        """Free through the slot's exported function (rewinds only the latest allocation)."""
        self._free(ptr, size, device, None)

    def cursor(self) -> int:
        """Bytes handed out so far, from the stub's own cursor query."""
        return int(self.stub._cursor(self.index))

    def stats(self) -> dict[str, Any]:
        """``base, reserved, align, cursor, nalloc, nfree, nfail, live, gen`` as the stub sees them."""
        return self.stub.slot_stats(self.index)

    def release(self, keepers: Sequence["weakref.ref[Any]"] = (), hold: Sequence[Any] = ()) -> None:
        """Unconfigure the slot (every later allocation fails) and hand it back to the stub.

        The slot is reused only once nothing can call into it any more: every allocation it
        made has been freed (the stub's ``live`` count is 0) and every object in ``keepers``
        (weak references to whatever can still allocate through it: a torch ``MemPool``) is
        gone. Until then it stays retired, and the objects in ``hold`` (torch's allocator,
        which frees the blocks that outlive the pool) are kept alive with it.
        """
        if not self.released:
            self.released = True
            if self.gen:
                self.stub._unconfigure(self.index, self.gen)
            self.stub._retire(self.index, list(keepers), tuple(hold))


class StubLibrary:
    """The loaded stub library of one cache entry and its process-local slot table."""

    def __init__(self, entry: "stubcache.Entry", lib: ctypes.CDLL, timing: StubTiming) -> None:
        self.path = entry.path
        self.key = entry.key
        self.lib = lib
        #: the path the verified library was loaded by; give this to anything that ``dlopen``s
        #: by path (torch's CUDAPluggableAllocator): glibc hands back the same checked handle
        self.loaded_path = lib._name
        self.timing = timing
        abi = int(lib.kvarena_abi())
        if abi != ABI_VERSION:
            raise ArenaError(f"allocator stub {self.path} has ABI {abi}, expected {ABI_VERSION}")
        self._configure = lib.kvarena_configure
        self._configure.restype = ctypes.c_long
        self._configure.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
        self._unconfigure = lib.kvarena_unconfigure
        self._unconfigure.restype = ctypes.c_int
        self._unconfigure.argtypes = [ctypes.c_int, ctypes.c_size_t]
        self._cursor = lib.kvarena_cursor
        self._cursor.restype = ctypes.c_size_t
        self._cursor.argtypes = [ctypes.c_int]
        self._stats = lib.kvarena_stats
        self._stats.restype = ctypes.c_int
        self._stats.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
        self.nslots = int(lib.kvarena_nslots())
        self._lock = threading.Lock()
        self._free_slots = list(range(self.nslots - 1, -1, -1))  # pop() hands out 0 first
        # closed, waiting for their last caller: (keepers, objects held alive until then)
        self._retired: dict[int, tuple[list[weakref.ref[Any]], tuple[Any, ...]]] = {}
        # Slots released but not yet moved into _retired. _retire only appends here, never
        # takes _lock: it runs from an arena's finalizer, i.e. from whatever allocation the
        # garbage collector runs at, also one made while this thread holds _lock.
        self._released: list[tuple[int, list[weakref.ref[Any]], tuple[Any, ...]]] = []

    def slot_stats(self, index: int) -> dict[str, Any]:
        """The stub's counters of slot ``index`` (see :meth:`Slot.stats`)."""
        out = (ctypes.c_size_t * len(STAT_NAMES))()
        if self._stats(index, out) != 0:
            raise ValueError(f"no slot {index} in the kvarena stub ({self.nslots} slots)")
        return dict(zip(STAT_NAMES, (int(v) for v in out)))

    def acquire_slot(self) -> Slot:
        """Take a free slot, or raise :class:`SlotsExhaustedError`."""
        with self._lock:
            self._reclaim_locked()
            if not self._free_slots:
                waiting = ""
                if self._retired:
                    waiting = (f"; {len(self._retired)} of them belong to closed arenas whose torch pool, "
                               "tensors or cached blocks are still alive: drop those references (and call "
                               "torch.cuda.empty_cache() so torch hands cached blocks back)")
                raise SlotsExhaustedError(
                    f"all {self.nslots} allocator slots of the kvarena stub are held in this process "
                    f"(pid {os.getpid()}){waiting}; close an arena before opening another")
            index = self._free_slots.pop()
        return Slot(self, index)

    def _retire(self, index: int, keepers: list[Any], hold: tuple[Any, ...] = ()) -> None:
        self._released.append((index, keepers, hold))  # atomic; taken into _retired under the lock

    def _reclaim_locked(self) -> int:
        back = 0
        while self._released:
            index, keepers, hold = self._released.pop()
            if index not in self._free_slots:
                self._retired[index] = (keepers, hold)
        for index, (keepers, _) in list(self._retired.items()):
            if any(ref() is not None for ref in keepers) or self.slot_stats(index)["live"]:
                continue
            del self._retired[index]
            self._free_slots.append(index)
            back += 1
        if back:
            log.debug("kvarena: %d retired allocator slot(s) free again", back)
        return back

    def reclaim(self) -> int:
        """Return retired slots whose last caller is gone to the free list; how many came back."""
        with self._lock:
            return self._reclaim_locked()

    def retired_slots(self) -> list[int]:
        """Slots of closed arenas still waiting for their pool or allocations to go away."""
        with self._lock:
            self._reclaim_locked()
            return sorted(self._retired)

    def free_slots(self) -> int:
        """How many slots are available right now in this process."""
        with self._lock:
            self._reclaim_locked()
            return len(self._free_slots)


# Keyed like glibc keys loaded objects (device, inode): a second load of the same file returns
# the same handle and so the same slot table, whatever path it came through.
_loaded: dict[tuple[int, int], StubLibrary] = {}
_load_lock = threading.Lock()
_spec: Optional[stubcache.StubSpec] = None  # one spec object, so stubcache memoizes its key


def load_stub(cache: Optional[stubcache.StubCache] = None) -> StubLibrary:
    """Get (build once per host) and load the stub; one :class:`StubLibrary` per file per process.

    Args:
        cache: the :class:`stubcache.StubCache` to use; default ``stubcache.default_cache()``.
    """
    global _spec
    cache = cache if cache is not None else stubcache.default_cache()
    t0 = time.perf_counter()
    t_wall = time.time()
    if _spec is None:
        _spec = allocator_spec()
    entry = cache.get_or_build(_spec)
    with _load_lock:
        lib = cache.load_entry(entry)
        # The identity of the file actually loaded (the verified open fd), not of whatever the
        # entry path names now: an entry replaced on disk must not alias a second slot table.
        st = os.stat(lib._name)
        ident = (st.st_dev, st.st_ino)
        found = _loaded.get(ident)
        if found is not None:
            return found
        seconds = time.perf_counter() - t0
        built = entry.manifest.created >= t_wall - 1e-3 and bool(entry.manifest.created)
        timing = StubTiming(seconds, built, float(entry.manifest.build_seconds or 0.0),
                            str(entry.manifest.build_method), entry.key)
        stub = StubLibrary(entry, lib, timing)
        _loaded[ident] = stub
    log.debug("kvarena: allocator stub %s (%r)", entry.path, timing)
    return stub
