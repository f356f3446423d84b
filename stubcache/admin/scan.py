"""Scanning a cache root into plain data objects (for ``ls``, ``stats``, ``prune``, ``verify``).

A scan only reads: one ``open``+``read`` of each manifest (plain ``json``), one ``stat`` of each
pin (its mtime is the "last used" stamp, an atime of 0 says "never hit") and, unless asked not
to, a non-blocking probe of each pin's lock to tell whether a live process has the entry loaded. It never imports torch and never
hashes libraries (``verify`` does that).
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from ..edge import fsroot
from ..edge.fsroot import printable
from ..storage.locking import flock_held_at, temp_pid
from ..storage.manifest import MANIFEST_NAME
from ..storage.store import NEVER_HIT_ATIME_NS, Store, is_key
from ..edge.values import count, finite

# pids and times are bounded in the pattern: a name is someone else's input (os.kill(10**30, 0)
# raises OverflowError, and a 300-digit time is no time).
_STAGING_RE = re.compile(r"(?P<base>[0-9a-f]{16,64})-(?P<pid>\d{1,9})-[^/]+\Z")
_ASIDE_RE = re.compile(r"(?P<key>[0-9a-f]{16,64})-(?P<time>\d{1,12})-(?P<pid>\d{1,9})(?:-[0-9a-f]+)?\Z")
MAX_TIME = 4102444800.0  # 2100-01-01: a later "created" stamp is not a time


@dataclass
class EntryRecord:
    """One published entry as seen by a scan (``error`` is set when its manifest is unreadable)."""

    key: str
    path: str
    name: str = "?"
    base_key: str = ""            # the build-lock key (differs from ``key`` for header-tracking stubs)
    size: int = 0                 # library + manifest bytes
    library: str = ""
    torch: str | None = None
    compiler: str | None = None   # first line of the compiler's --version output
    python: str | None = None
    build_method: str | None = None
    build_seconds: float = 0.0
    created: float = 0.0
    last_used: float = 0.0        # pin mtime (refreshed by every hit, to the second); ``created`` if no pin
    never_hit: bool = False       # published and not looked up by any process since (pin atime 0)
    in_use: bool | None = None    # None: not probed
    fingerprint: dict[str, Any] = field(default_factory=dict, repr=False)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key, "base_key": self.base_key, "name": self.name, "size": self.size, "torch": self.torch,
            "compiler": self.compiler, "python": self.python, "build_method": self.build_method,
            "build_seconds": self.build_seconds, "created": self.created, "last_used": self.last_used,
            "in_use": self.in_use, "never_hit": self.never_hit, "path": self.path, "error": self.error,
        }


@dataclass
class Leftover:
    """Something under the root that is not a published entry and may need cleaning up.

    ``kind`` is ``staging``, ``lease``, ``quarantine`` or ``trash``. ``stale`` says whether its
    owner is gone (dead builder pid and free build lock, a lease whose lock nobody holds, a trash
    item of a dead pruner); quarantine items are judged by ``age`` alone.
    """

    kind: str
    path: str
    name: str
    size: int
    age: float
    pid: int | None = None
    stale: bool = False
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "name": self.name, "size": self.size,
                "age": self.age, "pid": self.pid, "stale": self.stale, "detail": self.detail}


@dataclass
class CacheScan:
    """Everything a scan found, at time ``now``."""

    root: str
    now: float
    entries: list[EntryRecord]
    leftovers: list[Leftover]

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.entries)


# --- liveness probes -----------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists on this host (permission errors count as alive)."""
    if not 0 < pid <= 1 << 22:  # PID_MAX_LIMIT; a larger number (from a name) is no process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tree_size(path: str) -> int:
    """Bytes of the regular files under ``path`` (symlinks are not followed)."""
    parent, name = os.path.split(path)
    try:
        with fsroot.Dir(parent) as dfd:
            return fsroot.tree_size_at(dfd, name)
    except (OSError, ValueError):
        return 0


# --- entries ---------------------------------------------------------------------------------


def _first_line(text: Any) -> str | None:
    if not isinstance(text, str) or not text:
        return None
    return printable(text.splitlines()[0].strip()) if text.splitlines() else None


def _text(value: Any) -> str | None:
    """A short printable string from a manifest field, or None (not a string)."""
    return printable(value, 200) if isinstance(value, str) else None


def _parse_manifest(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ValueError("nests too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("manifest is not a JSON object")
    return data


def read_entry(store: Store, key: str, probe_in_use: bool = True) -> EntryRecord:
    """One entry's record from its manifest and pin, without hashing anything. Every field is
    type- and range-checked (a group member may have written the manifest), and text fields
    are escaped; an entry that is not a directory, or whose manifest is not a readable regular
    file, gets ``error`` set."""
    try:
        pfd: int | None = store.dir("pins")
    except OSError:
        pfd = None
    try:
        return _read_entry(store, key, pfd, probe_in_use)
    finally:
        if pfd is not None:
            os.close(pfd)


def _read_entry(store: Store, key: str, pins_fd: int | None, probe_in_use: bool, now: float | None = None) -> EntryRecord:
    edir = store.entry_dir(key)
    rec = EntryRecord(key=key, path=edir)
    data: dict[str, Any] = {}
    raw = b""
    mtime = 0.0
    try:
        with store.at("entries", key) as efd:
            mtime = os.fstat(efd).st_mtime
            raw = fsroot.read_at(efd, MANIFEST_NAME, fsroot.MANIFEST_CAP)
        data = _parse_manifest(raw)
    except FileNotFoundError:
        rec.error = "manifest missing"
    except fsroot.NotRegularFile as exc:
        rec.error = f"manifest {exc.strerror}"
    except OSError as exc:
        rec.error = (f"not a directory ({exc.strerror})" if exc.errno in (errno.ELOOP, errno.ENOTDIR)
                     else f"manifest unreadable: {exc.strerror or exc}")
    except ValueError as exc:
        rec.error = f"manifest unreadable: {printable(exc)}"
    if rec.error:
        data, raw = {}, b""
    pre: Any = data.get("preimage") if isinstance(data.get("preimage"), dict) else {}
    fp: Any = pre.get("fingerprint") if isinstance(pre.get("fingerprint"), dict) else {}
    rec.fingerprint = fp
    rec.name = _text(data.get("name")) or "?"
    base = data.get("base_key")
    rec.base_key = base if isinstance(base, str) and is_key(base) else key  # never a path from a manifest
    rec.size = (count(data.get("size")) or 0) + len(raw)
    rec.library = _text(data.get("library")) or ""
    torch = fp.get("torch") if isinstance(fp.get("torch"), dict) else {}
    rec.torch = _text(torch.get("version"))
    cxx = fp.get("cxx") if isinstance(fp.get("cxx"), dict) else {}
    rec.compiler = _first_line(cxx.get("version"))
    py = fp.get("python") if isinstance(fp.get("python"), dict) else {}
    rec.python = _text(py.get("version"))
    rec.build_method = _text(data.get("build_method"))
    rec.build_seconds = finite(data.get("build_seconds"), 0.0, 1e7) or 0.0
    created = finite(data.get("created"), 0.0, MAX_TIME)
    rec.created = created if created is not None else mtime
    rec.last_used = rec.created
    if pins_fd is not None:
        try:
            pst = os.stat(key, dir_fd=pins_fd, follow_symlinks=False)
            rec.last_used = pst.st_mtime
            rec.never_hit = pst.st_atime_ns == NEVER_HIT_ATIME_NS
        except OSError:
            pass
        if probe_in_use:
            rec.in_use = flock_held_at(pins_fd, key)
    return rec


def scan_entries(store: Store, probe_in_use: bool = True) -> list[EntryRecord]:
    """Records of every published entry, sorted by key."""
    try:
        pfd: int | None = store.dir("pins")
    except OSError:
        pfd = None
    try:
        return [_read_entry(store, key, pfd, probe_in_use) for key in store.entry_keys()]
    finally:
        if pfd is not None:
            os.close(pfd)


# --- leftovers -------------------------------------------------------------------------------


class _Area:
    """One layout directory held open for a scan (``fd`` is -1 if it is missing or not a dir)."""

    def __init__(self, store: Store, area: str) -> None:
        self.path = store.path(area)
        try:
            self.fd = store.dir(area)
        except OSError:
            self.fd = -1

    def names(self) -> list[str]:
        if self.fd < 0:
            return []
        try:
            return fsroot.listdir(self.fd)
        except OSError:
            return []

    def mtime(self, name: str, default: float) -> float:
        try:
            return fsroot.lstat_at(self.fd, name).st_mtime
        except (OSError, ValueError):
            return default

    def size(self, name: str) -> int:
        return fsroot.tree_size_at(self.fd, name) if self.fd >= 0 else 0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def scan_leftovers(store: Store, now: float | None = None) -> list[Leftover]:
    """Staging directories, lease files, quarantine and trash items, judged stale or not.

    Each area is read through one descriptor; names are only ever used relative to it, and
    only names of the expected shape give a pid or a build-lock name."""
    now = time.time() if now is None else now
    out: list[Leftover] = []
    areas = {a: _Area(store, a) for a in ("staging", "leases", "locks", "quarantine", "trash")}
    locks = areas["locks"]

    def lock_held(base: str | None) -> bool:
        return base is not None and locks.fd >= 0 and flock_held_at(locks.fd, f"{base}.lock")

    try:
        sdir = areas["staging"]
        for name in sdir.names():
            m = _STAGING_RE.match(name)
            pid = int(m.group("pid")) if m else None
            base = m.group("base") if m else None
            alive = pid is not None and pid_alive(pid)
            locked = lock_held(base)
            stale = not alive and not locked
            why = (f"builder pid {pid} is alive" if alive else "its build lock is held" if locked
                   else f"builder pid {pid} is gone" if pid is not None else "not made by a builder")
            out.append(Leftover("staging", os.path.join(sdir.path, name), name, sdir.size(name),
                                now - sdir.mtime(name, now), pid, stale, why))
        ldir = areas["leases"]
        for name in ldir.names():
            path = os.path.join(ldir.path, name)
            age = now - ldir.mtime(name, now)
            if name.endswith(".tmp"):
                pid = temp_pid(name)
                stale = (pid is None or not pid_alive(pid)) and age > 60
                out.append(Leftover("lease", path, name, ldir.size(name), age, pid, stale,
                                    "temporary lease file of a dead writer" if stale else "being written"))
                continue
            base = name[:-5] if name.endswith(".json") else None
            if base is None or not is_key(base):
                out.append(Leftover("lease", path, name, ldir.size(name), age, None, True, "not a lease file"))
                continue
            lease = store.read_lease(base) or {}
            pid = count(lease.get("pid"), 1, 1 << 22)
            held = lock_held(base)
            out.append(Leftover("lease", path, name, ldir.size(name), age, pid, not held,
                                "its build lock is held" if held else "nobody holds its build lock"))
        for area in ("quarantine", "trash"):
            adir = areas[area]
            for name in adir.names():
                m = _ASIDE_RE.match(name)
                pid = int(m.group("pid")) if m else None
                moved = float(m.group("time")) if m else adir.mtime(name, now)
                if area == "trash":
                    alive = pid is not None and pid_alive(pid) and pid != os.getpid()
                    stale = not alive
                    detail = f"remover pid {pid} is alive" if alive else "left by a remover that is gone"
                else:
                    stale = False
                    detail = _quarantine_reason(adir.fd, name)
                out.append(Leftover(area, os.path.join(adir.path, name), name, adir.size(name),
                                    max(now - moved, 0.0), pid, stale, detail))
    finally:
        for a in areas.values():
            a.close()
    return out


def _quarantine_reason(qfd: int, name: str) -> str:
    try:
        fd = os.open(fsroot.check_name(name), fsroot.O_DIR, dir_fd=qfd)
    except (OSError, ValueError):
        return ""
    try:
        return printable(fsroot.read_at(fd, "QUARANTINE_REASON", 8192).decode("utf-8", "replace").strip(), 500)
    except (OSError, ValueError):
        return ""
    finally:
        os.close(fd)


def scan_cache(store: Store, probe_in_use: bool = True, leftovers: bool = True) -> CacheScan:
    """Scan entries (and, unless ``leftovers=False``, leftovers) of ``store``."""
    now = time.time()
    return CacheScan(
        root=store.root,
        now=now,
        entries=scan_entries(store, probe_in_use),
        leftovers=scan_leftovers(store, now) if leftovers else [],
    )
