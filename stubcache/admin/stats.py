"""Folding the per-process event files (``events/*.jsonl``, written by :mod:`stubcache.storage.events`)
into the counters ``stubcache stats`` prints.

Every process appends to its own file, so nothing here needs a lock, and a process killed at
any point leaves every complete line it wrote (a torn last line is counted in ``bad_lines``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from ..edge import fsroot
from ..storage import locking
from ..storage.events import Event
from .scan import EntryRecord
from ..edge.values import MAX_SECONDS, count, finite

MAX_TIME = 4102444800.0  # 2100-01-01
EVENTS_TOTAL_CAP = 512 << 20  # bytes of event files read by one stats/compaction (beyond: skipped)


@dataclass
class EventTotals:
    """Counters folded from event lines."""

    hits: int = 0
    misses: int = 0
    builds: int = 0
    build_seconds: float = 0.0
    waits: int = 0
    wait_seconds: float = 0.0
    failed_builds: int = 0
    quarantined: int = 0
    lock_timeouts: int = 0
    private_builds: int = 0
    private_build_seconds: float = 0.0
    processes: int = 0
    bad_lines: int = 0
    first_event: float | None = None
    last_event: float | None = None
    remote: "RemoteTotals" = field(default_factory=lambda: RemoteTotals())
    hits_by_key: dict[str, int] = field(default_factory=dict)
    build_seconds_by_key: dict[str, float] = field(default_factory=dict)
    reset_at: float | None = None  # the last ``stats --reset``: older lines were not folded

    def add(self, rec: dict[str, Any]) -> None:
        """Fold one parsed event line."""
        ev = rec.get("ev")
        key = rec.get("key")
        key = key if isinstance(key, str) else ""
        s = finite(rec.get("s"), 0.0, MAX_SECONDS) or 0.0  # NaN, inf, 1e400, -5: not a duration
        t = finite(rec.get("t"), 0.0, MAX_TIME)
        if t is not None:
            self.first_event = t if self.first_event is None else min(self.first_event, t)
            self.last_event = t if self.last_event is None else max(self.last_event, t)
        if ev == Event.HIT:
            self.hits += 1
            self.hits_by_key[key] = self.hits_by_key.get(key, 0) + 1
        elif ev == Event.MISS:
            self.misses += 1
        elif ev == Event.BUILD:
            self.builds += 1
            self.build_seconds += s
            self.build_seconds_by_key[key] = s
        elif ev == Event.WAIT:
            self.waits += 1
            self.wait_seconds += s
        elif ev == Event.FAIL:
            self.failed_builds += 1
        elif ev == Event.QUARANTINE:
            self.quarantined += 1
        elif ev == Event.LOCK_TIMEOUT:
            self.lock_timeouts += 1
            self.wait_seconds += s
        elif ev == Event.PRIVATE_BUILD:
            self.private_builds += 1
            self.private_build_seconds += s
        elif ev in REMOTE_EVENTS:
            self.remote.add(ev, rec, s)
        elif ev == Event.ARCHIVE:
            self.processes += count(rec.get("processes"), 0, 1 << 40) or 0


REMOTE_EVENTS = frozenset((Event.REMOTE_HIT, Event.REMOTE_MISS, Event.UPLOAD, Event.REMOTE_REJECTED,
                           Event.LEASE_WAIT, Event.REMOTE_ERROR))
# Every Event is in exactly one of these two (tests/test_stats.py checks it): the ones EventTotals.add
# folds into a figure, and the ones recorded only for a reader of the files.
COUNTED_EVENTS = frozenset((Event.HIT, Event.MISS, Event.BUILD, Event.WAIT, Event.FAIL, Event.QUARANTINE,
                            Event.LOCK_TIMEOUT, Event.PRIVATE_BUILD, Event.ARCHIVE)) | REMOTE_EVENTS
UNCOUNTED_EVENTS = frozenset((Event.UNSTABLE_INPUTS,))


@dataclass
class RemoteTotals:
    """Counters of the remote tier (docs/remote.md): ``hits`` are blobs downloaded and published
    locally (each follows a local miss), ``misses`` keys the remote store did not have."""

    hits: int = 0
    misses: int = 0
    uploads: int = 0
    bytes_downloaded: int = 0
    bytes_uploaded: int = 0
    download_seconds: float = 0.0
    rejected_blobs: int = 0
    lease_waits: int = 0
    lease_wait_seconds: float = 0.0
    lease_takeovers: int = 0
    errors: int = 0

    def add(self, ev: str, rec: dict[str, Any], s: float) -> None:
        n = count(rec.get("bytes")) or 0  # event files are written by others: range-checked
        if ev == Event.REMOTE_HIT:
            self.hits += 1
            self.bytes_downloaded += n
            self.download_seconds += s
        elif ev == Event.REMOTE_MISS:
            self.misses += 1
        elif ev == Event.UPLOAD:
            self.uploads += 1
            self.bytes_uploaded += n
        elif ev == Event.REMOTE_REJECTED:
            self.rejected_blobs += 1
        elif ev == Event.LEASE_WAIT:
            self.lease_waits += 1
            self.lease_wait_seconds += s
            if rec.get("outcome") == "takeover":
                self.lease_takeovers += 1
        elif ev == Event.REMOTE_ERROR:
            self.errors += 1

    def rounded(self) -> "RemoteTotals":
        fields: dict[str, Any] = {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}
        return RemoteTotals(**fields)


def counts_since(rec: dict[str, Any], since: float | None) -> bool:
    """Whether an event line counts after a reset at ``since`` (``None``: no reset): written at
    or after it. A line without a valid time (and an archive header from before timestamps)
    predates any reset."""
    if since is None:
        return True
    t = finite(rec.get("t"), 0.0, MAX_TIME)
    return t is not None and t >= since


def fold_lines(lines: Iterable[bytes], totals: EventTotals, since: float | None = None) -> int:
    """Fold event lines into ``totals``; returns how many counted (lines before ``since``, the
    last reset, do not)."""
    counted = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            totals.bad_lines += 1
            continue
        if not isinstance(rec, dict):
            totals.bad_lines += 1
        elif counts_since(rec, since):
            totals.add(rec)
            counted += 1
    return counted


RESET_NAME = "stats-reset.json"  # in events/: when the counters were last zeroed (not a .jsonl)


def read_reset(events_dir: str) -> float | None:
    """The time of the last ``stats --reset`` (``None``: never). The file is someone's input in
    a shared root: a time in the future or garbage is no reset."""
    try:
        with fsroot.Dir(events_dir) as dfd:
            return _read_reset_at(dfd)
    except (OSError, ValueError):
        return None


def _read_reset_at(dfd: int) -> float | None:
    try:
        rec = json.loads(fsroot.read_at(dfd, RESET_NAME, 4096))
    except (OSError, ValueError, RecursionError):
        return None
    return finite(rec.get("time"), 0.0, time.time() + 60.0) if isinstance(rec, dict) else None


@dataclass
class ResetResult:
    """What :func:`reset_counters` did."""

    time: float
    deleted: int   # event files of finished processes (and archives) deleted
    live: int      # files of live processes, kept: their lines before ``time`` no longer count


def reset_counters(events_dir: str, lock_path: str, file_mode: int = 0o600, wait: float = 10.0) -> ResetResult:
    """Zero the counters without touching the entries (``stubcache stats --reset``, like
    ``ccache -z``).

    Live processes keep appending to their own files, so nothing is truncated under them: the
    reset time is written to ``events/stats-reset.json`` (atomically) and every line older than
    it stops counting, in :func:`fold_events` and in later compactions. Then the files of
    finished processes, all older than the reset, are deleted. Holds the compaction lock
    (``lock_path``) throughout, waiting at most ``wait`` seconds for a compaction to finish
    (``TimeoutError`` past that), so no archive can be written from files read before the reset.
    """
    from ..storage.events import file_mode as event_file_mode

    shared = bool(file_mode & 0o070)
    lock_dir, lock_name = os.path.split(lock_path)
    with fsroot.Dir(lock_dir) as lfd:
        lock_fd = locking.open_lock_at(lfd, lock_name, shared=shared, label=lock_path)
    try:
        if not locking.wait_flock(lock_fd, locking.EX, wait):
            raise TimeoutError(f"a compaction of {events_dir} held {lock_path} for over {wait:.0f}s; try again")
        with fsroot.Dir(events_dir) as dfd:
            now = time.time()
            data = json.dumps({"time": now, "pid": os.getpid(), "uid": os.geteuid()}).encode() + b"\n"
            locking.write_file(dfd, RESET_NAME, data, mode=event_file_mode(shared), fsync=True)
            deleted = live = 0
            for name in fsroot.listdir(dfd):
                if not name.endswith(".jsonl"):
                    continue
                if not file_finished_at(dfd, name):
                    live += 1
                    continue
                try:
                    fsroot.unlink_at(dfd, name)
                    deleted += 1
                except (OSError, ValueError):
                    pass  # a directory or a member's file: its old lines no longer count anyway
        return ResetResult(now, deleted, live)
    finally:
        os.close(lock_fd)


_ARCHIVE_START = b'{"ev":"%s"' % Event.ARCHIVE.encode()  # the header line compact_events writes


def _archive_header(data: bytes) -> dict[str, Any] | None:
    first = data.split(b"\n", 1)[0]
    if not first.startswith(_ARCHIVE_START):
        return None
    try:
        rec = json.loads(first)
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def _read_events(events_dir: str) -> tuple[list[tuple[str, bytes]], list[str]]:
    """Every event file's contents, minus files already merged into an archive (left behind by
    a compaction that was killed before deleting them: counting them again would double), and
    the names of those leftovers."""
    try:
        dfd = fsroot.open_dir(events_dir)
    except OSError:
        return [], []
    try:
        return _read_events_at(dfd)
    finally:
        os.close(dfd)


def _read_events_at(dfd: int) -> tuple[list[tuple[str, bytes]], list[str]]:
    try:
        names = [n for n in fsroot.listdir(dfd) if n.endswith(".jsonl")]
    except OSError:
        return [], []
    files = []
    merged: set[str] = set()
    budget = EVENTS_TOTAL_CAP  # a directory full of huge files must not exhaust memory either
    for name in names:
        try:
            data = fsroot.read_at(dfd, name, min(fsroot.EVENTS_CAP, budget))  # FIFOs, links: skipped
        except (OSError, ValueError):
            continue
        budget -= len(data)
        if name.startswith(ARCHIVE_PREFIX):
            header = _archive_header(data)
            if header and isinstance(header.get("merged"), list):
                merged.update(str(m) for m in header["merged"])
        files.append((name, data))
    return [(n, d) for n, d in files if n not in merged], [n for n, _ in files if n in merged]


def fold_events(events_dir: str) -> EventTotals:
    """Fold every ``*.jsonl`` file under ``events_dir`` (since the last reset, if any)."""
    totals = EventTotals()
    since = totals.reset_at = read_reset(events_dir)
    for name, data in _read_events(events_dir)[0]:
        counted = fold_lines(data.split(b"\n"), totals, since)
        if not name.startswith(ARCHIVE_PREFIX) and (since is None or counted):
            totals.processes += 1  # an archive says how many processes it holds
    return totals


ARCHIVE_PREFIX = "archive-"
STALE_TMP_SECONDS = 3600.0


def file_finished(path: str) -> bool:
    """True if no live process appends to this event file: it is not empty (its writer locks it
    before the first write) and its writer's shared ``flock`` is gone. Works across pid
    namespaces and pid reuse; archives are always finished."""
    parent, name = os.path.split(path)
    try:
        dfd = fsroot.open_dir(parent)
    except OSError:
        return False
    try:
        return file_finished_at(dfd, name)
    finally:
        os.close(dfd)


def file_finished_at(dfd: int, name: str) -> bool:
    """:func:`file_finished` for ``name`` in the directory open as ``dfd``."""
    if name.startswith(ARCHIVE_PREFIX):
        return True
    try:
        fd = fsroot.open_regular(dfd, name)
    except (OSError, ValueError):
        return False
    try:
        return os.fstat(fd).st_size > 0 and locking.try_flock(fd)
    except OSError:
        return False
    finally:
        os.close(fd)


def compact_events(events_dir: str, lock_path: str, file_mode: int = 0o600) -> int:
    """Merge the event files of finished processes (and earlier archives) into one archive file,
    so the directory does not grow by a file per process start. Returns how many files merged.

    Lines are kept as they are (``stats`` folds an archive like any other file); a header line
    carries the number of processes and the merged file names, so files left behind by a
    compaction killed before deleting them are not counted twice. Skipped when another
    compaction holds ``lock_path`` or it cannot be opened.

    ``file_mode`` is the root's lock-file mode (``0660`` in a shared root, else ``0600``): the lock
    gets it and the archive the event files' mode (:func:`stubcache.storage.events.file_mode`), whatever
    the umask. The archive is written atomically and ``fsync``-ed before its sources go.
    """
    from ..storage.events import file_mode as event_file_mode

    shared = bool(file_mode & 0o070)
    lock_dir, lock_name = os.path.split(lock_path)
    try:
        dfd = fsroot.open_dir(events_dir)
    except OSError:
        return 0
    try:
        with fsroot.Dir(lock_dir) as lfd:
            lock_fd = locking.open_lock_at(lfd, lock_name, shared=shared, label=lock_path)
    except (OSError, ValueError):
        os.close(dfd)
        return 0
    try:
        try:
            if not locking.try_flock(lock_fd):
                return 0
        except OSError:
            return 0
        _remove_stale_tmp(dfd)
        since = _read_reset_at(dfd)
        files, leftovers = _read_events_at(dfd)
        files = [(n, d) for n, d in files if file_finished_at(dfd, n)]
        if len(files) < 2:
            _unlink_all(dfd, leftovers)
            return 0
        processes = 0
        chunks: list[bytes] = []
        for name, data in files:
            header = _archive_header(data) if name.startswith(ARCHIVE_PREFIX) else None
            if header is not None:
                if counts_since(header, since):
                    processes += count(header.get("processes"), 0, 1 << 40) or 0
                data = data.split(b"\n", 1)[1] if b"\n" in data else b""
            lines = [ln for ln in data.split(b"\n") if ln.strip()]
            if since is not None:  # lines from before a reset are dropped for good here
                lines = [ln for ln in lines if _line_counts(ln, since)]
            if not name.startswith(ARCHIVE_PREFIX) and (since is None or lines):
                processes += 1
            chunks.extend(lines)
        names = [n for n, _ in files]
        header_line = json.dumps({"ev": Event.ARCHIVE, "t": round(time.time(), 3), "processes": processes,
                                  "merged": names}, separators=(",", ":")).encode()
        out = f"{ARCHIVE_PREFIX}{int(time.time())}-{os.getpid()}-{os.urandom(6).hex()}.jsonl"
        locking.write_file(dfd, out, b"\n".join([header_line, *chunks]) + b"\n", mode=event_file_mode(shared),
                           fsync=True)
        _unlink_all(dfd, names + leftovers)
        return len(names)
    finally:
        os.close(lock_fd)
        os.close(dfd)


def _line_counts(line: bytes, since: float) -> bool:
    """A line kept by a compaction after a reset: written since, or unparsable (still counted as
    torn by ``stats``)."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return True
    return not isinstance(rec, dict) or counts_since(rec, since)


def _unlink_all(dfd: int, names: list[str]) -> None:
    for name in names:
        try:
            fsroot.unlink_at(dfd, name)
        except (OSError, ValueError):
            pass


def _remove_stale_tmp(dfd: int) -> None:
    now = time.time()
    for name in os.listdir(dfd):
        if name.endswith((".tmp", ".new")):
            try:
                if now - fsroot.lstat_at(dfd, name).st_mtime > STALE_TMP_SECONDS:
                    fsroot.rmtree_at(dfd, name)
            except (OSError, ValueError):
                pass


@dataclass
class Stats:
    """What ``stubcache stats`` reports."""

    root: str
    entries: int
    total_size: int
    hits: int
    misses: int
    hit_rate: float | None
    builds: int
    build_seconds: float
    saved_seconds: float
    waits: int
    wait_seconds: float
    failed_builds: int
    quarantined: int
    quarantine_items: int
    lock_timeouts: int
    private_builds: int
    processes: int
    bad_lines: int
    first_event: float | None
    last_event: float | None
    remote: RemoteTotals = field(default_factory=RemoteTotals)
    never_hit: int = 0          # entries published and not hit by any process since
    never_hit_size: int = 0     # their bytes
    reset_at: float | None = None  # the last ``stats --reset``: counters count from there

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compute_stats(root: str, entries: list[EntryRecord], totals: EventTotals, quarantine_items: int) -> Stats:
    """Combine a scan and folded events (pure).

    "Seconds saved" counts, for each hit, what building that entry took: the manifest's
    ``build_seconds`` if the entry is still there, else the last recorded build of that key.
    """
    build_s = {e.key: e.build_seconds for e in entries}
    saved = 0.0
    for key, n in totals.hits_by_key.items():
        saved += n * build_s.get(key, totals.build_seconds_by_key.get(key, 0.0))
    lookups = totals.hits + totals.misses
    return Stats(
        root=root,
        entries=len(entries),
        total_size=sum(e.size for e in entries),
        hits=totals.hits,
        misses=totals.misses,
        hit_rate=round(totals.hits / lookups, 4) if lookups else None,
        builds=totals.builds,
        build_seconds=round(totals.build_seconds, 6),
        saved_seconds=round(saved, 6),
        waits=totals.waits,
        wait_seconds=round(totals.wait_seconds, 6),
        failed_builds=totals.failed_builds,
        quarantined=totals.quarantined,
        quarantine_items=quarantine_items,
        lock_timeouts=totals.lock_timeouts,
        private_builds=totals.private_builds,
        processes=totals.processes,
        bad_lines=totals.bad_lines,
        first_event=totals.first_event,
        last_event=totals.last_event,
        remote=totals.remote.rounded(),
        never_hit=sum(1 for e in entries if e.never_hit),
        never_hit_size=sum(e.size for e in entries if e.never_hit),
        reset_at=totals.reset_at,
    )
