"""The check that what the loader mapped is the verified file (stubcache/storage/mapped.py): the direct
way (the object's first segment through /proc/self/map_files). The full scan of /proc/self/maps,
which decides whenever the direct way cannot, is exercised by
tests/test_dropin.py::test_a_library_swapped_between_check_and_load_is_refused."""

from __future__ import annotations

import ctypes
import os

import stubcache
from stubcache import hit
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

    monkeypatch.setattr(hit, "mappings", no_scan)
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
    full = hit.mappings
    monkeypatch.setattr(hit, "mappings", lambda path, fd=None: scans.append(path) or full(path, fd))
    fd = os.open(copy, os.O_RDONLY | os.O_CLOEXEC)
    try:
        lib = ctypes.CDLL(real)
        mapped.check_mapped(real, os.fstat(fd), hashlib.sha256(copy.read_bytes()).hexdigest(), lib._handle, fd)
    finally:
        os.close(fd)
    assert scans == [real, real] and real in mapped._checked  # (again with the pair the copy shows)


def _swap_in(cache, entry, other_root):
    """Another build's library put at ``entry``'s path after the check, before the dlopen; the
    original kept beside it as ``.orig``."""
    other = stubcache.StubCache(other_root).get_or_build(
        stubcache.StubSpec("swapback", 'extern "C" int f(void) { return 2; }'))
    cache._lib_fds[entry.path] = cache._open_checked(entry)  # what load_entry verifies first
    os.chmod(os.path.dirname(entry.path), 0o700)
    os.rename(entry.path, entry.path + ".orig")
    os.rename(other.path, entry.path)


def test_a_library_swapped_back_between_the_two_reads_of_maps_is_refused(cache_root, tmp_path, monkeypatch):
    """On a mismatch /proc/self/maps is read again with a mapping of the verified descriptor
    (the pair it shows: btrfs, overlayfs). That mapping names the library's path too: it must not
    count as the loader's. Here the swapped-in file is renamed away and the original put back
    between the two reads, so that only the check's own mapping still names the path; before,
    that passed and the other build was loaded (found by review, with a real race as well)."""
    import pytest

    cache = stubcache.StubCache()
    entry = cache.get_or_build(stubcache.StubSpec("swapback", 'extern "C" int f(void) { return 1; }'))
    _swap_in(cache, entry, tmp_path / "other")
    full = hit.mappings

    def swap_back(path, fd=None):
        if fd is not None:
            os.rename(entry.path, entry.path + ".other")
            os.rename(entry.path + ".orig", entry.path)
        return full(path, fd)

    monkeypatch.setattr(hit, "mappings", swap_back)
    with pytest.raises(stubcache.IntegrityError, match="does not appear"):
        cache.load_entry(entry)


def test_a_same_numbered_library_of_another_btrfs_subvolume_is_refused_where_map_files_reads(
        cache_root, btrfs_dir, tmp_path, monkeypatch):
    """btrfs numbers inodes per subvolume and /proc/self/maps shows the filesystem's device: a
    library of another subvolume with the verified file's inode number shows the same pair. A
    process that may read /proc/self/map_files (root here) checksums the mapped bytes before it
    would compare pairs, so such a swap is refused. (Without that capability the pair is all
    there is: docs/cache.md, "Integrity".)"""
    import shutil
    import subprocess

    import pytest

    _needs_map_files()
    if not shutil.which("btrfs"):
        pytest.skip("needs the btrfs tool (btrfs-progs)")
    base = btrfs_dir / tmp_path.name
    base.mkdir()
    monkeypatch.setenv("STUBCACHE_DIR", str(base / "a"))
    cache = stubcache.StubCache()
    entry = cache.get_or_build(stubcache.StubSpec("subvol", 'extern "C" int f(void) { return 1; }'))
    other = stubcache.StubCache(base / "b").get_or_build(
        stubcache.StubSpec("subvol", 'extern "C" int f(void) { return 2; }'))
    fd = cache._open_checked(entry)
    cache._lib_fds[entry.path] = fd
    want = os.fstat(fd).st_ino
    edir, lib = os.path.dirname(entry.path), os.path.basename(entry.path)
    planted = edir + ".planted"
    subprocess.run(["btrfs", "-q", "subvolume", "create", planted], check=True, capture_output=True)
    pads = []
    while True:  # fill the new subvolume until its next inode number is the library's
        pad = os.path.join(planted, f"pad{len(pads)}")
        open(pad, "w").close()
        pads.append(pad)
        ino = os.stat(pad).st_ino
        if ino == want - 1:
            break
        if ino >= want:
            pytest.skip("this btrfs numbered the new subvolume past the library's inode")
    shutil.copyfile(other.path, os.path.join(planted, lib))
    assert os.stat(os.path.join(planted, lib)).st_ino == want
    for pad in pads:
        os.unlink(pad)
    shutil.copyfile(os.path.join(edir, "manifest.json"), os.path.join(planted, "manifest.json"))
    os.chmod(planted, 0o700)
    os.rename(edir, edir + ".old")
    os.rename(planted, edir)  # after the check, before the dlopen
    with pytest.raises(stubcache.IntegrityError, match="not the verified file"):
        cache.load_entry(entry)
