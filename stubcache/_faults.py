"""Fault injection for the crash tests: ``STUBCACHE_FAULT=<point>`` makes this process
``SIGKILL`` itself when it reaches ``<point>`` (a real kill -9 at an exact moment).

Points: ``after_build`` (library written, nothing published), ``before_publish`` (entry
directory complete in staging), ``after_publish`` (renamed, before the lock is released).
Unset (the normal case) this costs one dict lookup per build, and nothing on the hit path.
"""

from __future__ import annotations

import os
import signal


def point(name: str) -> None:
    if os.environ.get("STUBCACHE_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
