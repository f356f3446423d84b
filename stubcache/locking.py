"""The per-key build lock: a kernel ``flock`` (released by the kernel when its holder dies),
bounded waiting, and a lease file that tells waiters who holds the build."""

from __future__ import annotations

import os
import time

from . import _log
from .errors import LockTimeoutError
from .store import Store
from .store import try_flock_ex as _try_flock


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


def describe_holder(store: Store, base: str, fd: int | None = None) -> str:
    """Who holds the build of ``base``: its lease file (written by the holder; every value is
    checked and escaped, as a group member may have written it), else ``/proc/locks``."""
    from .fsroot import printable
    from .store import describe_holders
    from .values import finite

    lease = store.read_lease(base)
    if not lease:
        who = describe_holders(fd) if fd is not None else "an unknown process"
        return f"{who} (no lease file)"
    started = finite(lease.get("started"), 0.0, time.time() + 1.0)
    age = f", building for {time.time() - started:.0f}s" if started is not None else ""
    pid = lease.get("pid") if isinstance(lease.get("pid"), int) and not isinstance(lease.get("pid"), bool) else "?"
    return (f"pid {pid} on {printable(lease.get('host'), 64)} "
            f"({printable(lease.get('name'), 64)}{age})")


class HeldLock:
    """A held build lock: an open fd with an exclusive ``flock`` (the kernel drops it if the
    process dies). ``release()`` closes the fd."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only fd drops the flock
            self.fd = -1


def acquire(store: Store, base: str, timeout: float, name: str, published=None) -> HeldLock | None:
    """Acquire the build lock of ``base`` (``locks/<base>.lock``); returns a :class:`HeldLock`.

    The lock is a kernel ``flock`` on that file (the same lock ``filelock.FileLock`` takes), tried
    without blocking and re-tried every 2-10 ms until ``timeout``: a bounded wait. This is done
    here rather than through filelock because importing filelock costs ~14 ms, paid by every
    waiting process of a start-up herd (see docs/performance.md). Logs once, after a few
    seconds, which process holds the build; raises :class:`LockTimeoutError` after ``timeout``.

    ``published``, if given, is a cheap check called between attempts; when it returns True the
    wait ends and ``None`` is returned: the holder has published, so the caller can look the entry
    up without taking the lock (otherwise a herd's waiters would queue on the lock one by one just
    to find the entry there).
    """
    store.ensure()
    fd = store.open_lock_file(store.lock_path(base))
    try:
        if _try_flock(fd):
            return HeldLock(fd)
        start = time.monotonic()
        deadline = start + timeout
        notice_at = start + NOTICE_AFTER
        delay = 0.002
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise LockTimeoutError(
                    f"timed out after {timeout:.0f}s waiting for the build of {name!r} (key {base}) held "
                    f"by {describe_holder(store, base, fd)}; raise STUBCACHE_LOCK_TIMEOUT if builds are slow")
            if notice_at is not None and now >= notice_at:
                notice_at = None
                _log.warning("stubcache: waiting for %s to finish building %r (key %s)",
                             describe_holder(store, base, fd), name, base)
            time.sleep(min(delay, max(deadline - now, 0.0)))
            delay = min(delay * 1.5, 0.01)  # the probe is one stat: cheap to ask often
            if published is not None and published():
                os.close(fd)
                return None
            if _try_flock(fd):
                return HeldLock(fd)
    except BaseException:
        os.close(fd)
        raise
