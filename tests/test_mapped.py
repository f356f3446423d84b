"""The check that what the loader mapped is the verified file (stubcache/storage/mapped.py): the direct
way (the object's first segment through /proc/self/map_files). The full scan of /proc/self/maps,
which decides whenever the direct way cannot, is exercised by
tests/test_dropin.py::test_a_library_swapped_between_check_and_load_is_refused."""

from __future__ import annotations

import ctypes
import os

import stubcache
from stubcache.storage import mapped


def _maps_of(path: str) -> list[tuple[str, int]]:
    with open("/proc/self/maps") as fh:
        return [(ln.split()[0], int(ln.split()[4])) for ln in fh if ln.rstrip().endswith(path)]


def _needs_map_files() -> None:
    """The direct way reads /proc/self/map_files, which needs CAP_CHECKPOINT_RESTORE or
    CAP_SYS_ADMIN: without them (an ordinary user) the full way decides every time
    (tests/test_hit_records.py runs that case)."""
    import pytest

    d = "/proc/self/map_files/"
    try:
        os.stat(d + os.listdir(d)[0])
    except PermissionError:
        pytest.skip("this process may not read /proc/self/map_files (it lacks CAP_CHECKPOINT_RESTORE)")


def test_first_segment_is_the_objects_first_mapping(cache_root):
    _needs_map_files()
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
    _needs_map_files()
    def no_scan(path, fd=None):
        raise AssertionError("read /proc/self/maps")

    monkeypatch.setattr(mapped, "_mappings", no_scan)
    cache = stubcache.StubCache()
    entry = cache.get_or_build(stubcache.StubSpec("direct_check", 'extern "C" int f(void) { return 3; }'))
    assert cache.load_entry(entry).f() == 3
    assert os.path.realpath(entry.path) in mapped._checked


def test_a_verified_file_with_an_unreadable_elf_header_goes_the_full_way(cache_root, tmp_path):
    """Whatever the verified file's ELF header says (here a program header table at an offset
    past 2**63, which ``pread`` cannot even take), the direct way only gives up: the full scan
    of /proc/self/maps decides, and refuses a mapped file that is not the verified one."""
    import hashlib
    import struct

    import pytest

    entry = stubcache.StubCache().get_or_build(stubcache.StubSpec("odd_elf", 'extern "C" int f(void) { return 4; }'))
    real = os.path.realpath(entry.path)
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"  # ELF64, little-endian
    struct.pack_into("<Q", head, 32, (1 << 63) + 64)  # e_phoff
    struct.pack_into("<HH", head, 54, 56, 1)  # e_phentsize, e_phnum
    odd = tmp_path / "odd.so"
    odd.write_bytes(bytes(head))
    fd = os.open(odd, os.O_RDONLY | os.O_CLOEXEC)
    try:
        lib = ctypes.CDLL(real)
        with pytest.raises(stubcache.IntegrityError, match="not the verified file"):
            mapped.check_mapped(real, os.fstat(fd), hashlib.sha256(bytes(head)).hexdigest(), lib._handle, fd)
    finally:
        os.close(fd)


def test_a_mismatch_of_the_first_segment_goes_the_full_way(cache_root, tmp_path, monkeypatch):
    """The direct way never refuses on its own: when the object's first mapping is not the
    verified descriptor's file (here a byte-identical copy stands for it, as overlayfs reports
    another inode), /proc/self/maps is read and the mapped bytes are compared with the checksum."""
    _needs_map_files()
    import hashlib
    import shutil

    entry = stubcache.StubCache().get_or_build(stubcache.StubSpec("copy_seg", 'extern "C" int f(void) { return 5; }'))
    real = os.path.realpath(entry.path)
    copy = tmp_path / "copy.so"
    shutil.copyfile(real, copy)
    scans = []
    full = mapped._mappings
    monkeypatch.setattr(mapped, "_mappings", lambda path, fd=None: scans.append(path) or full(path, fd))
    fd = os.open(copy, os.O_RDONLY | os.O_CLOEXEC)
    try:
        lib = ctypes.CDLL(real)
        mapped.check_mapped(real, os.fstat(fd), hashlib.sha256(copy.read_bytes()).hexdigest(), lib._handle, fd)
    finally:
        os.close(fd)
    assert scans == [real, real] and real in mapped._checked  # (again with the pair the copy shows)
