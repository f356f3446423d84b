"""The check that what the loader mapped is the verified file (stubcache/mapped.py): the direct
way (the object's first segment through /proc/self/map_files). The full scan of /proc/self/maps,
which decides whenever the direct way cannot, is exercised by
tests/test_dropin.py::test_a_library_swapped_between_check_and_load_is_refused."""

from __future__ import annotations

import ctypes
import os

import stubcache
from stubcache import mapped


def _maps_of(path: str) -> list[tuple[str, int]]:
    with open("/proc/self/maps") as fh:
        return [(ln.split()[0], int(ln.split()[4])) for ln in fh if ln.rstrip().endswith(path)]


def test_first_segment_is_the_objects_first_mapping(cache_root):
    entry = stubcache.StubCache().get_or_build(stubcache.StubSpec("seg", 'extern "C" int f(void) { return 1; }'))
    real = os.path.realpath(entry.path)
    fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
    try:
        lib = ctypes.CDLL(real)
        maps = _maps_of(real)
        assert mapped._first_segment(fd, lib._handle) == maps[0][0]
        assert os.stat(f"/proc/self/map_files/{maps[0][0]}").st_ino == os.fstat(fd).st_ino == maps[0][1]
    finally:
        os.close(fd)


def test_a_hit_is_checked_without_reading_proc_maps(cache_root, monkeypatch):
    def no_scan(path):
        raise AssertionError("read /proc/self/maps")

    monkeypatch.setattr(mapped, "_mappings", no_scan)
    cache = stubcache.StubCache()
    entry = cache.get_or_build(stubcache.StubSpec("direct_check", 'extern "C" int f(void) { return 3; }'))
    assert cache.load_entry(entry).f() == 3
    assert os.path.realpath(entry.path) in mapped._checked
