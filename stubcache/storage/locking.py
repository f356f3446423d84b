"""Locks and atomic writes: every ``flock`` and every write-then-``rename`` in stubcache, one way.

**Locks** are kernel ``flock``\\ s on small files under the root: the kernel drops a lock when its
holder dies, so a crash never leaves a lock behind. One lock-file opener (:func:`open_lock_at`:
through a directory fd, ``O_NOFOLLOW``, regular files only, ``0660`` in a shared root whatever the
umask), one non-blocking attempt (:func:`try_flock`), one bounded wait (:func:`wait_flock`; no
wait in stubcache is unbounded: a stopped holder or a hostile group member costs at most the
bound), one probe (:func:`flock_held_at`) and one way to name a holder (:func:`describe_holders`,
from ``/proc/locks``). :func:`acquire` is the per-key build lock built from them.

The per-key build lock is waited for through ``filelock`` (the ecosystem's lock library; torch >= 2.14
takes its own JIT lock with it): :func:`try_build_lock` is ``filelock.lock_descriptor`` on a
descriptor this module opened safely, one non-blocking attempt at a time inside the same bounded
wait. A free lock (a lone miss) is taken with one raw attempt on the same descriptor, and filelock
is imported only when there is a holder to wait for (~4-12 ms in an engine, ~17-60 ms in a bare
process: a large part of a cold build's own cost); the hit path's shared pin and the admin
commands' probes stay raw ``fcntl.flock`` calls on the same kernel lock (filelock has no shared
lock on a descriptor). docs/cache.md, "Locks and atomic writes", has the measurements.

**Atomic writes** go through :func:`write_file`: a new file is created with ``O_EXCL|O_NOFOLLOW``
(never an existing file or a planted link), given exactly the mode asked for with ``fchmod``
(whatever the umask), optionally ``fsync``-ed, and then renamed over the target, so a reader (or a
``kill -9`` of the writer) sees the old content or the new, never a part.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

from ..edge import fsroot
from ..hit import temp_name as hit_temp_name
from ..edge.errors import LockTimeoutError

TYPE_CHECKING = False  # not typing's: the hit path imports this module, and typing costs milliseconds
if TYPE_CHECKING:
    from typing import Callable

    from .store import Store

EX = fcntl.LOCK_EX
SH = fcntl.LOCK_SH

DEFAULT_LOCK_TIMEOUT = 600.0
NOTICE_AFTER = 5.0


def lock_timeout_from_env() -> float:
    """``STUBCACHE_LOCK_TIMEOUT`` in seconds (default 600); a bad value raises
    :class:`~stubcache.edge.settings.SettingsError` (a ``ValueError``)."""
    from ..edge.settings import lock_timeout

    return lock_timeout()


# --- lock files ------------------------------------------------------------------------------


def open_lock_at(dir_fd: int, name: str, *, shared: bool, create: bool = True, label: str | None = None) -> int:
    """Open (creating) the lock file ``name`` in the directory open as ``dir_fd``; returns the fd.

    A lock file is only ever ``flock``-ed: mode ``0600``, or ``0660`` in a ``shared`` root (set with
    ``fchmod`` whatever the umask, on a file this uid owns with no other hard link) so every member
    can lock it. Opened non-blocking without following a link; a user who may not write it gets a
    read-only fd (``flock`` works on it). With ``create``, a link, directory, socket, FIFO or device
    planted where the lock file belongs is removed (the link itself, never its target) and the
    file made afresh; without, it raises :class:`fsroot.NotRegularFile`. ``label`` names the file
    in errors."""
    fsroot.check_name(name)
    label = label or name
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    for attempt in (0, 1):
        try:
            fd = os.open(name, flags, 0o660 if shared else 0o600, dir_fd=dir_fd)
        except PermissionError:
            if not create:
                raise
            fd = os.open(name, flags & ~os.O_RDWR & ~os.O_CREAT | os.O_RDONLY, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO) or not create or attempt:
                raise
            # A planted link, directory or socket where a lock file belongs: it goes (the link
            # itself, never its target; a tree without following anything).
            fsroot.rmtree_at(dir_fd, name)
            continue
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if shared and stat.S_IMODE(st.st_mode) != 0o660 and fsroot.own_single(st):
                try:
                    os.fchmod(fd, 0o660)  # whatever the umask: every member must be able to lock it
                except OSError:
                    pass
            return fd
        os.close(fd)
        if not create or attempt:
            raise fsroot.NotRegularFile(errno.EINVAL, f"is a {fsroot.kind(st.st_mode)}, not a lock file", label)
        # A FIFO or device where a lock file belongs locks nothing anyone else respects: replace
        # it (unlinking never follows, and a real lock file is never removed here).
        fsroot.unlink_at(dir_fd, name)
    raise fsroot.NotRegularFile(errno.EINVAL, "not a lock file", label)


# --- taking locks ----------------------------------------------------------------------------


def try_flock(fd: int, op: int = EX) -> bool:
    """``flock(fd, op | LOCK_NB)`` (``op`` is :data:`EX` or :data:`SH`): True if taken, False if
    another open file holds a conflicting lock. Never waits."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def load_build_lock() -> None:
    """Import what :func:`try_build_lock` uses (filelock) now: once a build lock is found held,
    before its bounded wait starts."""
    import filelock  # noqa: F401


def try_build_lock(fd: int) -> bool:
    """One non-blocking attempt at the exclusive build lock on ``fd`` through filelock's
    descriptor API (the same kernel ``flock`` as :func:`try_flock`, so admin commands that probe
    it raw see it): True if taken, False if another open file holds it."""
    import filelock  # the miss path only: its import costs a hit nothing

    return filelock.lock_descriptor(fd, blocking=False)


def wait_flock(fd: int, op: int, timeout: float, *, max_delay: float = 0.05,
               until: Callable[[], bool] | None = None, notice: Callable[[], None] | None = None,
               notice_after: float = NOTICE_AFTER,
               attempt: Callable[[int], bool] | None = None) -> bool:
    """Take ``flock(fd, op)``, waiting at most ``timeout`` seconds: True if taken, False if not
    (the time is up, or ``until`` ended the wait). The lock is tried without blocking, then again
    after 2 ms, 3 ms... up to ``max_delay`` between attempts (a blocking ``flock`` could not be
    bounded).

    ``until``, if given, is a cheap check made before each new attempt: when it returns True the
    wait ends (False). ``notice``, if given, is called once after
    ``notice_after`` seconds of waiting (to say who holds the lock). ``attempt``, if given, makes
    each non-blocking attempt instead of ``try_flock(fd, op)`` (the build lock's
    :func:`try_build_lock`)."""
    if attempt is None:
        def attempt(fd: int) -> bool:
            return try_flock(fd, op)
    if attempt(fd):
        return True
    start = time.monotonic()
    deadline = start + timeout
    notice_at = start + notice_after if notice is not None else None
    delay = 0.002
    while True:
        now = time.monotonic()
        if now >= deadline:
            return False
        if notice_at is not None and now >= notice_at:
            notice_at = None
            notice()  # type: ignore[misc]
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 1.5, max_delay)
        if until is not None and until():
            return False
        if attempt(fd):
            return True


def flock_held_at(dir_fd: int, name: str) -> bool:
    """True if some process holds a ``flock`` (shared or exclusive) on the regular file ``name``
    (probed with a non-blocking exclusive lock, released at once). Missing or not a regular file:
    False."""
    try:
        fd = fsroot.open_regular(dir_fd, name)
    except (OSError, ValueError):
        return False
    try:
        return not try_flock(fd, EX)
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the probe's lock


class Lock:
    """An open lock file: ``fd`` (``-1`` once released). :meth:`release` (or leaving a ``with``
    block) closes it, which drops the ``flock`` if this was the only open copy.

    ``fork_safe``: a child made by ``fork`` closes its inherited copy at once. A lock is held
    until every copy of its open file is closed, so a long-lived forked worker (a DataLoader, a
    ``multiprocessing`` "fork" pool started while a helper thread held the lock) would otherwise
    keep it for its whole life.

    ``contended``: another process held the lock when it was first asked for (the holder's
    build is what this process waited for; time spent getting an uncontended lock is no wait)."""

    __slots__ = ("fd", "contended")

    def __init__(self, fd: int, *, fork_safe: bool = False, contended: bool = False) -> None:
        self.fd = fd
        self.contended = contended
        if fork_safe:
            _CLOSE_IN_CHILD.add(fd)

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _CLOSE_IN_CHILD.discard(fd)  # before the close: the number may be reused at once
            os.close(fd)

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


_CLOSE_IN_CHILD: set[int] = set()


def _close_inherited() -> None:
    for fd in list(_CLOSE_IN_CHILD):
        try:
            os.close(fd)
        except OSError:
            pass
    _CLOSE_IN_CHILD.clear()


os.register_at_fork(after_in_child=_close_inherited)


# --- who holds a lock ------------------------------------------------------------------------


def lock_holders(fd: int) -> list[int]:
    """pids holding a ``flock`` on the file open as ``fd``, from ``/proc/locks`` (Linux; empty
    where unknown). For messages only: a pid may be in another pid namespace or reused."""
    try:
        st = os.fstat(fd)
        data = _read_proc("/proc/locks", 8 << 20)
    except (OSError, ValueError):
        return []
    # /proc/locks names a file by its filesystem's device, which is not always the one stat
    # reports (btrfs reports each subvolume's own; an overlay's upper files, the upper layer's).
    devs = {st.st_dev, _superblock_dev(fd)}
    want = {f"{os.major(dev):02x}:{os.minor(dev):02x}:{st.st_ino}" for dev in devs if dev is not None}
    pids = []
    for line in data.decode("ascii", "replace").splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; "1: -> FLOCK ..." lines are waiters
        if len(parts) >= 8 and parts[1] == "FLOCK" and parts[5] in want and parts[4].isdigit():
            pids.append(int(parts[4]))
    return sorted(set(pids))


def _superblock_dev(fd: int) -> int | None:
    """The device of the filesystem the file open as ``fd`` is on, as the kernel names it in
    /proc/locks (its mount's ``major:minor`` in /proc/self/mountinfo, found by the descriptor's
    ``mnt_id``); None where that cannot be read."""
    try:
        info = _read_proc(f"/proc/self/fdinfo/{fd}", 1 << 16)
        mnt = next((line.split()[1] for line in info.splitlines() if line.startswith(b"mnt_id:")), None)
        if mnt is None:
            return None
        for line in _read_proc("/proc/self/mountinfo", 8 << 20).splitlines():
            parts = line.split(None, 3)  # "36 35 0:42 / /mnt ...": mount id, parent id, major:minor
            if len(parts) >= 3 and parts[0] == mnt:
                major, minor = parts[2].split(b":")
                return os.makedev(int(major), int(minor))
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_proc(path: str, cap: int) -> bytes:
    """A ``/proc`` file read front to back in large reads. Its size reads 0 and it is made as it
    is read: reads at offsets of one byte each (what a regular file's bounded read does with a
    size of 0) see the locks of many moments, and a busy host's lines come out spliced."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise ValueError(f"{path} is over {cap} bytes")
    finally:
        os.close(fd)


def describe_holders(fd: int) -> str:
    """``pid 123 (python3)``-style text naming who holds a lock on ``fd``, or a generic phrase."""
    pids = lock_holders(fd)
    if not pids:
        return "an unknown process"
    out = []
    for pid in pids[:3]:
        try:
            comm = _read_proc(f"/proc/{pid}/comm", 4096).decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            comm = "?"
        out.append(f"pid {pid} ({fsroot.printable(comm, 32)})")
    return ", ".join(out)


# --- atomic writes ---------------------------------------------------------------------------


def open_new(dir_fd: int, name: str, *, mode: int, append: bool = False) -> int:
    """Create ``name`` for writing (never an existing file, never through a link) with exactly
    ``mode`` (``fchmod``-ed: the umask does not narrow it); returns the fd."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    fd = os.open(fsroot.check_name(name), flags, mode, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def temp_name(name: str) -> str:
    """The name :func:`write_file` gives the temporary file it renames to ``name``:
    ``.<name>.<pid>.<random>.tmp`` (hidden, and its writer's pid for :func:`temp_pid`)."""
    return hit_temp_name(fsroot.check_name(name))


def temp_pid(name: str) -> int | None:
    """The writer's pid in a name made by :func:`temp_name`, or None."""
    parts = name.rsplit(".", 3)
    if len(parts) == 4 and parts[3] == "tmp" and parts[1].isdigit() and len(parts[1]) <= 9:
        return int(parts[1])
    return None


def write_file(dir_fd: int, name: str, data: bytes | memoryview, *, mode: int, exclusive: bool = False,
               fsync: bool = False) -> None:
    """Write ``data`` to ``name`` in the directory open as ``dir_fd``, with exactly ``mode``.

    By default atomically: a temporary file (:func:`temp_name`) is written and renamed over
    ``name``, so a reader or a crash sees the old content or the new one, never a part. A link
    at ``name`` is replaced, never followed.

    ``exclusive``: create ``name`` itself, failing with ``FileExistsError`` if anything (a file,
    a link) is there. Not atomic for readers: for a file nobody reads before a later ``rename``
    publishes its directory (a staged entry), or whose partial content is harmless.

    ``fsync``: flush the data to disk before the rename (for a file whose sources are deleted
    next, such as an events archive); without it a power loss may leave an empty file."""
    target = fsroot.check_name(name) if exclusive else temp_name(name)
    fd = open_new(dir_fd, target, mode=mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if not exclusive:
            os.rename(target, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        fsroot.unlink_at(dir_fd, target)
        raise


# --- the per-key build lock ------------------------------------------------------------------


def describe_holder(store: "Store", base: str, fd: int | None = None) -> str:
    """Who holds the build of ``base``: its lease file (written by the holder; every value is
    checked and escaped, as a group member may have written it), else ``/proc/locks``."""
    from ..edge.fsroot import printable
    from ..edge.values import finite

    lease = store.read_lease(base)
    if not lease:
        who = describe_holders(fd) if fd is not None else "an unknown process"
        return f"{who} (no lease file)"
    started = finite(lease.get("started"), 0.0, time.time() + 1.0)
    age = f", building for {time.time() - started:.0f}s" if started is not None else ""
    pid = lease.get("pid") if isinstance(lease.get("pid"), int) and not isinstance(lease.get("pid"), bool) else "?"
    return (f"pid {pid} on {printable(lease.get('host'), 64)} "
            f"({printable(lease.get('name'), 64)}{age})")


def acquire(store: "Store", base: str, timeout: float, name: str,
            published: Callable[[], bool] | None = None) -> Lock | None:
    """Acquire the build lock of ``base`` (``locks/<base>.lock``); returns a held :class:`Lock`.
    Invariants 1, 4 and 11 of docs/design.md rest on it.

    An exclusive ``flock`` on that file: taken at once if free (one raw :func:`try_flock`), else
    through filelock (:func:`try_build_lock`), waited for at most ``timeout`` seconds with
    :func:`wait_flock`, re-tried every 2-10 ms. Logs once,
    after a few seconds, which process holds the build; raises :class:`LockTimeoutError` after
    ``timeout``.

    ``published``, if given, is a cheap check (one ``stat``) called between attempts; when it
    returns True the wait ends and ``None`` is returned: the holder has published, so the caller
    can look the entry up without taking the lock (otherwise a herd's waiters would queue on the
    lock one by one just to find the entry there).
    """
    from ..edge import log

    store.ensure()
    fd = store.open_lock_file(store.lock_path(base))
    try:
        def notice() -> None:
            # On a terminal, or with verbose=True, a person is watching; an engine's ranks with
            # stderr in a log file stay as silent as torch's waiting ranks (the logger has it).
            from ..edge import progress

            say = log.warning if progress.verbose() or progress.stderr_is_terminal() else log.info
            say("stubcache: waiting for %s to finish building %r (key %s)", describe_holder(store, base, fd), name, base)

        seen_published: list[bool] = []

        def until() -> bool:
            if published is not None and published():
                seen_published.append(True)
                return True
            return False

        # A lone miss (the usual one): one raw non-blocking attempt, the very kernel lock filelock
        # takes; filelock (~4-12 ms of imports in an engine process, tens in a bare one: a large
        # part of a cold build's own cost) only once there is a holder to wait for.
        if try_flock(fd, EX):
            return Lock(fd)
        load_build_lock()
        if wait_flock(fd, EX, timeout, max_delay=0.01, until=until if published is not None else None,
                      notice=notice, attempt=try_build_lock):
            return Lock(fd, contended=True)
        if not seen_published:  # the time is up (not the entry published)
            raise LockTimeoutError(
                f"timed out after {timeout:.0f}s waiting for the build of {name!r} (key {base}) held "
                f"by {describe_holder(store, base, fd)}; raise STUBCACHE_LOCK_TIMEOUT if builds are slow")
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)  # published: no lock needed
    return None
