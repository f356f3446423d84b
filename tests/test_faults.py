"""Fault injection, for real: kill -9 at chosen moments, a lock held past the timeout, a full
disk, corrupted entries, bad input."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import stubcache
from stubcache import StubCache, StubSpec
from stubcache.storage.store import Store, file_sha256

from .conftest import run_py, wait_until

IS_ROOT = os.geteuid() == 0


def src(n: int) -> str:
    return f'extern "C" int value(void) {{ return {n}; }}\n'


LOAD = """
import os, stubcache
print(stubcache.StubCache().load(stubcache.StubSpec(os.environ.get("NAME", "fault"), os.environ["SRC"])).value())
"""


def entries(root: Path) -> list[Path]:
    d = root / "v1" / "entries"
    return sorted(d.iterdir()) if d.exists() else []


def assert_store_sound(root: Path) -> None:
    """Every published entry is whole and matches its manifest."""
    store = Store(str(root))
    for e in entries(root):
        m = store.read_manifest(e.name)
        assert sorted(os.listdir(e)) == sorted(["manifest.json", m.library]), e
        assert file_sha256(str(e / m.library)) == m.sha256, e


def count_events(root: Path, ev: str) -> int:
    n = 0
    for f in (root / "v1" / "events").glob("*.jsonl"):
        n += sum(1 for line in f.read_text().splitlines() if line and json.loads(line)["ev"] == ev)
    return n


@pytest.mark.parametrize("point", ["after_build", "before_publish", "after_publish"])
def test_kill_at_each_build_step_leaves_no_garbage(cache_root, cxx, point):
    proc = run_py(LOAD, env={"SRC": src(1), "STUBCACHE_FAULT": point}, check=False)
    assert proc.returncode == -signal.SIGKILL
    assert_store_sound(cache_root)
    published = len(entries(cache_root))
    assert published == (1 if point == "after_publish" else 0)
    # The next process is not blocked (the kernel dropped the lock) and builds at most once.
    t0 = time.monotonic()
    proc = run_py(LOAD, env={"SRC": src(1), "STUBCACHE_LOCK_TIMEOUT": "20"})
    assert proc.stdout.strip() == "1" and "timed out" not in proc.stderr
    assert time.monotonic() - t0 < 20
    assert cxx.compiles() == (1 if point == "after_publish" else 2)
    assert len(entries(cache_root)) == 1
    assert_store_sound(cache_root)


def test_kill_at_random_moments_in_a_loop(cache_root, cxx):
    rng = random.Random(1234)
    for i in range(12):
        p = subprocess.Popen([sys.executable, "-c", LOAD], env=dict(os.environ, SRC=src(i % 3), NAME="loop",
                             STUBCACHE_TEST_CXX_SLEEP=str(rng.choice([0, 0, 0.1, 0.3]))),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(rng.uniform(0.0, 0.6))  # not a synchronisation: the kill moment under test
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        assert_store_sound(cache_root)
    cxx.reset()
    for n in range(3):
        proc = run_py(LOAD, env={"SRC": src(n), "NAME": "loop", "STUBCACHE_LOCK_TIMEOUT": "20"})
        assert proc.stdout.strip() == str(n) and "timed out" not in proc.stderr
    assert cxx.compiles() <= 3  # each key built at most once more
    assert len(entries(cache_root)) == 3
    assert_store_sound(cache_root)


def test_lock_held_past_the_timeout_builds_privately(cache_root, cxx, tmp_path):
    mark = tmp_path / "compiling"
    holder = subprocess.Popen([sys.executable, "-c", LOAD], start_new_session=True,
                              env=dict(os.environ, SRC=src(4), NAME="held", STUBCACHE_TEST_CXX_SLEEP="30",
                                       STUBCACHE_TEST_CXX_MARK=str(mark)))
    try:
        wait_until(mark.exists, "the holder to start compiling", proc=holder)
        code = """
        import os, stubcache
        e = stubcache.StubCache().get_or_build(stubcache.StubSpec("held", os.environ["SRC"]))
        print(stubcache.StubCache().load_entry(e).value(), e.published, e.path.startswith(os.environ["STUBCACHE_DIR"]))
        """
        t0 = time.monotonic()
        proc = run_py(code, env={"SRC": src(4), "STUBCACHE_LOCK_TIMEOUT": "1"})
        assert time.monotonic() - t0 < 25
        assert proc.stdout.split() == ["4", "False", "False"]
        assert "timed out" in proc.stderr and "building privately" in proc.stderr
        assert f"pid {holder.pid}" in proc.stderr  # says who holds the build
        assert entries(cache_root) == []
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


@pytest.mark.skipif(not IS_ROOT, reason="needs root to mount a small tmpfs")
def test_disk_full_degrades_then_recovers(tmp_path, monkeypatch, cxx):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        root = mnt / "cache"
        monkeypatch.setenv("STUBCACHE_DIR", str(root))
        Store(str(root)).ensure()
        outcomes = []
        for leave_kib in (0, 4, 12, 20, 28, 40, 64):
            filler = mnt / "filler"
            if filler.exists():
                filler.unlink()
            # Fill the filesystem, then free exactly leave_kib.
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError:
                pass
            finally:
                os.close(fd)
            with open(filler, "r+b") as fh:
                fh.truncate(max(0, filler.stat().st_size - leave_kib * 1024))
            proc = run_py(LOAD, env={"SRC": src(leave_kib), "NAME": f"full{leave_kib}"}, check=False)
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip() == str(leave_kib)
            outcomes.append("private" if "building privately" in proc.stderr else "published")
            assert "Traceback" not in proc.stderr
            assert_store_sound(root)
            assert os.listdir(root / "v1" / "staging") == []
        assert outcomes[0] == "private" and "published" in outcomes, outcomes
        assert len(entries(root)) == outcomes.count("published")
        filler.unlink()
        proc = run_py(LOAD, env={"SRC": src(99), "NAME": "roomy"})
        assert proc.stdout.strip() == "99" and "building privately" not in proc.stderr
        assert any(e.name for e in entries(root))
        assert_store_sound(root)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _corrupt(entry: Path, how: str) -> None:
    entry.chmod(0o755)
    lib = next(p for p in entry.iterdir() if p.suffix == ".so")
    man = entry / "manifest.json"
    for p in (lib, man):
        p.chmod(0o644)
    if how == "truncated":
        lib.write_bytes(lib.read_bytes()[:1000])
    elif how == "flipped":
        data = bytearray(lib.read_bytes())
        data[len(data) // 2] ^= 0x01
        lib.write_bytes(bytes(data))
    elif how == "manifest_missing":
        man.unlink()
    elif how == "manifest_unparsable":
        man.write_text("{not json")
    elif how == "extra_file":
        (entry / "extra.txt").write_text("x")
    elif how == "library_missing":
        lib.unlink()


@pytest.mark.parametrize("how", ["truncated", "flipped", "manifest_missing", "manifest_unparsable",
                                 "extra_file", "library_missing"])
def test_corrupted_entries_are_quarantined_rebuilt_and_counted(cache_root, cxx, how):
    assert run_py(LOAD, env={"SRC": src(7)}).stdout.strip() == "7"
    [entry] = entries(cache_root)
    _corrupt(entry, how)
    proc = run_py(LOAD, env={"SRC": src(7)})
    assert proc.stdout.strip() == "7"
    assert "quarantined" in proc.stderr
    assert cxx.compiles() == 2
    assert len(os.listdir(cache_root / "v1" / "quarantine")) == 1
    assert count_events(cache_root, "quarantine") == 1
    assert_store_sound(cache_root)


def test_bad_input_is_rejected_before_touching_disk(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("STUBCACHE_DIR", str(root))
    outside_before = sorted(os.listdir(tmp_path))
    for bad in ["a/b", "../../evil", "x\x00y", "with space", "ünï", "n" * 300, ""]:
        with pytest.raises(ValueError):
            stubcache.load_inline(bad, src(1), is_python_module=False, no_implicit_headers=True)
    with pytest.raises(TypeError):
        stubcache.load_inline("ok", b"\xff\xfe", is_python_module=False)
    with pytest.raises(TypeError):
        stubcache.load_inline("ok", src(1), extra_cflags="-O2")
    with pytest.raises(TypeError):
        stubcache.load_inline("ok", src(1), bogus_option=True)
    with pytest.raises(ValueError):
        stubcache.load_inline("ok", src(1), sycl_sources="x")
    with pytest.raises(TypeError):
        StubCache().get_or_build({"name": "dict"})
    assert sorted(os.listdir(tmp_path)) == outside_before
    assert not root.exists() or not any((root / "v1" / "entries").iterdir())


def test_empty_and_huge_sources(cache_root, cxx):
    assert stubcache.load_inline("empty", "", is_python_module=False, no_implicit_headers=True).endswith(".so")
    big = "// " + "x" * 100 + "\n"
    huge = big * (10 * 1024 * 1024 // len(big)) + src(5)
    path = stubcache.load_inline("huge", huge, is_python_module=False, no_implicit_headers=True)
    import ctypes

    assert ctypes.CDLL(path).value() == 5
    assert all(str(p).startswith(str(cache_root)) for p in [Path(path)])


def test_lost_variant_marker_recovers(cache_root, cxx, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 8\n")
    spec = lambda: StubSpec("marker", '#include "v.h"\nextern "C" int value(void) { return V; }\n',
                            extra_include_paths=[str(inc)])
    e1 = StubCache().get_or_build(spec())
    for marker_dir in (cache_root / "v1" / "variants").iterdir():  # as if the marker was never written
        shutil.rmtree(marker_dir)
    cache = StubCache()
    e2 = cache.get_or_build(spec())
    assert e2.key == e1.key and cache.load_entry(e2).value() == 8
    assert StubCache().get_or_build(spec()).key == e1.key
