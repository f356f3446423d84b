"""The on-disk layout: entries, staging, publish by rename, integrity, quarantine, pins.

Layout under ``<root>/v1/``::

    entries/<key>/{<module>.so, manifest.json}   published, immutable
    variants/<base>/<key>                        empty markers: entries with tracked files
    staging/<base>-<pid>-<rand>/                 one private directory per build
    locks/<base>.lock  leases/<base>.json        per-key build lock and who holds it
    failures/<base>.json                         last failed build, for processes waiting on it
    pins/<key>                                   shared flock while loaded; mtime = last used
    quarantine/<key>-<time>-<pid>/               entries that failed verification
    trash/<key>-<time>-<pid>/                    entries on their way out (prune/clear)
    events/<host>-<pid>-<rand>.jsonl             per-process counters for ``stubcache stats``
    state/                                       memoised toolchain facts
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time

from . import _log
from .manifest import MANIFEST_NAME, Manifest

LAYOUT = "v1"
SUBDIRS = ("entries", "variants", "staging", "locks", "leases", "failures", "pins",
           "quarantine", "trash", "events", "state")
LAST_USED_INTERVAL = 3600.0  # seconds: a hit writes the last-used stamp at most this often


def file_sha256(fd_or_path) -> str:
    """SHA-256 of a file, given an open fd (read from offset 0) or a path."""
    h = hashlib.sha256()
    if isinstance(fd_or_path, int):
        off = 0
        while True:
            chunk = os.pread(fd_or_path, 1 << 20, off)
            if not chunk:
                break
            h.update(chunk)
            off += len(chunk)
    else:
        with open(fd_or_path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def try_flock_ex(fd: int) -> bool:
    """``LOCK_EX|LOCK_NB`` on ``fd``: True if taken, False if another open file holds a lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def default_root() -> str:
    """``STUBCACHE_DIR``, else ``platformdirs.user_cache_dir("stubcache")``."""
    env = os.environ.get("STUBCACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    import platformdirs  # only when no explicit root: keeps the hit path light

    return platformdirs.user_cache_dir("stubcache")


class Store:
    """Paths and primitive operations of one cache root. No policy lives here."""

    def __init__(self, root: str, *, shared: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.base = os.path.join(self.root, LAYOUT)
        self.shared = shared  # group-shared root: files others in the group must use get g+rw
        self._ready = False

    def mode(self, private: int, shared: int) -> int:
        return shared if self.shared else private

    # --- paths -------------------------------------------------------------------------------

    def path(self, sub: str, *parts: str) -> str:
        return os.path.join(self.base, sub, *parts)

    def entry_dir(self, key: str) -> str:
        return os.path.join(self.base, "entries", key)

    def ensure(self) -> None:
        """Create the root (0700) and its sub-directories if missing."""
        if self._ready:
            return
        if os.path.isdir(os.path.join(self.base, SUBDIRS[-1])):  # the last one made: all exist
            self._ready = True
            return
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        try:
            os.mkdir(self.base, 0o700)
        except FileExistsError:
            pass
        for sub in SUBDIRS:
            try:
                os.mkdir(os.path.join(self.base, sub), 0o700)
            except FileExistsError:
                pass
        self._ready = True

    # --- reading -----------------------------------------------------------------------------

    def read_manifest(self, key: str) -> Manifest:
        """Parse ``entries/<key>/manifest.json``; ``FileNotFoundError`` if there is no entry,
        ``ValueError`` if the manifest is unreadable."""
        fd = os.open(os.path.join(self.base, "entries", key, MANIFEST_NAME), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            # Read what is there (a 16 MiB read buffer alone costs ~100 us), capped at 16 MiB.
            data = os.read(fd, min(os.fstat(fd).st_size + 1, 1 << 24))
        finally:
            os.close(fd)
        try:
            return Manifest.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"manifest is not UTF-8: {exc}") from None

    def variant_keys(self, base: str) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(self.base, "variants", base)))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return []  # no variants, or a root this user cannot read (lookups then miss)

    def entry_keys(self) -> list[str]:
        try:
            return sorted(k for k in os.listdir(os.path.join(self.base, "entries")) if not k.startswith("."))
        except FileNotFoundError:
            return []

    # --- staging and publish ---------------------------------------------------------------

    def new_staging(self, base: str) -> str:
        """A fresh private directory for one build (name carries the builder's pid)."""
        import tempfile

        self.ensure()
        path = tempfile.mkdtemp(prefix=f"{base}-{os.getpid()}-", dir=os.path.join(self.base, "staging"))
        if self.shared:
            os.chmod(path, 0o2770)  # so a group member's prune can remove it after a crash
        return path

    def publish(self, staged_entry: str, manifest: Manifest) -> bool:
        """Rename a complete entry directory into place. Returns False if one already existed
        (the existing entry wins and ``staged_entry`` is left for the caller to remove)."""
        with open(os.path.join(staged_entry, MANIFEST_NAME), "w", encoding="utf-8") as fh:
            fh.write(manifest.dumps())
        os.chmod(os.path.join(staged_entry, MANIFEST_NAME), 0o444)
        os.chmod(os.path.join(staged_entry, manifest.library), 0o555)
        os.chmod(staged_entry, self.mode(0o755, 0o2775))
        if manifest.key != manifest.base_key:
            # The marker goes first: a marker without an entry is skipped by lookups, while an
            # entry without its marker (a crash in between) would never be found again.
            self.add_variant(manifest.base_key, manifest.key)
        target = self.entry_dir(manifest.key)
        try:
            os.rename(staged_entry, target)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        self.touch_pin(manifest.key)
        return True

    def add_variant(self, base: str, key: str) -> None:
        """Record that entry ``key`` was built from base key ``base`` (with tracked headers)."""
        vdir = os.path.join(self.base, "variants", base)
        os.makedirs(os.path.dirname(vdir), mode=0o700, exist_ok=True)
        try:
            os.mkdir(vdir, self.mode(0o700, 0o2770))
            if self.shared:
                os.chmod(vdir, 0o2770)
        except FileExistsError:
            pass
        fd = os.open(os.path.join(vdir, key), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, self.mode(0o600, 0o660))
        os.close(fd)

    # --- removal -----------------------------------------------------------------------------

    def _move_aside(self, key: str, area: str) -> str | None:
        src = self.entry_dir(key)
        dst = os.path.join(self.base, area, f"{key}-{int(time.time())}-{os.getpid()}")
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return None
        return dst

    def quarantine(self, key: str, reason: str) -> str | None:
        """Move an entry to ``quarantine/`` (kept for inspection; prune removes old ones)."""
        dst = self._move_aside(key, "quarantine")
        if dst is not None:
            _log.warning("stubcache: quarantined entry %s (%s) -> %s", key, reason, dst)
            try:
                with open(os.path.join(dst, "QUARANTINE_REASON"), "w", encoding="utf-8") as fh:
                    fh.write(reason + "\n")
            except OSError:
                pass
        return dst

    def trash(self, key: str) -> str | None:
        """Move an entry to ``trash/`` (atomically invisible to readers); caller deletes it."""
        return self._move_aside(key, "trash")

    @staticmethod
    def rmtree(path: str) -> None:
        """Remove a tree that may contain read-only files/directories."""
        import shutil

        def onerror(func, p, exc_info):
            try:
                os.chmod(os.path.dirname(p), 0o700)
                os.chmod(p, 0o700)
                func(p)
            except OSError:
                pass
        if os.path.lexists(path):
            shutil.rmtree(path, onerror=onerror)

    # --- pins and last-used ---------------------------------------------------------------

    def pin_path(self, key: str) -> str:
        return os.path.join(self.base, "pins", key)

    def open_lock_file(self, path: str) -> int:
        """Open (creating) a file used only for ``flock``: private ``0600``, or ``0660`` in a
        shared root whatever the umask, so every member can lock it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, self.mode(0o600, 0o660))
        if self.shared:
            try:
                os.fchmod(fd, 0o660)
            except OSError:
                pass  # created by another member: already 0660
        return fd

    def _open_pin(self, key: str) -> int:
        return self.open_lock_file(self.pin_path(key))

    def touch_pin(self, key: str) -> None:
        os.close(self._open_pin(key))

    def pin(self, key: str) -> int:
        """Take a shared flock on the entry's pin file and return the fd (keep it open while the
        library may be in use: the kernel drops the lock when the process dies). Also refreshes
        the last-used stamp at most once per ``LAST_USED_INTERVAL``."""
        while True:
            fd = self._open_pin(key)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                st = os.fstat(fd)
                try:
                    current = os.stat(self.pin_path(key)).st_ino
                except FileNotFoundError:
                    current = None
                if current != st.st_ino:
                    # prune removed this pin file while we waited: lock the one now in place
                    os.close(fd)
                    continue
                if time.time() - st.st_mtime > LAST_USED_INTERVAL:
                    os.utime(fd)
            except OSError:
                os.close(fd)
                raise
            return fd

    # --- build bookkeeping ---------------------------------------------------------------

    def lock_path(self, base: str) -> str:
        return os.path.join(self.base, "locks", f"{base}.lock")

    def lease_path(self, base: str) -> str:
        return os.path.join(self.base, "leases", f"{base}.json")

    def write_lease(self, base: str, name: str) -> None:
        info = {"pid": os.getpid(), "host": os.uname().nodename, "started": time.time(), "name": name}
        tmp = self.lease_path(base) + f".{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(info, fh)
        os.replace(tmp, self.lease_path(base))

    def read_lease(self, base: str) -> dict | None:
        try:
            with open(self.lease_path(base), encoding="utf-8") as fh:
                data = json.load(fh)
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def clear_lease(self, base: str) -> None:
        try:
            os.unlink(self.lease_path(base))
        except FileNotFoundError:
            pass

    def failure_path(self, base: str) -> str:
        return os.path.join(self.base, "failures", f"{base}.json")

    def record_failure(self, base: str, output: str) -> None:
        tmp = self.failure_path(base) + f".{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"time": time.time(), "pid": os.getpid(), "output": output}, fh)
        os.replace(tmp, self.failure_path(base))

    def read_failure(self, base: str) -> dict | None:
        try:
            with open(self.failure_path(base), encoding="utf-8") as fh:
                data = json.load(fh)
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def clear_failure(self, base: str) -> None:
        try:
            os.unlink(self.failure_path(base))
        except FileNotFoundError:
            pass
