"""The per-key build lock: a kernel ``flock`` through ``filelock``, bounded waiting, and a lease
file that tells waiters who holds the build."""

from __future__ import annotations

import logging
import os
import time

from .errors import LockTimeoutError
from .store import Store

log = logging.getLogger("stubcache")

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


def acquire(store: Store, base: str, timeout: float, name: str):
    """Acquire the build lock of ``base``; returns the held ``filelock.FileLock``.

    Logs once, after a few seconds, which process holds the build. Raises
    :class:`LockTimeoutError` after ``timeout`` seconds.
    """
    import filelock

    store.ensure()
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
    log.warning("stubcache: waiting for %s to finish building %r (key %s)", holder, name, base)
    try:
        lock.acquire(timeout=remaining, poll_interval=0.05)
    except filelock.Timeout:
        raise LockTimeoutError(
            f"timed out after {timeout:.0f}s waiting for the build of {name!r} (key {base}) held by "
            f"{describe_holder(store, base)}; raise STUBCACHE_LOCK_TIMEOUT if builds are slow"
        ) from None
    return lock
