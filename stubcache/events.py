"""Per-process, append-only event files that ``stubcache stats`` folds into counters.

Each process appends one JSON line per event to its own file, so recording needs no shared lock
and a crashed process loses at most the line it was writing. The writer holds a shared ``flock``
on its file for its whole life, taken before its first write, which is how ``prune`` tells a
live process's file from a finished one without trusting pids (an empty file may be one that is
just being opened, so it is never taken for finished).
"""

from __future__ import annotations

import json
import os
import threading
import time

_lock = threading.Lock()
_fds: dict[str, int] = {}


def file_mode(shared: bool) -> int:
    """The mode of an event file, and of an archive of them: ``0640`` in a shared root, so every
    member's ``stubcache stats`` reads it (only its writer appends), else ``0600``."""
    return 0o640 if shared else 0o600


def record(events_dir: str, event: str, key: str = "", seconds: float | None = None, *,
           file_mode: int, **extra) -> None:
    """Append one event (``hit``, ``miss``, ``build``, ``wait``, ``fail``, ``quarantine``...).
    ``file_mode`` is the mode of this process's event file if it is created now: pass
    :func:`file_mode` of the root's sharing (no default, so no caller can forget it)."""
    rec = {"t": round(time.time(), 3), "ev": event, "key": key}
    if seconds is not None:
        rec["s"] = round(seconds, 6)
    rec.update(extra)
    line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
    try:
        with _lock:
            fd = _fds.get(events_dir)
            pid = os.getpid()
            if fd is None or _fds.get(events_dir + ":pid") != pid:  # reopen after fork
                from . import fsroot, locking

                name = f"{fsroot.check_name(os.uname().nodename)}-{pid}-{os.urandom(6).hex()}.jsonl"
                dfd = fsroot.open_dir(events_dir)  # a planted link in its place is not followed
                try:
                    fd = locking.open_new(dfd, name, mode=file_mode, append=True)
                finally:
                    os.close(dfd)
                try:  # "alive" marker, before any write; dropped at exit. Never waits.
                    alive = locking.try_flock(fd, locking.SH)
                except OSError:
                    alive = False
                if not alive:
                    os.close(fd)
                    return
                _fds[events_dir] = fd
                _fds[events_dir + ":pid"] = pid
            os.write(fd, line)
    except (OSError, ValueError):
        pass  # counters must never break a load
