"""``StubCache``: look up, or build once per host under a per-key lock, publish, load."""

from __future__ import annotations

import errno
import os
import threading
import time

from . import _log, events, fingerprint
from .errors import BuildError, CacheMissError, IntegrityError, LockTimeoutError, StubCacheError
from .key import base_key, entry_key, preimage
from .manifest import MANIFEST_NAME, Manifest
from .spec import StubSpec
from .store import Store, default_root, file_sha256, headers_match
from .trust import check_dir, check_stat

__version__ = "0.1.0"


class Entry:
    """A published (or privately built) stub: ``key``, ``path`` of the library, ``manifest``."""

    __slots__ = ("key", "path", "manifest", "published")

    def __init__(self, key: str, path: str, manifest: Manifest, published: bool = True) -> None:
        self.key = key
        self.path = path
        self.manifest = manifest
        self.published = published

    def __repr__(self) -> str:
        return f"Entry(key={self.key!r}, path={self.path!r})"


class _Corrupt:
    __slots__ = ("key", "reason")

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class StubCache:
    """A content-addressed cache of built stubs under one root directory.

    Args:
        root: cache root; default ``STUBCACHE_DIR`` or ``platformdirs.user_cache_dir("stubcache")``.
        lock_timeout: seconds to wait for another process's build of the same key (default
            ``STUBCACHE_LOCK_TIMEOUT`` or 600). After that this process builds privately and does
            not publish.
    """

    def __init__(self, root: str | os.PathLike | None = None, *, lock_timeout: float | None = None) -> None:
        self.store = Store(os.fspath(root) if root is not None else default_root())
        self.root = self.store.root
        self._lock_timeout = lock_timeout
        self._memo: dict[str, Entry] = {}
        self._verified: dict[str, tuple] = {}
        self._pins: dict[str, int] = {}
        self._lib_fds: dict[str, int] = {}
        self._mutex = threading.RLock()
        self._root_checked = False

    # --- public API --------------------------------------------------------------------------

    def key(self, spec: StubSpec) -> str:
        """The base key of ``spec`` (the entry key, unless it tracks user headers)."""
        return base_key(spec.canonical(), self._fingerprint(spec))

    def preimage(self, spec: StubSpec) -> dict:
        """The readable inputs of the key of ``spec``."""
        return preimage(spec.canonical(), self._fingerprint(spec))

    def lookup(self, spec: StubSpec) -> Entry | None:
        """The published, verified entry for ``spec``, or ``None``. Never builds."""
        base = self.key(spec)
        found = self._lookup(spec, base)
        return found if isinstance(found, Entry) else None

    def get_or_build(self, spec: StubSpec) -> Entry:
        """Return the entry for ``spec``, building and publishing it once per host if needed.

        Raises :class:`BuildError` if the stub does not compile (nothing is published), and
        :class:`CacheMissError` on a miss when ``STUBCACHE_REQUIRE_HIT`` is set.
        """
        if not isinstance(spec, StubSpec):
            raise TypeError(f"get_or_build expects a StubSpec, got {type(spec).__name__}")
        fp = self._fingerprint(spec)
        base = spec._base_key if spec._base_key and spec._base_key[0] is fp else None
        if base is None:
            spec._base_key = (fp, base_key(spec.canonical(), fp))
        base = spec._base_key[1]
        if not spec.tracks_headers:
            memo = self._memo.get(base)
            if memo is not None:
                return memo
        with self._mutex:
            entry = self._get_or_build(spec, base)
        if not spec.tracks_headers and entry.published:
            self._memo[base] = entry
        return entry

    def load(self, spec: StubSpec):
        """``get_or_build`` and ``dlopen`` the library; returns a ``ctypes.CDLL``."""
        return self.load_entry(self.get_or_build(spec))

    def load_entry(self, entry: Entry):
        """``dlopen`` an entry's library: the very file that was checked (opened with
        ``O_NOFOLLOW``, compared by ``fstat``, loaded through ``/proc/self/fd``)."""
        import ctypes

        with self._mutex:
            fd = self._lib_fds.get(entry.path)
            if fd is None:
                fd = self._open_checked(entry)
                # The fd stays open for the life of the process: glibc matches an already-loaded
                # object by *name* first, so a reused /proc/self/fd/N would alias another library.
                self._lib_fds[entry.path] = fd
            return ctypes.CDLL(f"/proc/self/fd/{fd}")

    # --- internals ---------------------------------------------------------------------------

    def _fingerprint(self, spec: StubSpec) -> dict:
        if not self.store._ready:
            try:
                self.store.ensure()
            except OSError:
                pass  # read-only or missing root: lookups still work, builds degrade
        state = self.store.path("state")
        fp = fingerprint.base_fingerprint(state)
        if spec.cuda_sources or spec.effective_with_cuda:
            fp = dict(fp, cuda=fingerprint.cuda_fingerprint(state))
            spec._base_key = None
        return fp

    def _check_root(self) -> None:
        if self._root_checked:
            return
        for path in (self.root, self.store.base):
            try:
                check_dir(path)
            except FileNotFoundError:
                pass
        self._root_checked = True

    def _event(self, ev: str, key: str, seconds: float | None = None, **extra) -> None:
        events.record(self.store.path("events"), ev, key, seconds, **extra)

    def _get_or_build(self, spec: StubSpec, base: str) -> Entry:
        self._check_root()
        found = self._lookup(spec, base)
        if isinstance(found, Entry):
            self._event("hit", found.key, name=spec.name)
            return found
        if _env_flag("STUBCACHE_REQUIRE_HIT"):
            raise CacheMissError(
                f"STUBCACHE_REQUIRE_HIT is set and {spec!r} (key {base}) is not in the cache at "
                f"{self.root}; warm it with `stubcache warm` or unset STUBCACHE_REQUIRE_HIT"
            )
        from . import locking

        timeout = self._lock_timeout if self._lock_timeout is not None else locking.lock_timeout_from_env()
        t_wait = time.time()
        try:
            self.store.ensure()
            lock = locking.acquire(self.store, base, timeout, spec.name)
        except LockTimeoutError as exc:
            _log.warning("stubcache: %s; building privately without publishing", exc)
            self._event("lock_timeout", base, time.time() - t_wait, name=spec.name)
            return self._private_build(spec, base, reason=str(exc))
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
                _log.warning("stubcache: cache root %s is not writable (%s); building privately", self.root, exc)
                return self._private_build(spec, base, reason=str(exc))
            raise
        try:
            waited = time.time() - t_wait
            if waited > 0.05:
                self._event("wait", base, waited, name=spec.name)
            found = self._lookup(spec, base)
            if isinstance(found, Entry):
                self._event("hit", found.key, name=spec.name, after_wait=True)
                return found
            if isinstance(found, _Corrupt):
                self.store.quarantine(found.key, found.reason)
                self._event("quarantine", found.key, reason=found.reason)
            failure = self.store.read_failure(base)
            if failure and isinstance(failure.get("time"), (int, float)) and failure["time"] >= t_wait:
                raise BuildError(
                    f"error building stub {spec.name!r} (failed in pid {failure.get('pid')} while this "
                    "process waited)", output=str(failure.get("output", "")), key=base, name=spec.name)
            self.store.clear_failure(base)
            self._event("miss", base, name=spec.name)
            self.store.write_lease(base, spec.name)
            try:
                return self._build_and_publish(spec, base)
            finally:
                self.store.clear_lease(base)
        finally:
            lock.release()

    def _lookup(self, spec: StubSpec, base: str) -> "Entry | _Corrupt | None":
        keys = self.store.variant_keys(base) if spec.tracks_headers else [base]
        for key in keys:
            try:
                manifest = self.store.read_manifest(key)
            except FileNotFoundError:
                if os.path.isdir(self.store.entry_dir(key)):
                    return _Corrupt(key, "manifest missing")
                continue
            except (ValueError, OSError) as exc:
                return _Corrupt(key, f"manifest unreadable: {exc}")
            if manifest.key != key or manifest.base_key != base:
                return _Corrupt(key, "manifest describes another key")
            if spec.tracks_headers and not headers_match(manifest.headers):
                continue
            entry = Entry(key, os.path.join(self.store.entry_dir(key), manifest.library), manifest)
            try:
                self._pin(key)
                self._verify(entry)
            except FileNotFoundError:
                continue  # removed under us (prune): a miss, rebuild
            except IntegrityError as exc:
                return _Corrupt(key, str(exc))
            return entry
        return None

    def _pin(self, key: str) -> None:
        if key not in self._pins:
            self._pins[key] = self.store.pin(key)

    def _open_checked(self, entry: Entry) -> int:
        fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            check_stat(st, entry.path, "library")
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if self._verified.get(entry.key) != ident:
                if st.st_size != entry.manifest.size or file_sha256(fd) != entry.manifest.sha256:
                    raise IntegrityError(f"checksum mismatch for {entry.path}")
                self._verified[entry.key] = ident
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _verify(self, entry: Entry) -> None:
        """Checksum (first time per process), trust checks and a whole-entry shape check."""
        if entry.key in self._verified:
            return
        edir = os.path.dirname(entry.path)
        check_dir(edir, "cache entry")
        names = set(os.listdir(edir))
        expected = {MANIFEST_NAME, entry.manifest.library}
        if names != expected:
            raise IntegrityError(f"entry has unexpected files {sorted(names ^ expected)}")
        os.close(self._open_checked(entry))

    def _manifest_for(self, spec: StubSpec, base: str, result, sha: str, size: int) -> Manifest:
        key = entry_key(base, result.headers)
        return Manifest(
            key=key, base_key=base, name=spec.name, module_name=result.module_name,
            library=os.path.basename(result.library), sha256=sha, size=size,
            preimage=preimage(spec.canonical(), self._fingerprint(spec)), headers=result.headers,
            build_method=result.method, build_seconds=round(result.seconds, 6), build_log=result.log,
            created=time.time(), stubcache_version=__version__,
        )

    def _build_and_publish(self, spec: StubSpec, base: str) -> Entry:
        from .builder import build

        staging = self.store.new_staging(base)
        try:
            build_dir = os.path.join(staging, "build")
            os.mkdir(build_dir, 0o700)
            try:
                result = build(spec, build_dir)
            except BuildError as exc:
                exc.key = base
                self.store.record_failure(base, exc.output or str(exc))
                self._event("fail", base, name=spec.name)
                raise
            staged_entry = os.path.join(staging, "entry")
            os.mkdir(staged_entry, 0o700)
            lib = os.path.join(staged_entry, os.path.basename(result.library))
            os.rename(result.library, lib)
            manifest = self._manifest_for(spec, base, result, file_sha256(lib), os.path.getsize(lib))
            self.store.publish(staged_entry, manifest)  # False: an existing entry won
            self._event("build", manifest.key, result.seconds, name=spec.name, method=result.method)
            found = self._lookup(spec, base)
            if not isinstance(found, Entry):
                raise StubCacheError(f"entry {manifest.key} vanished right after publishing")
            return found
        finally:
            self.store.rmtree(staging)

    def _private_build(self, spec: StubSpec, base: str, reason: str) -> Entry:
        """Build in a private temporary directory, load from there, never publish."""
        import atexit
        import tempfile

        from .builder import build

        tmp = tempfile.mkdtemp(prefix="stubcache-private-")
        atexit.register(Store.rmtree, tmp)
        build_dir = os.path.join(tmp, "build")
        os.mkdir(build_dir, 0o700)
        result = build(spec, build_dir)
        manifest = self._manifest_for(spec, base, result, file_sha256(result.library),
                                      os.path.getsize(result.library))
        self._event("private_build", manifest.key, result.seconds, name=spec.name, reason=reason)
        entry = Entry(manifest.key, result.library, manifest, published=False)
        self._verified[manifest.key] = ()  # built by us just now; _open_checked re-hashes on load
        return entry
