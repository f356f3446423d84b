"""Scanning a cache root into plain data objects (for ``ls``, ``stats``, ``prune``, ``verify``).

A scan only reads: one ``open``+``read`` of each manifest (plain ``json``), one ``stat`` of each
pin (its mtime is the "last used" stamp) and, unless asked not to, a non-blocking probe of each
pin's lock to tell whether a live process has the entry loaded. It never imports torch and never
hashes libraries (``verify`` does that).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .manifest import MANIFEST_NAME
from .store import Store

_STAGING_RE = re.compile(r"(?P<base>[0-9a-f]+)-(?P<pid>\d+)-[^/]+\Z")
_ASIDE_RE = re.compile(r"(?P<key>[0-9a-f]+)-(?P<time>\d+)-(?P<pid>\d+)\Z")


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
    last_used: float = 0.0        # pin mtime (refreshed at most hourly); ``created`` if no pin
    in_use: bool | None = None    # None: not probed
    fingerprint: dict[str, Any] = field(default_factory=dict, repr=False)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key, "base_key": self.base_key, "name": self.name, "size": self.size, "torch": self.torch,
            "compiler": self.compiler, "python": self.python, "build_method": self.build_method,
            "build_seconds": self.build_seconds, "created": self.created, "last_used": self.last_used,
            "in_use": self.in_use, "path": self.path, "error": self.error,
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
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def flock_held(path: str) -> bool:
    """True if some process holds a ``flock`` (shared or exclusive) on ``path``.

    Probes with a non-blocking exclusive lock that is released at once; a missing file is not held.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
    finally:
        os.close(fd)  # closing drops the probe's lock
    return False


def tree_size(path: str) -> int:
    """Bytes of the regular files under ``path`` (symlinks are not followed)."""
    total = 0
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if not os.path.isdir(path) or os.path.islink(path):
        return st.st_size
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


# --- entries ---------------------------------------------------------------------------------


def _first_line(text: Any) -> str | None:
    if not isinstance(text, str) or not text:
        return None
    return text.splitlines()[0].strip()


def read_entry(store: Store, key: str, probe_in_use: bool = True) -> EntryRecord:
    """One entry's record from its manifest and pin, without hashing anything."""
    edir = store.entry_dir(key)
    rec = EntryRecord(key=key, path=edir)
    try:
        with open(os.path.join(edir, MANIFEST_NAME), "rb") as fh:
            raw = fh.read()
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("manifest is not a JSON object")
    except FileNotFoundError:
        rec.error = "manifest missing"
        data, raw = {}, b""
    except (OSError, ValueError) as exc:
        rec.error = f"manifest unreadable: {exc}"
        data, raw = {}, b""
    pre = data.get("preimage") if isinstance(data.get("preimage"), dict) else {}
    fp = pre.get("fingerprint") if isinstance(pre.get("fingerprint"), dict) else {}
    rec.fingerprint = fp
    rec.name = str(data.get("name", "?"))
    rec.base_key = data.get("base_key") if isinstance(data.get("base_key"), str) else key
    lib_size = data.get("size") if isinstance(data.get("size"), int) else 0
    rec.size = lib_size + len(raw)
    rec.library = str(data.get("library", ""))
    torch = fp.get("torch") if isinstance(fp.get("torch"), dict) else {}
    rec.torch = torch.get("version")
    cxx = fp.get("cxx") if isinstance(fp.get("cxx"), dict) else {}
    rec.compiler = _first_line(cxx.get("version"))
    py = fp.get("python") if isinstance(fp.get("python"), dict) else {}
    rec.python = py.get("version")
    rec.build_method = data.get("build_method")
    bs = data.get("build_seconds")
    rec.build_seconds = float(bs) if isinstance(bs, (int, float)) else 0.0
    created = data.get("created")
    if not isinstance(created, (int, float)):
        try:
            created = os.stat(edir).st_mtime
        except OSError:
            created = 0.0
    rec.created = float(created)
    pin = store.pin_path(key)
    try:
        rec.last_used = os.stat(pin).st_mtime
    except OSError:
        rec.last_used = rec.created
    if probe_in_use:
        rec.in_use = flock_held(pin)
    return rec


def scan_entries(store: Store, probe_in_use: bool = True) -> list[EntryRecord]:
    """Records of every published entry, sorted by key."""
    return [read_entry(store, key, probe_in_use) for key in store.entry_keys()]


# --- leftovers -------------------------------------------------------------------------------


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []


def _mtime(path: str, default: float) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return default


def scan_leftovers(store: Store, now: float | None = None) -> list[Leftover]:
    """Staging directories, lease files, quarantine and trash items, judged stale or not."""
    now = time.time() if now is None else now
    out: list[Leftover] = []
    sdir = store.path("staging")
    for name in _listdir(sdir):
        path = os.path.join(sdir, name)
        m = _STAGING_RE.match(name)
        pid = int(m.group("pid")) if m else None
        base = m.group("base") if m else None
        alive = pid is not None and pid_alive(pid)
        locked = base is not None and flock_held(store.lock_path(base))
        stale = not alive and not locked
        why = (f"builder pid {pid} is alive" if alive else
               "its build lock is held" if locked else f"builder pid {pid} is gone")
        out.append(Leftover("staging", path, name, tree_size(path), now - _mtime(path, now), pid, stale, why))
    ldir = store.path("leases")
    for name in _listdir(ldir):
        path = os.path.join(ldir, name)
        if name.endswith(".tmp"):
            tpid = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            pid = int(tpid) if tpid.isdigit() else None
            stale = pid is None or not pid_alive(pid)
            out.append(Leftover("lease", path, name, tree_size(path), now - _mtime(path, now), pid, stale,
                                "temporary lease file of a dead writer" if stale else "being written"))
            continue
        base = name[:-5] if name.endswith(".json") else name
        lease = store.read_lease(base) or {}
        pid = lease.get("pid") if isinstance(lease.get("pid"), int) else None
        held = flock_held(store.lock_path(base))
        out.append(Leftover("lease", path, name, tree_size(path), now - _mtime(path, now), pid, not held,
                            "its build lock is held" if held else "nobody holds its build lock"))
    for area in ("quarantine", "trash"):
        adir = store.path(area)
        for name in _listdir(adir):
            path = os.path.join(adir, name)
            m = _ASIDE_RE.match(name)
            pid = int(m.group("pid")) if m else None
            moved = float(m.group("time")) if m else _mtime(path, now)
            if area == "trash":
                alive = pid is not None and pid_alive(pid) and pid != os.getpid()
                stale = not alive
                detail = f"remover pid {pid} is alive" if alive else "left by a remover that is gone"
            else:
                stale = False
                detail = _quarantine_reason(path)
            out.append(Leftover(area, path, name, tree_size(path), now - moved, pid, stale, detail))
    return out


def _quarantine_reason(path: str) -> str:
    try:
        with open(os.path.join(path, "QUARANTINE_REASON"), encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def scan_cache(store: Store, probe_in_use: bool = True, leftovers: bool = True) -> CacheScan:
    """Scan entries (and, unless ``leftovers=False``, leftovers) of ``store``."""
    now = time.time()
    return CacheScan(
        root=store.root,
        now=now,
        entries=scan_entries(store, probe_in_use),
        leftovers=scan_leftovers(store, now) if leftovers else [],
    )
