"""The on-disk layout: entries, staging, publish by rename, integrity, quarantine, pins.

Layout under ``<root>/v1/``::

    entries/<key>/{<module>.so, manifest.json}   published, immutable
    variants/<base>/<key>                        empty markers: entries with tracked files
    staging/<base>-<pid>-<rand>/                 one private directory per build
    locks/<base>.lock  leases/<base>.json        per-key build lock and who holds it
    failures/<base>.json                         last failed build, for processes waiting on it
    pins/<key>                                   shared flock while loaded; mtime = last used,
                                                 atime 0 = published and never hit since
    quarantine/<key>-<time>-<pid>/               entries that failed verification
    trash/<key>-<time>-<pid>/                    entries on their way out (prune/clear)
    events/<host>-<pid>-<rand>.jsonl             per-process counters for ``stubcache stats``
    state/                                       memoised toolchain facts
"""

from __future__ import annotations

import errno
import os
import stat
import time
import threading

from ..edge import cjson as json  # the json functions a hit needs, without importing json
from ..edge import fsroot, log
from . import locking
from hashlib import sha256
from ..edge.fsroot import check_name
# The layout's name and the last-used rules, shared with the compact hit path, which pins too.
from ..hit import LAST_USED_RESOLUTION as LAST_USED_RESOLUTION
from ..hit import LAYOUT as LAYOUT
from ..hit import NEVER_HIT_ATIME_NS as NEVER_HIT_ATIME_NS
from ..hit import touch as _touch_pin
from ..hit import HitRecord, open_state, record_name, staging_name
from .manifest import MANIFEST_NAME, Manifest
from .trust import TrustPolicy


TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any

CHUNK = 1 << 20  # bytes read at a time to hash a file
SUBDIRS = ("entries", "variants", "staging", "locks", "leases", "failures", "pins",
           "quarantine", "trash", "events", "state")


def file_sha256(fd_or_path: int | str) -> str:
    """SHA-256 of a file, given an open fd (read from offset 0) or a path."""
    if isinstance(fd_or_path, int):
        chunk = os.pread(fd_or_path, CHUNK, 0)
        h = sha256(chunk)
        off = len(chunk)
        while chunk:
            chunk = os.pread(fd_or_path, CHUNK, off)
            h.update(chunk)
            off += len(chunk)
    else:
        # Paths may come from a manifest someone else wrote (tracked inputs): a FIFO or a device
        # there must not hang or stream forever, nor even be opened (opening a device acts: a
        # watchdog starts, a tape rewinds; a FIFO releases a waiting writer). So the path is
        # opened O_PATH (no open of the file itself), typed, and only a regular file is then
        # opened for reading, through that very descriptor (links are followed: system headers
        # often are links).
        pfd = os.open(fd_or_path, os.O_PATH | os.O_CLOEXEC)
        try:
            st = os.fstat(pfd)
            if not stat.S_ISREG(st.st_mode):
                raise fsroot.NotRegularFile(errno.EINVAL, f"is a {fsroot.kind(st.st_mode)}", fd_or_path)
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        finally:
            os.close(pfd)
        try:
            return file_sha256(fd)
        finally:
            os.close(fd)
    return h.hexdigest()


def default_root() -> str:
    """``STUBCACHE_DIR``, else ``platformdirs.user_cache_dir("stubcache")``."""
    from ..edge.settings import root_dir

    env = root_dir()
    if env:
        return os.path.abspath(os.path.expanduser(env))
    import platformdirs  # only when no explicit root: keeps the hit path light

    return platformdirs.user_cache_dir("stubcache")


class Store:
    """Paths and primitive operations of one cache root.

    Args:
        root: the cache root.
        policy: the root's trust policy, given once here: a shared root's policy makes every
            file and directory this store creates usable by the group (``g+rw``, setgid
            directories). ``None`` (a root not checked, missing, or not trusted): private modes.

    Deciding whether to trust a root is not the store's job (see :mod:`stubcache.storage.trust`).
    """

    def __init__(self, root: str, policy: TrustPolicy | None = None) -> None:
        self.root = os.path.abspath(root)
        self.base = os.path.join(self.root, LAYOUT)
        self._policy = policy
        self._shared = policy is not None and policy.shared
        # ensure() found or made the whole layout (in this process). Set by ensure() only; a plain
        # attribute, not a property, because the hit path reads it on every call.
        self.ready = False
        self._base_fd = -1  # v1/, opened once without following links (see dir())

    def __del__(self) -> None:
        fd, self._base_fd = getattr(self, "_base_fd", -1), -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Close the descriptor this store keeps of its ``v1/`` directory (reopened on demand)."""
        self.__del__()

    def _base(self) -> int:
        fd = self._base_fd
        if fd < 0:
            with _BASE_LOCK:
                if self._base_fd < 0:
                    self._base_fd = fsroot.open_dir(self.root, LAYOUT)
                fd = self._base_fd
        return fd

    @property
    def policy(self) -> TrustPolicy | None:
        """The trust policy this store was made with (``None``: private modes)."""
        return self._policy

    @property
    def shared(self) -> bool:
        """Whether this is a group-shared root: files it creates get the group's modes."""
        return self._shared

    def mode(self, private: int, shared: int) -> int:
        """``shared`` in a group-shared root, else ``private``."""
        return shared if self._shared else private

    # --- paths -------------------------------------------------------------------------------

    def path(self, sub: str, *parts: str) -> str:
        return os.path.join(self.base, sub, *parts)

    def entry_dir(self, key: str) -> str:
        return os.path.join(self.base, "entries", key)

    def ensure(self, force: bool = False) -> None:
        """Create the root (0700) and any missing layout sub-directory (``2770`` in a shared
        root), never through a symlink. ``force`` re-checks after ``ready`` (a directory that
        went missing is recreated when an operation needs it)."""
        if self.ready and not force:
            return
        try:
            if set(SUBDIRS) <= set(os.listdir(self.base)):
                self.ready = True
                return
        except OSError:
            pass
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        fd = fsroot.open_dir(self.root, LAYOUT, create=True, mode=self.mode(0o700, 0o2770))
        try:
            for sub in SUBDIRS:
                try:
                    os.mkdir(sub, 0o700, dir_fd=fd)
                except FileExistsError:
                    continue
                if self.shared:
                    sfd = os.open(sub, fsroot.O_DIR, dir_fd=fd)
                    try:
                        os.fchmod(sfd, 0o2770)
                    finally:
                        os.close(sfd)
        finally:
            os.close(fd)
        self.ready = True

    def dir(self, *parts: str, create: bool = False) -> int:
        """An fd of ``v1/<parts...>`` opened without following links (close it). With ``create``,
        missing layout directories are made first (see :meth:`ensure`)."""
        # Relative to a descriptor of v1/ kept by this store: one openat per component instead
        # of a walk from the root each time. A root removed meanwhile (the kept directory has no
        # links left) is opened afresh.
        for attempt in (0, 1, 2):
            try:
                return fsroot.open_dir_at(self._base(), *parts)
            except FileNotFoundError:
                base = self._base_fd
                if base >= 0 and os.fstat(base).st_nlink == 0:
                    self.close()
                    continue
                if not create or attempt == 2:
                    raise
                self.ensure(force=True)
                if self._base_fd < 0:
                    continue
                return fsroot.open_dir_at(self._base(), *parts, create=True, mode=self.mode(0o700, 0o2770))
        raise FileNotFoundError(errno.ENOENT, "cache layout vanished", self.base)

    def at(self, *parts: str, create: bool = False) -> "_DirCtx":
        """``with store.at("pins") as fd:`` — :meth:`dir` as a context manager."""
        return _DirCtx(self, parts, create)

    # --- reading -----------------------------------------------------------------------------

    def read_manifest(self, key: str) -> Manifest:
        """Parse ``entries/<key>/manifest.json``; ``FileNotFoundError`` if there is no entry,
        ``ValueError`` if the manifest is unreadable."""
        with self.at("entries", key) as efd:
            return self.read_manifest_at(efd)

    @staticmethod
    def read_manifest_at(entry_fd: int) -> Manifest:
        """Parse the manifest of the entry directory open as ``entry_fd`` (a regular file only,
        read sized to the file; the cap only stops absurd sizes: sources of tens of MB load)."""
        data = fsroot.read_at(entry_fd, MANIFEST_NAME, fsroot.MANIFEST_CAP)
        try:
            return Manifest.loads(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"manifest is not UTF-8: {exc}") from None
        except RecursionError:
            raise ValueError("manifest nests too deeply") from None

    def variant_keys(self, base: str) -> list[str]:
        try:
            with self.at("variants", base) as fd:
                return [k for k in fsroot.listdir(fd) if is_key(k)]
        except OSError:
            return []  # no variants, or a root this user cannot read (lookups then miss)

    def entry_keys(self) -> list[str]:
        """Names under ``entries/`` that look like keys (hex); anything else is not an entry."""
        try:
            with self.at("entries") as fd:
                return [k for k in fsroot.listdir(fd) if is_key(k)]
        except OSError:
            return []

    def entry_names(self) -> list[str]:
        """Every name under ``entries/`` (for reporting what is not an entry)."""
        try:
            with self.at("entries") as fd:
                return fsroot.listdir(fd)
        except OSError:
            return []

    # --- staging and publish ---------------------------------------------------------------

    def new_staging(self, base: str) -> str:
        """A fresh private directory for one build (name carries the builder's pid)."""
        self.ensure()
        mode = self.mode(0o700, 0o2770)  # shared: so the owner's or a member's prune can remove it
        with self.at("staging", create=True) as sfd:
            while True:
                name = staging_name(check_name(base))
                try:
                    os.mkdir(name, 0o700, dir_fd=sfd)
                    break
                except FileExistsError:
                    continue
            if self.shared:
                fd = os.open(name, fsroot.O_DIR, dir_fd=sfd)
                try:
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
        return os.path.join(self.base, "staging", name)

    def publish(self, staged_entry: str, manifest: Manifest) -> bool:
        """Rename a complete entry directory into place (invariant 3 of docs/design.md). Returns
        False if one already existed (the existing entry wins and ``staged_entry`` is left for the
        caller to remove)."""
        # Every step relative to the staging directory's descriptor, opened without following
        # links: nothing here can be redirected out of the root.
        parent, entry_name = os.path.split(os.path.abspath(staged_entry))
        rel = os.path.relpath(parent, self.base).split(os.sep)
        with self.at(*rel) as sfd:
            efd = os.open(check_name(entry_name), fsroot.O_DIR, dir_fd=sfd)
            try:
                locking.write_file(efd, MANIFEST_NAME, manifest.dumps().encode("utf-8"), mode=0o444, exclusive=True)
                lfd = fsroot.open_regular(efd, manifest.library)
                try:
                    os.fchmod(lfd, 0o555)
                finally:
                    os.close(lfd)
                os.fchmod(efd, self.mode(0o755, 0o2775))
            finally:
                os.close(efd)
            if manifest.key != manifest.base_key:
                # The marker goes first: a marker without an entry is skipped by lookups, while an
                # entry without its marker (a crash in between) would never be found again.
                self.add_variant(manifest.base_key, manifest.key)
            # The pin exists before the entry does, stamped "never hit" (atime 0): a lookup that
            # finds the entry right after the rename then counts as its first hit (Store.pin).
            pin = self._mark_never_hit(manifest.key)
            try:
                with self.at("entries", create=True) as dfd:
                    try:
                        fsroot.rename_at(sfd, entry_name, dfd, check_name(manifest.key))
                    except OSError as exc:
                        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                            _touch(pin)  # the existing entry won: it is used, not new
                            return False
                        raise
            finally:
                if pin is not None:
                    os.close(pin)
        return True

    def _mark_never_hit(self, key: str) -> int | None:
        """Open (creating) the pin of ``key`` and set its atime to :data:`NEVER_HIT_ATIME_NS`,
        its mtime to now; the fd, or ``None`` where the pin cannot be opened (a read-only root:
        only the stamp is lost)."""
        try:
            fd = self._open_pin(key)
        except OSError:
            return None
        try:
            if fsroot.own_single(os.fstat(fd)):  # explicit times need the owner anyway
                os.utime(fd, ns=(NEVER_HIT_ATIME_NS, time.time_ns()))
        except OSError:
            pass
        return fd

    def add_variant(self, base: str, key: str) -> None:
        """Record that entry ``key`` was built from base key ``base`` (with tracked headers)."""
        for attempt in (0, 1, 2):
            try:
                with self.at("variants", check_name(base), create=True) as vfd:
                    os.close(os.open(check_name(key), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     self.mode(0o600, 0o660), dir_fd=vfd))
                return
            except FileNotFoundError:
                if attempt == 2:
                    raise  # an eviction removes variants/<base>/ once empty: made again above

    def drop_entry_records(self, key: str, base: str) -> None:
        """Remove what refers to the evicted entry ``key``: its marker ``variants/<base>/<key>``
        (and ``variants/<base>/`` once empty) and its signature memo ``state/inputs-<key>.json``.
        Best-effort, through directory fds; nothing is followed."""
        if base != key:
            try:
                with self.at("variants") as vfd:
                    try:
                        with self.at("variants", check_name(base)) as bfd:
                            fsroot.unlink_at(bfd, key)
                    except OSError:
                        pass
                    try:
                        os.rmdir(base, dir_fd=vfd)  # only if empty; a link or file is left alone
                    except OSError:
                        pass
            except OSError:
                pass
        try:
            with self.at("state") as sfd:
                fsroot.unlink_at(sfd, inputs_memo_name(key))
        except OSError:
            pass

    # --- removal -----------------------------------------------------------------------------

    def _move_aside(self, key: str, area: str) -> str | None:
        name = f"{check_name(key)}-{int(time.time())}-{os.getpid()}-{os.urandom(3).hex()}"
        with self.at("entries") as efd, self.at(area, create=True) as afd:
            try:
                fsroot.rename_at(efd, key, afd, name)
            except FileNotFoundError:
                return None
        return os.path.join(self.base, area, name)

    def quarantine(self, key: str, reason: str) -> str | None:
        """Move an entry to ``quarantine/`` (kept for inspection; prune removes old ones). The
        reason is written, escaped, into a new file created in the moved directory (never through
        a link: a planted ``QUARANTINE_REASON`` symlink is not followed)."""
        reason = fsroot.printable(reason, 2000)
        dst = self._move_aside(key, "quarantine")
        if dst is not None:
            log.warning("stubcache: quarantined entry %s (%s) -> %s", key, reason, dst)
            try:
                with self.at("quarantine", os.path.basename(dst)) as qfd:
                    fsroot.unlink_at(qfd, "QUARANTINE_REASON")
                    locking.write_file(qfd, "QUARANTINE_REASON", (reason + "\n").encode(), mode=0o444, exclusive=True)
            except OSError:
                pass
        return dst

    def trash(self, key: str) -> str | None:
        """Move an entry to ``trash/`` (atomically invisible to readers); caller deletes it."""
        return self._move_aside(key, "trash")

    @staticmethod
    def rmtree(path: str) -> bool:
        """Remove a tree (or file, or link) without following links (see :func:`fsroot.rmtree`)."""
        return fsroot.rmtree(path)

    def remove_in(self, area: str, name: str) -> bool:
        """Remove ``v1/<area>/<name>``, whatever it is, through a descriptor of ``area``."""
        try:
            with self.at(area) as fd:
                return fsroot.rmtree_at(fd, name)
        except FileNotFoundError:
            return True

    # --- pins and last-used ---------------------------------------------------------------

    def pin_path(self, key: str) -> str:
        return os.path.join(self.base, "pins", key)

    def open_lock_file(self, path: str, create: bool = True) -> int:
        """Open (creating) a file used only for ``flock`` (see :func:`locking.open_lock_at`:
        ``0660`` in a shared root). ``path`` is a path below ``v1/``; it is reached through
        directory fds without following links."""
        rel = os.path.relpath(path, self.base).split(os.sep)
        with self.at(*rel[:-1], create=create) as dfd:
            return locking.open_lock_at(dfd, check_name(rel[-1]), shared=self.shared, create=create, label=path)

    def _open_pin(self, key: str) -> int:
        return self.open_lock_file(self.pin_path(key))

    def pin(self, key: str, timeout: float | None = None) -> int | None:
        """Take a shared flock on the entry's pin file and return the fd (keep it open while the
        library may be in use: the kernel drops the lock when the process dies). Also refreshes
        the last-used stamp (the pin's times, to now) when it is older than
        ``LAST_USED_RESOLUTION`` or says "never hit": one ``futimens`` on a hit.

        Waits at most ``timeout`` seconds (``None``: ``STUBCACHE_LOCK_TIMEOUT``) for an exclusive
        holder (a prune removing the entry, or anyone holding ``LOCK_EX`` on it), then returns
        ``None`` after one log line naming the holder: the caller loads without pinning."""
        deadline = None
        while True:
            pfd = self.dir("pins", create=True)
            try:
                fd = locking.open_lock_at(pfd, check_name(key), shared=self.shared, label=self.pin_path(key))
            except BaseException:
                os.close(pfd)
                raise
            try:
                if not locking.try_flock(fd, locking.SH):
                    if deadline is None:
                        if timeout is None:
                            timeout = locking.lock_timeout_from_env()
                        deadline = time.monotonic() + timeout
                    locked = locking.wait_flock(fd, locking.SH, max(deadline - time.monotonic(), 0.0))
                else:
                    locked = True
                if not locked:
                    log.warning("stubcache: the pin of entry %s is held exclusively by %s for over %.0fs; "
                                 "loading it without a pin (prune may remove it meanwhile)", key,
                                 locking.describe_holders(fd), timeout)
                    os.close(fd)
                    return None
                st = os.fstat(fd)
                try:
                    current = os.stat(key, dir_fd=pfd, follow_symlinks=False).st_ino
                except FileNotFoundError:
                    current = None
                if current != st.st_ino:
                    # prune removed this pin file while we waited: lock the one now in place
                    os.close(fd)
                    continue
                if st.st_atime_ns == NEVER_HIT_ATIME_NS or time.time() - st.st_mtime > LAST_USED_RESOLUTION:
                    _touch(fd, st)
            except OSError:
                os.close(fd)
                raise
            finally:
                os.close(pfd)
            return fd

    # --- build bookkeeping ---------------------------------------------------------------

    def lock_path(self, base: str) -> str:
        return os.path.join(self.base, "locks", f"{base}.lock")

    def lease_path(self, base: str) -> str:
        return os.path.join(self.base, "leases", f"{base}.json")

    def write_lease(self, base: str, name: str) -> None:
        info = {"pid": os.getpid(), "host": os.uname().nodename, "started": time.time(), "name": name}
        self._replace("leases", f"{base}.json", json.dumps(info).encode(), self.mode(0o600, 0o640))

    def _replace(self, area: str, name: str, data: bytes, mode: int) -> None:
        with self.at(area, create=True) as fd:
            try:
                locking.write_file(fd, name, data, mode=mode)
            except (IsADirectoryError, NotADirectoryError):
                fsroot.rmtree_at(fd, name)  # a directory planted where our file goes
                locking.write_file(fd, name, data, mode=mode)

    def _read_json(self, area: str, name: str) -> dict[str, Any] | None:
        try:
            with self.at(area) as fd:
                data = json.loads(fsroot.read_at(fd, name, fsroot.SMALL_CAP))
            return data if isinstance(data, dict) else None
        except (OSError, ValueError, RecursionError):
            return None

    def _unlink(self, area: str, name: str) -> None:
        try:
            with self.at(area) as fd:
                fsroot.unlink_at(fd, name)
        except OSError:
            pass  # best-effort cleanup: a broken layout must not turn into an engine's error

    def read_lease(self, base: str) -> dict[str, Any] | None:
        """The lease of a build, or None; values are as written by whoever wrote the file (a
        group member may have): check types and ranges before use."""
        return self._read_json("leases", f"{base}.json")

    def clear_lease(self, base: str) -> None:
        self._unlink("leases", f"{base}.json")

    def failure_path(self, base: str) -> str:
        return os.path.join(self.base, "failures", f"{base}.json")

    def record_failure(self, base: str, output: str) -> None:
        data = json.dumps({"time": time.time(), "pid": os.getpid(), "output": output[-(256 << 10):]})
        try:
            self._replace("failures", f"{base}.json", data.encode(), self.mode(0o600, 0o640))
        except OSError:
            pass  # waiters then time out or build themselves: the BuildError still reaches this caller

    def read_failure(self, base: str) -> dict[str, Any] | None:
        return self._read_json("failures", f"{base}.json")

    def clear_failure(self, base: str) -> None:
        self._unlink("failures", f"{base}.json")


class _DirCtx:
    __slots__ = ("store", "parts", "create", "fd")

    def __init__(self, store: Store, parts: tuple[str, ...], create: bool) -> None:
        self.store, self.parts, self.create, self.fd = store, parts, create, -1

    def __enter__(self) -> int:
        self.fd = self.store.dir(*self.parts, create=self.create)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_KEY_CHARS = frozenset("0123456789abcdef")
_BASE_LOCK = threading.Lock()


def _touch(fd: int | None, st: os.stat_result | None = None) -> None:
    """Set a pin's times to now (the last-used stamp): :func:`stubcache.hit.touch`."""
    if fd is None:
        return
    try:
        _touch_pin(fd, os.fstat(fd) if st is None else st)
    except OSError:
        pass


def inputs_memo_name(tag: str) -> str:
    """The name, under ``state/``, of the memo of re-checked tracked-input signatures of an entry."""
    return f"inputs-{tag}.json"


def is_key(name: str) -> bool:
    """A key is lowercase hex (16-64 characters): anything else under entries/ is not an entry."""
    return 16 <= len(name) <= 64 and _KEY_CHARS.issuperset(name)


def write_hit_record(root: str, digest: str, record: HitRecord) -> None:
    """Write ``record`` for ``digest`` under ``root``'s ``state/`` (atomically, mode ``0600``),
    for :mod:`stubcache.hit` to read. Best-effort: a root that cannot take it just keeps
    taking the full path."""
    write_state_file(root, record_name(digest), record.to_dict())


def write_state_file(root: str, name: str, data: dict[str, Any]) -> None:
    """Write ``data`` as ``root``'s ``state/<name>`` (atomically, mode ``0600``) if ``root`` is
    one the compact path acts in (:func:`stubcache.hit.open_state`): a hit record, a start
    template (:mod:`stubcache.hit.early`). Best-effort: never raises ``OSError``."""
    try:
        state_fd = open_state(root)
        if state_fd is None:
            return  # not a root the compact path acts in
        try:
            locking.write_file(state_fd, name, json.dumps(data).encode(), mode=0o600)
        finally:
            os.close(state_fd)
    except (OSError, ValueError):
        pass
