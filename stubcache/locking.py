"""The per-key build lock: a kernel ``flock`` through ``filelock``, bounded waiting, and a lease
file that tells waiters who holds the build."""

from __future__ import annotations

import os
import time

from . import _log
from .errors import LockTimeoutError
from .store import Store


DEFAULT_LOCK_TIMEOUT = 600.0
NOTICE_AFTER = 5.0


def lock_timeout_from_env() -> float:
    """``STUBCACHE_LOCK_TIMEOUT`` in seconds (default 600); a bad value is an error."""
    raw = os.environ.get("STUBCACHE_LOCK_TIMEOUT")
    if raw is None or raw == "":
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"STUBCACHE_LOCK_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"STUBCACHE_LOCK_TIMEOUT must be >= 0, got {raw!r}")
    return value


def describe_holder(store: Store, base: str) -> str:
    lease = store.read_lease(base)
    if not lease:
        return "an unknown process (no lease file)"
    started = lease.get("started")
    age = f", building for {time.time() - started:.0f}s" if isinstance(started, (int, float)) else ""
    return f"pid {lease.get('pid')} on {lease.get('host')} ({lease.get('name')}{age})"


class _HeldFlock:
    """An uncontended build lock taken with one ``flock`` call (the same kernel lock that
    filelock takes on the same file): saves importing filelock (~14 ms) on every cold build."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only fd drops the flock
            self.fd = -1


def _try_uncontended(store: Store, base: str):
    import errno
    import fcntl

    fd = os.open(store.lock_path(base), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 store.mode(0o600, 0o660))
    try:
        if store.shared:
            try:
                os.fchmod(fd, 0o660)
            except OSError:
                pass  # another member's file: already 0660
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return _HeldFlock(fd)


def acquire(store: Store, base: str, timeout: float, name: str):
    """Acquire the build lock of ``base``; returns an object with ``release()``.

    An uncontended lock is one non-blocking ``flock``; when another process holds it, the bounded
    wait goes through ``filelock.FileLock`` on the same file. Logs once, after a few seconds,
    which process holds the build. Raises :class:`LockTimeoutError` after ``timeout`` seconds.
    """
    store.ensure()
    held = _try_uncontended(store, base)
    if held is not None:
        return held
    import filelock

    lock = filelock.FileLock(store.lock_path(base), mode=store.mode(0o600, 0o660), thread_local=False)
    deadline = time.monotonic() + timeout
    first = min(NOTICE_AFTER, timeout)
    try:
        lock.acquire(timeout=first, poll_interval=0.02)
        return lock
    except filelock.Timeout:
        pass
    holder = describe_holder(store, base)
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise LockTimeoutError(f"timed out after {timeout:.0f}s waiting for the build of {name!r} "
                               f"(key {base}) held by {holder}; raise STUBCACHE_LOCK_TIMEOUT if builds are slow")
    _log.warning("stubcache: waiting for %s to finish building %r (key %s)", holder, name, base)
    try:
        lock.acquire(timeout=remaining, poll_interval=0.05)
    except filelock.Timeout:
        raise LockTimeoutError(
            f"timed out after {timeout:.0f}s waiting for the build of {name!r} (key {base}) held by "
            f"{describe_holder(store, base)}; raise STUBCACHE_LOCK_TIMEOUT if builds are slow"
        ) from None
    return lock
