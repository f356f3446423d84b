"""Fault injection for the crash tests: ``STUBCACHE_FAULT=<point>`` makes this process
``SIGKILL`` itself when it reaches ``<point>`` (a real kill -9 at an exact moment).

Points: ``probed`` (a fresh host's probe done, its compile started, its memo lock held),
``build_lock_taken`` (the key's build lock just taken, nothing looked up under it yet),
``after_build`` (library written, nothing published), ``before_publish`` (entry
directory complete in staging), ``after_publish`` (renamed, before the lock is released);
in prune, ``evict_locked`` (pin and build lock held) and ``evict_trashed`` (entry moved to
trash). ``<point>:stop`` sends ``SIGSTOP`` instead (a stopped holder keeps its locks).
Unset (the normal case) this costs one dict lookup per build, and nothing on the hit path.
"""

from __future__ import annotations

import os

from .settings import FAULT


def point(name: str) -> None:
    fault = os.environ.get(FAULT)
    if fault is None:
        return
    import signal

    if fault == name:
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == name + ":stop":  # SIGSTOP instead: a stopped process that keeps its locks
        os.kill(os.getpid(), signal.SIGSTOP)
