"""Locks and atomic writes (``stubcache.storage.locking``): real processes hold the locks, ``kill -9``
interrupts the writes, and modes are checked under a hostile umask."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stubcache.edge import fsroot
from stubcache.storage import locking
from stubcache.edge.errors import LockTimeoutError

HOLD = textwrap.dedent("""
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH if sys.argv[2] == "sh" else fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.readline()        # released when told
    os.close(fd)
    print("released", flush=True)
    sys.stdin.readline()        # and stays alive until told again
    """)


class Holder:
    """A separate process holding a ``flock`` on ``path`` until told to let go."""

    def __init__(self, path: Path, op: str = "ex") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), op], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "released"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def umask077():
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


PROBE = textwrap.dedent("""
    import os, fcntl, sys
    fd = os.open(sys.argv[1], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("free")
    except BlockingIOError:
        print("held")
    """)


def probe(path) -> str:
    """Whether another process finds ``path`` locked."""
    return subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


def lock_fd(d: Path, name: str = "x.lock", shared: bool = False) -> int:
    with fsroot.Dir(str(d)) as dfd:
        return locking.open_lock_at(dfd, name, shared=shared)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# --- locks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fs", ["tmp", "btrfs"])
def test_a_lock_held_by_another_process_is_seen_named_and_freed_by_its_death(tmp_path, fs, request):
    """On btrfs too, where /proc/locks names the file by the filesystem's device and stat by the
    subvolume's: before, the holder there was always "an unknown process"."""
    if fs == "btrfs":
        tmp_path = request.getfixturevalue("btrfs_dir") / f"locks-{os.getpid()}"
        tmp_path.mkdir()
    path = tmp_path / "x.lock"
    holder = Holder(path)
    fd = lock_fd(tmp_path)
    try:
        assert locking.try_flock(fd) is False
        assert locking.try_flock(fd, locking.SH) is False
        with fsroot.Dir(str(tmp_path)) as dfd:
            assert locking.flock_held_at(dfd, "x.lock") is True
        assert locking.lock_holders(fd) == [holder.proc.pid]
        assert f"pid {holder.proc.pid} (python" in locking.describe_holders(fd)
        holder.close()  # kill -9: the kernel drops its lock
        assert locking.try_flock(fd) is True
        with fsroot.Dir(str(tmp_path)) as dfd:
            assert locking.flock_held_at(dfd, "x.lock") is True  # we hold it now
    finally:
        holder.close()
        os.close(fd)
    with fsroot.Dir(str(tmp_path)) as dfd:
        assert locking.flock_held_at(dfd, "x.lock") is False
        assert locking.flock_held_at(dfd, "missing.lock") is False


def test_shared_holders_admit_shared_lockers_only(tmp_path):
    holder = Holder(tmp_path / "x.lock", "sh")
    fd = lock_fd(tmp_path)
    try:
        assert locking.try_flock(fd, locking.SH) is True
        fd2 = lock_fd(tmp_path)
        try:
            assert locking.try_flock(fd2, locking.EX) is False
        finally:
            os.close(fd2)
    finally:
        holder.close()
        os.close(fd)


def test_the_bounded_wait_gives_up_stops_when_asked_and_takes_a_freed_lock(tmp_path):
    holder = Holder(tmp_path / "x.lock")
    fd = lock_fd(tmp_path)
    try:
        assert locking.wait_flock(fd, locking.EX, 0.2) is False
        asked = []
        t0 = time.monotonic()
        assert locking.wait_flock(fd, locking.EX, 60, until=lambda: asked.append(1) or len(asked) >= 3) is False
        assert len(asked) == 3 and time.monotonic() - t0 < 30  # ended by `until`, not by the time
        noticed = []
        assert locking.wait_flock(fd, locking.EX, 0.3, notice=lambda: noticed.append(1), notice_after=0.0) is False
        assert noticed == [1]  # once, however long the wait
        holder.release()  # alive, but no longer holding
        assert locking.wait_flock(fd, locking.EX, 60) is True
    finally:
        holder.close()
        os.close(fd)


def test_a_timed_out_build_lock_names_its_holder(cache_root):
    from stubcache.storage.store import Store

    store = Store(str(cache_root))
    store.ensure()
    base = "ab" * 16
    holder = Holder(Path(store.lock_path(base)))
    try:
        with pytest.raises(LockTimeoutError, match=f"pid {holder.proc.pid} .*no lease file"):
            locking.acquire(store, base, 0.1, "stub")
        assert locking.acquire(store, base, 60, "stub", published=lambda: True) is None
        with pytest.raises(LockTimeoutError):  # no time to wait: the time is up before anything is asked
            locking.acquire(store, base, 0.0, "stub", published=lambda: True)
        holder.release()
        lock = locking.acquire(store, base, 60, "stub")
        assert lock is not None and lock.fd >= 0
        assert probe(store.lock_path(base)) == "held"
        lock.release()
        assert lock.fd == -1
        lock.release()  # twice is harmless
    finally:
        holder.close()




@pytest.mark.parametrize("fork_safe", [True, False])
def test_a_fork_safe_lock_is_not_kept_by_a_forked_child(tmp_path, fork_safe):
    lock = locking.Lock(lock_fd(tmp_path), fork_safe=fork_safe)
    assert locking.try_flock(lock.fd)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a long-lived worker that never touches the lock
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        lock.release()
        assert probe(tmp_path / "x.lock") == ("free" if fork_safe else "held")
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
    assert not locking._CLOSE_IN_CHILD


# --- lock files ------------------------------------------------------------------------------


def test_lock_files_get_their_mode_whatever_the_umask(tmp_path, umask077):
    os.close(lock_fd(tmp_path, "shared.lock", shared=True))
    os.close(lock_fd(tmp_path, "private.lock", shared=False))
    assert mode(tmp_path / "shared.lock") == 0o660
    assert mode(tmp_path / "private.lock") == 0o600
    os.chmod(tmp_path / "private.lock", 0o600)
    os.close(lock_fd(tmp_path, "private.lock", shared=True))  # a root made shared later
    assert mode(tmp_path / "private.lock") == 0o660


def test_a_planted_link_fifo_or_directory_where_a_lock_file_belongs_is_replaced(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("precious")
    outside.chmod(0o644)
    d = tmp_path / "locks"
    d.mkdir()
    (d / "link.lock").symlink_to(outside)
    os.mkfifo(d / "fifo.lock")
    (d / "dir.lock").mkdir()
    (d / "dir.lock" / "inner").write_text("x")
    for name in ("link.lock", "fifo.lock", "dir.lock"):
        with fsroot.Dir(str(d)) as dfd:
            with pytest.raises(OSError):
                locking.open_lock_at(dfd, name, shared=False, create=False)
        fd = lock_fd(d, name, shared=True)
        try:
            assert stat.S_ISREG(os.fstat(fd).st_mode) and locking.try_flock(fd)
        finally:
            os.close(fd)
        assert stat.S_ISREG(os.lstat(d / name).st_mode)
    assert outside.read_text() == "precious" and mode(outside) == 0o644


# --- atomic writes ---------------------------------------------------------------------------


def test_writes_get_exactly_their_mode_and_leave_no_temporary_file(tmp_path, umask077):
    with fsroot.Dir(str(tmp_path)) as dfd:
        locking.write_file(dfd, "a.json", b"1", mode=0o644)
        locking.write_file(dfd, "a.json", b"22", mode=0o640)
        locking.write_file(dfd, "b", b"x", mode=0o444, exclusive=True)
        with pytest.raises(FileExistsError):
            locking.write_file(dfd, "b", b"y", mode=0o444, exclusive=True)
        fd = locking.open_new(dfd, "c.jsonl", mode=0o640, append=True)
        os.close(fd)
    assert (tmp_path / "a.json").read_bytes() == b"22" and mode(tmp_path / "a.json") == 0o640
    assert (tmp_path / "b").read_bytes() == b"x" and mode(tmp_path / "b") == 0o444
    assert mode(tmp_path / "c.jsonl") == 0o640
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b", "c.jsonl"]


def test_writes_never_follow_a_planted_link(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("precious")
    d = tmp_path / "d"
    d.mkdir()
    (d / "memo.json").symlink_to(outside)
    (d / "manifest.json").symlink_to(outside)
    with fsroot.Dir(str(d)) as dfd:
        locking.write_file(dfd, "memo.json", b"new", mode=0o644)  # replaces the link itself
        with pytest.raises(FileExistsError):
            locking.write_file(dfd, "manifest.json", b"new", mode=0o444, exclusive=True)
        with pytest.raises(ValueError):
            locking.write_file(dfd, "../escape", b"new", mode=0o644)
    assert not (d / "memo.json").is_symlink() and (d / "memo.json").read_bytes() == b"new"
    assert outside.read_text() == "precious"
    assert not (tmp_path / "escape").exists()


def test_temporary_names_carry_the_writer_pid():
    name = locking.temp_name("abc.json")
    assert name.startswith(".abc.json.") and name.endswith(".tmp")
    assert locking.temp_pid(name) == os.getpid()
    assert locking.temp_pid("abc.json") is None
    assert locking.temp_pid(".abc.json.tmp") is None
    assert locking.temp_pid(".x.12345678901.ab.tmp") is None  # no pid has 11 digits


WRITER = textwrap.dedent("""
    import os, sys
    from stubcache.edge import fsroot
    from stubcache.storage import locking
    size = int(sys.argv[2])
    dfd = fsroot.open_dir(sys.argv[1])
    versions = [bytes([65 + i]) * size for i in range(3)]
    i = 0
    while True:
        locking.write_file(dfd, "target", versions[i % 3], mode=0o644, fsync=bool(i % 2))
        if i == 1:  # one replacement done: the loop is running
            print("started", flush=True)
        i += 1
    """)


def test_kill_9_during_atomic_writes_leaves_old_or_new_content_never_a_part(tmp_path):
    size = 4 << 20
    whole = {bytes([65 + i]) * size for i in range(3)}
    (tmp_path / "target").write_bytes(b"A" * size)
    rng = random.Random(1)
    for _ in range(6):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(size)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout.readline().strip() == "started"
            for _ in range(rng.randrange(1, 20)):  # readers during the writes
                data = (tmp_path / "target").read_bytes()
                assert data in whole, f"a reader saw {len(data)} bytes starting {data[:8]!r}"
        finally:
            writer.kill()  # SIGKILL at an arbitrary point of a write
            writer.wait()
        data = (tmp_path / "target").read_bytes()
        assert data in whole, f"after kill -9: {len(data)} bytes starting {data[:8]!r}"
        for name in os.listdir(tmp_path):  # a killed writer may leave its temporary file, named for it
            if name != "target":
                assert locking.temp_pid(name) == writer.pid, name
                os.unlink(tmp_path / name)


# --- the modes that had drifted --------------------------------------------------------------


def shared_root(path: Path) -> Path:
    """A root shared with this user's own primary group (``stubcache init --shared``)."""
    from stubcache.admin.shared import init_root

    init_root(str(path), str(os.getgid()))
    return path


def test_verify_records_its_quarantine_event_with_the_shared_mode(cache_root):
    root = shared_root(cache_root)
    bad = root / "v1" / "entries" / ("cd" * 16)
    bad.mkdir()
    bad.chmod(0o2775)  # an entry without a manifest: verify quarantines it and records that
    proc = subprocess.run([sys.executable, "-m", "stubcache", "verify"], capture_output=True, text=True,
                          env=dict(os.environ, STUBCACHE_DIR=str(root)))
    assert proc.returncode == 1 and "quarantined" in proc.stdout, proc.stdout + proc.stderr
    [events] = list((root / "v1" / "events").glob("*.jsonl"))
    assert json.loads(events.read_text())["ev"] == "quarantine"
    assert mode(events) == 0o640  # readable by every member's `stubcache stats`, like a load's


def test_compaction_keeps_the_shared_modes_whatever_the_umask(cache_root, umask077):
    from stubcache.admin.stats import compact_events

    root = shared_root(cache_root)
    events = root / "v1" / "events"
    for i in range(3):  # finished processes' files (nobody holds their lock)
        (events / f"host-{100 + i}-{i:012x}.jsonl").write_text(json.dumps({"t": 1.0, "ev": "hit", "key": "k"}) + "\n")
    lock = root / "v1" / "locks" / "events-compact.lock"
    assert compact_events(str(events), str(lock), 0o660) == 3
    [archive] = list(events.iterdir())
    assert archive.name.startswith("archive-") and archive.name.endswith(".jsonl")
    assert mode(archive) == 0o640  # like the event files it merges: every member's stats reads it
    assert mode(lock) == 0o660  # every member's prune can take it


def test_a_temporary_lease_file_of_a_live_writer_is_not_stale(cache_root):
    from stubcache.admin.scan import scan_leftovers
    from stubcache.storage.store import Store

    store = Store(str(cache_root))
    store.ensure()
    leases = cache_root / "v1" / "leases"
    live = leases / locking.temp_name(("ef" * 16) + ".json")
    dead = leases / (".x.json.%d.0123abcd.tmp" % 4194304)  # beyond PID_MAX_LIMIT: no such process
    for p in (live, dead):
        p.write_text("{}")
        old = time.time() - 300
        os.utime(p, (old, old))
    got = {lo.name: (lo.pid, lo.stale) for lo in scan_leftovers(store) if lo.kind == "lease"}
    assert got == {live.name: (os.getpid(), False), dead.name: (4194304, True)}
