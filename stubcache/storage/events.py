"""Per-process, append-only event files that ``stubcache stats`` folds into counters.

Each process appends one JSON line per event to its own file, so recording needs no shared lock
and a crashed process loses at most the line it was writing. The writer holds a shared ``flock``
on its file for its whole life, taken before its first write, which is how ``prune`` tells a
live process's file from a finished one without trusting pids (an empty file may be one that is
just being opened, so it is never taken for finished).
"""

from __future__ import annotations

import time

from ..edge import cjson
from .. import hit

class Event:
    """The event names (the ``"ev"`` field of each line): every writer records one of these and
    :mod:`stubcache.admin.stats` folds them; the on-disk names are the string values.

    Plain ``str`` constants rather than an :class:`enum.Enum`: a hit records an event, and the
    hit path imports nothing it does not need (``enum`` costs 1-2 ms where nothing else has
    imported it yet).
    """

    HIT = "hit"  # a verified entry was found (``after_wait``: once another process built it)
    MISS = "miss"  # none was found, under the key's lock: this process builds (or fetches) it
    BUILD = "build"  # built and published (``s``: compile seconds)
    WAIT = "wait"  # waited for another process's build of the key (``s``: seconds waited)
    FAIL = "fail"  # the build failed; nothing was published
    QUARANTINE = "quarantine"  # an entry failed verification and was moved to quarantine/
    LOCK_TIMEOUT = "lock_timeout"  # gave up waiting for the key's lock: built privately
    PRIVATE_BUILD = "private_build"  # built in a private directory, not published
    UNSTABLE_INPUTS = "unstable_inputs"  # an input changed during the build: not published
    # The remote tier (docs/remote.md).
    REMOTE_HIT = "remote_hit"  # a blob downloaded and published locally (``bytes``)
    REMOTE_MISS = "remote_miss"  # the remote store did not have the key
    UPLOAD = "upload"  # a local build uploaded (``bytes``)
    REMOTE_REJECTED = "remote_rejected"  # a blob failed verification
    LEASE_WAIT = "lease_wait"  # waited for another host's build (``outcome``)
    REMOTE_ERROR = "remote_error"  # the remote store failed: local-only for a while
    # The first line of a compacted file (stats.compact_events), not an event of a process.
    ARCHIVE = "archive"


EVENTS = frozenset(v for k, v in vars(Event).items() if k.isupper())  # every name a writer may use



def file_mode(shared: bool) -> int:
    """The mode of an event file, and of an archive of them: ``0640`` in a shared root, so every
    member's ``stubcache stats`` reads it (only its writer appends), else ``0600``."""
    return 0o640 if shared else 0o600


def record(events_dir: str, event: str, key: str = "", seconds: float | None = None, *,
           file_mode: int, **extra: object) -> None:
    """Append one event (an :class:`Event` name) to this process's file under ``events_dir``.
    ``file_mode`` is the mode of this process's event file if it is created now: pass
    :func:`file_mode` of the root's sharing (no default, so no caller can forget it)."""
    rec = {"t": round(time.time(), 3), "ev": event, "key": key}
    if seconds is not None:
        rec["s"] = round(seconds, 6)
    rec.update(extra)
    line = (cjson.dumps(rec, separators=(",", ":")) + "\n").encode()
    hit.record_event(events_dir, line, file_mode)  # one file per process, shared with the hit path
