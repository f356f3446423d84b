"""Per-process, append-only event files that ``stubcache stats`` folds into counters.

Each process appends one JSON line per event to its own file, so recording needs no shared lock
and a crashed process loses at most the line it was writing. The writer holds a shared ``flock``
on its file for its whole life, taken before its first write, which is how ``prune`` tells a
live process's file from a finished one without trusting pids (an empty file may be one that is
just being opened, so it is never taken for finished).
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time

_lock = threading.Lock()
_fds: dict[str, int] = {}


def record(events_dir: str, event: str, key: str = "", seconds: float | None = None, *,
           file_mode: int = 0o600, **extra) -> None:
    """Append one event (``hit``, ``miss``, ``build``, ``wait``, ``fail``, ``quarantine``...)."""
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
                from . import fsroot

                name = f"{fsroot.check_name(os.uname().nodename)}-{pid}-{os.urandom(6).hex()}.jsonl"
                dfd = fsroot.open_dir(events_dir)  # a planted link in its place is not followed
                try:
                    fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                                 | os.O_NOFOLLOW, file_mode, dir_fd=dfd)
                finally:
                    os.close(dfd)
                if file_mode != 0o600:
                    os.fchmod(fd, file_mode)
                try:  # "alive" marker, before any write; dropped at exit. Never waits.
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    raise
                _fds[events_dir] = fd
                _fds[events_dir + ":pid"] = pid
            os.write(fd, line)
    except (OSError, ValueError):
        pass  # counters must never break a load
