"""The cache behind :class:`stubcache.StubCache`: look up, or build once per host under a per-key
lock, publish, load (:class:`CacheCore`). ``StubCache`` itself (:mod:`stubcache.hit.front`) answers a
warm ``load`` through the compact hit path and hands everything else to a ``CacheCore``."""

from __future__ import annotations

import ctypes  # every user loads a library; importing it here keeps ~1 ms off the first call
import errno
import os
import time
import threading

from ..storage import events
from ..edge import faults, fsroot, log, settings
from .. import hit
from ..key.fingerprint import Fingerprint
from ..edge.errors import (BuildError, CacheMissError, IntegrityError, LockTimeoutError, StubCacheError,
                           TrustError, UntrustedRootError)
from ..storage.events import Event
from ..key.derive import base_key, entry_key, preimage
from ..storage.manifest import MANIFEST_NAME, Manifest, __version__
from ..storage.mapped import check_mapped
from ..key import StubSpec
from ..key.inputs import CLOCK_SLACK_NS, absent_paths, still_valid
from ..storage.store import LAYOUT, Store, default_root, file_sha256, inputs_memo_name, write_hit_record, write_state_file
from ..storage.trust import TrustPolicy, check_dir, loader_policy, private_policy

TYPE_CHECKING = False  # typing is not imported on the hit path
if TYPE_CHECKING:
    from typing import Any, Callable

    from ..build.builder import BuildResult, Started
    from ..hit.early import Begun
    from ..remote.config import RemoteConfig
    from ..remote.tier import Claim, Fetched, RemoteTier
    from ..storage.locking import Lock



# errno values that mean "this root cannot take a build right now": degrade to a private build.
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EFBIG,
               errno.ENOENT, errno.ENOTDIR)
_warned_degraded: set[str] = set()  # roots this process has already warned about

# Descriptors are per process, not per StubCache: many instances on one root share one pin per
# entry and one open library per file, so creating instances does not leak descriptors.
# They are the hit layer's tables: a hit through a record (stubcache.hit) and this path share them.
_PROCESS_LOCK = hit.PROCESS_LOCK
_PINS = hit.PINS
_LIB_FDS = hit.LIB_FDS
_REAL_PATHS = hit.REAL_PATHS  # entry path -> the real path it was first loaded by
_VERIFIED = hit.VERIFIED
_BASE_KEYS_MAX = 64  # specs whose base key a cache remembers (see StubCache._base_key)


class Entry:
    """A published (or privately built) stub: ``key``, ``path`` of the library, ``manifest``.

    ``published`` is False for a private build (lock timeout, unwritable root); ``seed`` is True
    for an entry served from a read-only ``STUBCACHE_SEED_DIRS`` store; ``fetched`` is True when
    this process downloaded it from the fleet tier and published it here (no local compile).
    """

    __slots__ = ("key", "path", "manifest", "published", "seed", "root", "fetched")

    def __init__(self, key: str, path: str, manifest: Manifest, published: bool = True, seed: bool = False,
                 root: str | None = None) -> None:
        self.key = key
        self.path = path
        self.manifest = manifest
        self.published = published
        self.seed = seed
        self.root = root  # the store it came from (its trust policy applies); None: private build
        self.fetched = False

    def __repr__(self) -> str:
        return f"Entry(key={self.key!r}, path={self.path!r})"


class CorruptEntry:
    """A lookup's third answer, beside an :class:`Entry` (a hit) and ``None`` (nothing there): an
    entry directory whose contents cannot be used (quarantine it). It has no truth value, so
    ``if found:`` cannot take it for a hit nor ``if not found:`` for a miss by accident."""

    __slots__ = ("key", "reason")

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason

    def __bool__(self) -> bool:
        raise TypeError("a corrupt entry is neither a hit nor a miss: test isinstance(found, Entry)")


def seed_roots() -> list[str]:
    """The read-only stores named by ``STUBCACHE_SEED_DIRS`` (``os.pathsep``-separated)."""
    return [os.path.abspath(p) for p in settings.path_list(settings.SEED_DIRS)]


def _remote_config() -> RemoteConfig | None:
    """The remote-tier settings if ``STUBCACHE_REMOTE`` is set (checked now: a misconfiguration
    is an error at start-up), else ``None``. Imports neither the client nor the network."""
    if not settings.remote_configured():
        return None
    from ..remote.config import config_from_env

    return config_from_env()


def _unchanged_inputs(headers: dict[str, str], inputs: dict[str, Any] | None,
                      memo_path: str | None) -> tuple[list[Any], list[Any]] | None:
    """An entry's tracked inputs as a hit record checks them (see :class:`stubcache.hit.HitRecord`):
    each file with its signature now, where that signature is one :func:`inputs.still_valid`
    accepts without reading the file (the manifest's, or one this root remembers as re-hashed
    and unchanged); ``None`` if any file's is not."""
    from ..key.inputs import known_hashes, read_sig_memo, signature

    try:
        sigs = (inputs or {}).get("sigs") or {}
        memo = None
        tracked = []
        for path, digest in headers.items():
            sig = signature(os.stat(path))
            if sigs.get(path) != sig:
                seen = known_hashes.get(path)
                if seen is None or seen != (sig, digest):
                    if memo is None:
                        memo = read_sig_memo(memo_path)
                    if memo.get(path) != sig:
                        return None
            tracked.append([path, sig])
        shadows = shadow_rows((inputs or {}).get("shadows") or {})
    except (OSError, TypeError, ValueError, AttributeError):
        return None
    return tracked, shadows


def shadow_rows(shadows: dict[str, Any]) -> list[Any]:
    """A ``{directory: [signature, names]}`` shadow record (an entry's shadowing headers, the
    fingerprint memo's import path directories) as a hit record's ``shadows`` rows."""
    return [[d, dsig, list(names)] for d, (dsig, names) in shadows.items()]


class Speculation:
    """A direct compile started while the compiler was probed, before the key was known.

    On a fresh host the probe (a dozen programs run, cc1plus hashed) comes before the key, the
    lookup and the build lock. As soon as the probe knows the build command's facts
    (``probing`` in :meth:`stubcache.key.fingerprint.Fingerprint.base`), :meth:`start` begins
    the compile in a staging directory of its own; a miss's build takes it over if it would run
    that very command (:func:`stubcache.build.builder.build`), and anything else (a hit, a
    failed lookup, a private or degraded build, an exception) discards it (:meth:`discard`): the compiler's
    whole session killed, the directory removed. Only the process that probes starts one (others
    wait for its answer), and only in a root this user trusts privately: nothing is written
    before the root is checked. The process keeps the probe's memo lock, and writes the probe's
    and the fingerprint's memos (:meth:`hold`, :meth:`defer`), only once it has its key's build
    lock or finds it held (:meth:`release_memo_lock`): the processes that waited for the probe
    then find the key taken, and wait for this build rather than compile it beside it."""

    __slots__ = ("core", "spec", "started", "tried", "memo_lock", "pending")

    def __init__(self, core: CacheCore, spec: StubSpec) -> None:
        self.core = core
        self.spec = spec
        self.started: Started | None = None
        self.tried = False
        self.memo_lock: int | None = None
        self.pending: list[Callable[[], None]] = []  # memo writes, made when the lock is let go

    def hold(self, fd: int, write: Callable[[], None]) -> bool:
        if self.started is None or self.memo_lock is not None:
            return False
        self.memo_lock = fd
        self.pending.append(write)
        return True

    def defer(self, write: Callable[[], None]) -> bool:
        if self.memo_lock is None:
            return False
        self.pending.append(write)
        return True

    def release_memo_lock(self) -> None:
        fd, self.memo_lock = self.memo_lock, None
        pending, self.pending = self.pending, []
        try:
            for write in pending:
                write()  # (best-effort writes: memofile.write_json never raises OSError)
        finally:
            if fd is not None:
                os.close(fd)

    def start(self, facts: dict[str, Any]) -> None:
        if self.tried:
            return
        self.tried = True
        core = self.core
        try:
            if self.pointless(core):
                return
            staging = core.store.new_staging(os.urandom(8).hex())  # no key yet: a name no lock holds
            try:
                build_dir = os.path.join(staging, "build")
                fsroot.mkdir_mode(build_dir, 0o700)
                from ..build.builder import start_direct

                self.started = start_direct(self.spec, build_dir, facts)
                self.started.staging = staging
                log.debug("stubcache: %s: compiling early, while the toolchain is probed", self.spec.name)
            except BaseException:
                core.store.rmtree(staging)
                raise
        except Exception as exc:  # noqa: BLE001 - a head start is never worth failing a probe for
            log.debug("stubcache: %s: no compile during the probe: %r", self.spec.name, exc)

    @staticmethod
    def pointless(core: CacheCore) -> bool:
        """Whether no compile should start early in ``core``'s root: a verbose build (it shows
        its one compile's command and output), a shared root, or one that has entries (a probe
        runs again there after a change of the environment or the toolchain, and the lookup may
        well hit). Raises what checking the root raises."""
        from ..edge import progress

        return progress.verbose() or core._trusted_policy(core.store.root).shared or bool(core.store.entry_keys())

    def take(self) -> Started | None:
        """The started compile, now the caller's (see :func:`stubcache.build.builder.build`)."""
        started, self.started = self.started, None
        return started

    def discard(self) -> None:
        started, self.started = self.started, None
        try:
            if started is not None:
                started.stop()
                if started.staging is not None:
                    self.core.store.rmtree(started.staging)
        finally:
            self.release_memo_lock()


SIZE_CAP_DELAY = 0.5  # seconds the size cap's helper thread waits: a starting herd loads first


def _unexpressed() -> str:
    from ..key.tracking import UNEXPRESSED  # (imported by every build, but not by a lookup)

    return UNEXPRESSED


def _private_dir() -> str:
    """A new private temporary directory for a library that is loaded but never published,
    removed when the process exits."""
    import atexit
    import tempfile

    tmp = tempfile.mkdtemp(prefix="stubcache-private-")
    atexit.register(Store.rmtree, tmp)
    return tmp


def start_size_cap(store: Store) -> None:
    """Run :func:`stubcache.admin.sizecap.after_publish` on a helper thread, after
    ``SIZE_CAP_DELAY``, so that the process that built the stub (and the herd that waited for it)
    load without competing with the prune for the CPU or the GIL; the size cap's module is imported
    there too (its import is ~1.5 ms of a cold build otherwise). The thread is not a daemon, so a
    process that exits at once still finishes (at most the delay and the time box) rather than
    stopping mid-way."""

    def run() -> None:
        time.sleep(SIZE_CAP_DELAY)
        from ..admin import sizecap

        sizecap.after_publish(store)

    threading.Thread(target=run, name="stubcache-sizecap").start()


def _require_hit_error(spec: StubSpec, base: str, root: str) -> CacheMissError:
    return CacheMissError(
        f"STUBCACHE_REQUIRE_HIT is set and {spec!r} (key {base}) is in neither the cache at "
        f"{root} nor a seed store{' nor the remote cache' if os.environ.get('STUBCACHE_REMOTE') else ''}; "
        "warm it with `stubcache warm` or unset STUBCACHE_REQUIRE_HIT")


def checked_loader_policy(root: str) -> TrustPolicy | None:
    """The trust policy for loading from the cache root ``root`` as this user, after checking the
    root, its ``v1/`` and ``v1/entries/`` directories by it; ``None`` if the root does not exist
    (yet). Raises :class:`UntrustedRootError` if this user has not chosen to trust the root, or if it
    is unsafe (a link, writable by others, a bad config): not an error for an engine, a root it
    does not use."""
    try:
        os.lstat(root)
    except OSError:
        return None  # missing (created on first build) or unreachable (degrades)
    try:
        policy = loader_policy(root)
        base = os.path.join(root, LAYOUT)
        for path in (root, base, os.path.join(base, "entries")):
            try:
                check_dir(path, "cache directory", policy)
            except FileNotFoundError:
                pass
    except UntrustedRootError:
        raise
    except TrustError as exc:
        raise UntrustedRootError(str(exc), "fix it as the message says, or run `stubcache doctor --fix`") from None
    return policy


class CacheCore:
    """A content-addressed cache of built stubs under one root directory: the whole of
    :class:`stubcache.StubCache` (its arguments and settings are documented there), which makes
    one on the first call its hit path cannot answer."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, lock_timeout: float | None = None,
                 seeds: list[str] | None = None) -> None:
        from ..edge.settings import validate

        validate()  # every STUBCACHE_* setting: a bad one raises SettingsError now, not on a miss
        root = os.path.abspath(os.fspath(root) if root is not None else default_root())
        self._policies: dict[str, TrustPolicy] = {}
        self._untrusted: dict[str, UntrustedRootError] = {}
        self.store = Store(root, self._policy_for_new_store(root))
        self.root = self.store.root
        # Read-only stores: nothing is created there, so they need no policy for modes; their
        # trust is checked where an entry is found (see _check_entry).
        self.seeds = [Store(s) for s in (seed_roots() if seeds is None else seeds)]
        # The toolchain fingerprint, memoised in this root's state/ directory.
        self.fingerprint = Fingerprint(self.store.path("state"))
        self._lock_timeout = lock_timeout
        self._memo: dict[str, Entry] = {}
        # Base keys of specs this cache has seen (see _base_key): the last one, then by id(spec).
        self._last_key: tuple[StubSpec | None, dict[str, Any] | None, str] = (None, None, "")
        self._base_keys: dict[int, tuple[StubSpec, dict[str, Any], str]] = {}
        self._verified = _VERIFIED
        self._pins = _PINS
        self._lib_fds = _LIB_FDS
        self._cap_pending = False  # this instance published: check the size cap after the locks
        self._mutex = _PROCESS_LOCK
        self._key_locks: dict[str, threading.Lock] = {}
        # The fleet tier (docs/remote.md): settings checked now, client made on the first miss.
        self._remote_config = _remote_config()
        self._remote: RemoteTier | None = None
        # A direct build's start template waits until the request it served has its hit record
        # (leave_start_template): a process that finds the template finds the record too.
        self._template_due = False

    # --- public API --------------------------------------------------------------------------

    def key(self, spec: StubSpec) -> str:
        """The base key of ``spec`` (the entry key, unless it tracks user headers)."""
        return base_key(spec.canonical(), self._fingerprint(spec))

    def preimage(self, spec: StubSpec) -> dict[str, Any]:
        """The readable inputs of the key of ``spec``."""
        return preimage(spec.canonical(), self._fingerprint(spec))

    def lookup(self, spec: StubSpec) -> Entry | None:
        """The published, verified entry for ``spec`` (seeds first), or ``None``. Never builds."""
        found = self._find_in_stores(spec, self.key(spec))
        return found if isinstance(found, Entry) else None

    def get_or_build(self, spec: StubSpec) -> Entry:
        """Return the entry for ``spec``, building and publishing it once per host if needed.

        Raises :class:`BuildError` if the stub does not compile (nothing is published),
        and :class:`CacheMissError` on a miss when ``STUBCACHE_REQUIRE_HIT`` is set. A root this
        user does not trust (see docs/security.md) gives one warning and private builds; an entry
        that fails the trust checks is never loaded: it is quarantined and rebuilt.
        """
        try:
            return self.get_or_build_since(spec, None)
        finally:
            self.leave_start_template()

    def get_or_build_since(self, spec: StubSpec, since: float | None, begun: Begun | None = None) -> Entry:
        """:meth:`get_or_build` for a caller that has been waiting for this request since
        ``since`` (a ``time.time()``; :class:`stubcache.hit.front.StubCache` waits for another
        process serving the same request): that time counts against the lock timeout, and a
        build failure recorded since then is raised, not built again (invariants 8 and 11).
        ``begun``: this request's compile, begun by the compact path (:mod:`stubcache.hit.early`):
        a miss's build takes it over if it is that build's command, and it is stopped otherwise.
        The caller leaves the start template afterwards (:meth:`remember_hit` or
        :meth:`leave_start_template`)."""
        if not isinstance(spec, StubSpec):
            if begun is not None:
                begun.discard()
            raise TypeError(f"get_or_build expects a StubSpec, got {type(spec).__name__}")
        made: list[Speculation] = []  # (made only where the fingerprint is computed: see _fingerprint)
        handed = self._handed(spec, begun) if begun is not None else None

        def probing() -> Speculation | None:
            if handed is not None:
                return None  # the compile has begun already
            speculation = self._speculation(spec)
            if speculation is not None:
                made.append(speculation)
            return speculation

        try:
            fp = self._fingerprint(spec, probing)
            if made and made[0].started is not None:
                faults.point("probed")
            last = self._last_key
            base = last[2] if last[0] is spec and last[1] is fp else self._base_key(spec, fp)
            if not spec.tracks_headers:
                memo = self._memo.get(base)
                if memo is not None:
                    return memo
            speculation = made[0] if made else handed
            key_lock = self._key_lock(base)  # threads of this process: one build per key, others proceed
            if not key_lock.acquire(blocking=False):
                if speculation is not None:
                    speculation.discard()  # another thread is at this key: its build, or its hit
                key_lock.acquire()
            try:
                entry = self._get_or_build(spec, base, since, speculation)
            finally:
                key_lock.release()
        finally:
            for speculation in made:
                speculation.discard()
            if handed is not None:
                handed.discard()
        if self._cap_pending:  # after a publish, with every lock released; never after a hit
            self._cap_pending = False
            start_size_cap(self.store)
        if not spec.tracks_headers:
            self._memo[base] = entry  # private builds too: one per process is enough
        return entry

    def loaded_path(self, entry: Entry) -> str:
        """Load ``entry`` (verified, see :meth:`load_entry`) and return the path it was loaded by.
        Hand it to APIs that ``dlopen`` by path, such as
        ``torch.cuda.memory.CUDAPluggableAllocator`` or ``torch.ops.load_library``: glibc matches
        the name and returns the same, already checked handle and state, even if the entry has
        since been removed or replaced on disk."""
        self.load_entry(entry)
        return _REAL_PATHS[entry.path]  # the name load_entry loaded and checked it by

    def load(self, spec: StubSpec) -> ctypes.CDLL:
        """``get_or_build`` and ``dlopen`` the library; returns a ``ctypes.CDLL``."""
        return self.load_entry(self.get_or_build(spec))

    def load_entry(self, entry: Entry) -> ctypes.CDLL:
        """``dlopen`` an entry's library by its real path, after checking the file (opened with
        ``O_NOFOLLOW``, checksummed through that descriptor); then the file the loader mapped is
        compared with that descriptor's (device, inode), and refused on a mismatch."""
        with self._mutex:
            fd = self._lib_fds.get(entry.path)
            if fd is None:
                fd = self._open_checked(entry)
                self._lib_fds[entry.path] = fd
            # By the real path: the name torch.ops.load_library (it calls os.path.realpath) and
            # symbolizers use, so glibc matches it to this checked handle rather than mapping
            # whatever file is at that path by then (a root reached through a symlink).
            # Resolved once per process: a later load by that name gets glibc's handle for the
            # file checked below, and repeated hits skip realpath's lstat per path component.
            real = _REAL_PATHS.get(entry.path)
            if real is None:
                real = _REAL_PATHS[entry.path] = os.path.realpath(entry.path)
            lib = ctypes.CDLL(real)
            try:
                check_mapped(real, os.fstat(fd), entry.manifest.sha256, lib._handle, fd)
            except IntegrityError:
                import _ctypes

                _ctypes.dlclose(lib._handle)
                raise
            return lib

    def remember_hit(self, spec: StubSpec, entry: Entry, digest: str) -> bool:
        """Leave a hit record (:mod:`stubcache.hit`) for the request named ``digest``, whose
        spec is ``spec`` and which this cache just served with ``entry``, if such a record can
        answer it: a published direct build from this root whose tracked inputs are all
        unchanged by signature right now, a spec whose key needs only the base fingerprint, no
        seed stores or remote tier, and a root this user trusts privately. True if a record was
        written. Never fails the load that called it: a record is only a shortcut. Then the
        start template of a direct build this served, if any (:meth:`leave_start_template`)."""
        try:
            return self._remember_hit(spec, entry, digest)
        except Exception as exc:  # noqa: BLE001 - a missing shortcut must not fail an engine's start
            log.logger().debug("stubcache: no hit record for %s: %r", entry.key, exc)
            return False
        finally:
            self.leave_start_template()

    def _remember_hit(self, spec: StubSpec, entry: Entry, digest: str) -> bool:
        m = entry.manifest
        if (not entry.published or entry.seed or entry.root != self.root or self.seeds
                or self._remote_config is not None or m.build_method != "direct"
                or spec.tracks_headers or spec.cuda_sources
                or spec.effective_with_cuda or spec.host_targets or spec.tool_flags):
            return False
        policy = self._policies.get(self.root)
        if policy is None or policy.shared or not self.store.ready:
            return False
        from ..key.fingerprint import env_from_snapshot, env_snapshot, fast_memo_path
        from ..key.memofile import load_json

        fp = self.fingerprint.base()
        try:
            memo = load_json(fast_memo_path(self.store.path("state"), env_from_snapshot(env_snapshot())))
            if (memo["fp"] != fp or not isinstance(memo["validators"], list) or not isinstance(memo["shadows"], dict)
                    or memo["torch_dir"] != self.fingerprint.torch_dir()):
                return False
            memo_shadows = shadow_rows(memo["shadows"])
            manifest_sig = hit.sig(os.lstat(os.path.join(self.store.entry_dir(entry.key), MANIFEST_NAME)))
        except (OSError, ValueError, KeyError, TypeError):
            return False
        tracked = _unchanged_inputs(m.headers, m.inputs, self._sig_memo(self.store, entry.key))
        if tracked is None:
            return False
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # stubcache/
        code = [os.path.join(package, *rel.split("/")) for rel in hit.KEY_MODULE_FILES]
        record = hit.HitRecord(
            key=entry.key, base=m.base_key, name=spec.name, library=m.library, sha256=m.sha256, size=m.size,
            manifest=manifest_sig, env=hit.key_env_rows(),
            validators=list(memo["validators"]) + [[p, hit.path_sig(p)] for p in code],
            tracked=tracked[0], shadows=tracked[1] + memo_shadows, torch=memo["torch_dir"])
        if hit.HitRecord.from_dict(record.to_dict()) is None:  # a value it would refuse to read
            return False
        write_hit_record(self.root, digest, record)
        return True

    # --- internals ---------------------------------------------------------------------------

    def _base_key(self, spec: StubSpec, fp: dict[str, Any]) -> str:
        """The base key of ``spec`` under the fingerprint ``fp``, remembered for this very spec
        object (a spec is immutable) while the fingerprint is the same object.

        get_or_build first checks the last spec (one tuple read, as cheap as the attribute on
        the spec that this memo replaces), then this memo, by ``id``: hashing a spec would hash
        its sources, and each memo entry holds its spec, so the id is not reused meanwhile. At
        most ``_BASE_KEYS_MAX`` specs are kept: a caller that makes a new spec per call (the
        ``load_inline`` drop-in) gains nothing from it, and must not make the memo grow."""
        known = self._base_keys.get(id(spec))
        if known is None or known[0] is not spec or known[1] is not fp:
            known = (spec, fp, base_key(spec.canonical(), fp))
            if len(self._base_keys) >= _BASE_KEYS_MAX:
                self._base_keys.clear()
            self._base_keys[id(spec)] = known
        self._last_key = known
        return known[2]

    def _key_lock(self, base: str) -> threading.Lock:
        lock = self._key_locks.get(base)
        if lock is None:
            with self._mutex:
                lock = self._key_locks.setdefault(base, threading.Lock())
        return lock

    def _fingerprint(self, spec: StubSpec, probing: Callable[[], Speculation | None] | None = None) -> dict[str, Any]:
        # ``probing``: see Fingerprint.base (get_or_build's Speculation, made only if needed).
        if not self.store.ready:
            try:
                self.store.ensure()
            except OSError:
                pass  # read-only or missing root: lookups still work, builds degrade
        fp = self.fingerprint.base(probing)
        if spec.cuda_sources or spec.effective_with_cuda:
            fp = dict(fp, cuda=self.fingerprint.cuda())
        if spec.host_targets:
            fp = dict(fp, native=self.fingerprint.native_target(spec.host_targets))
        if spec.tool_flags:
            fp = dict(fp, tools=self.fingerprint.flag_tools(spec.tool_flags))
        return fp

    def _lock_timeout_s(self) -> float:
        from ..storage import locking

        return self._lock_timeout if self._lock_timeout is not None else locking.lock_timeout_from_env()

    def _policy_for_new_store(self, root: str) -> TrustPolicy | None:
        """The policy the local store is made with (its files' modes): the root's as it is now;
        ``None`` (private modes) for a root that is not trusted or cannot be checked. Nothing is
        remembered: whether the root is trusted is decided where it is first used
        (:meth:`_trusted_policy`), which may be long after start-up, and a root made, shared,
        fixed or spoilt meanwhile is judged as it is then."""
        try:
            return checked_loader_policy(root)
        except (TrustError, OSError):
            return None

    def _trusted_policy(self, root: str) -> TrustPolicy:
        """The trust policy of a root, after checking its root directories (once per process,
        see :func:`checked_loader_policy`). Raises :class:`UntrustedRootError` if this user has not chosen to
        trust the root; a missing root gets the private policy and is checked again next time."""
        policy = self._policies.get(root)
        if policy is None:
            known = self._untrusted.get(root)
            if known is not None:
                raise known
            try:
                policy = checked_loader_policy(root)
            except UntrustedRootError as exc:
                self._untrusted[root] = exc
                raise
            if policy is None:
                return private_policy()
            self._policies[root] = policy
            if root == self.store.root and policy.shared != self.store.shared:
                # Shared (or no longer) since this cache was made: what it creates from now on
                # gets the modes of the root it trusts.
                self.store = Store(root, policy)
        return policy

    def _event(self, ev: str, key: str, seconds: float | None = None, **extra: object) -> None:
        """Record an :class:`~stubcache.storage.events.Event` in this root (``None`` values left out)."""
        extra = {k: v for k, v in extra.items() if v is not None}
        events.record(self.store.path("events"), ev, key, seconds,
                      file_mode=events.file_mode(self.store.shared), **extra)

    # --- get_or_build, step by step: look up, wait, look again, build, publish; or degrade ------

    def _handed(self, spec: StubSpec, begun: Begun) -> Speculation | None:
        """``begun`` as a :class:`Speculation` this call's build may take over: the source it
        compiles is ``spec``'s, its directory is in this store's ``staging/``, and ``spec`` is one
        whose compile may begin before its key is known (:meth:`_may_begin`); else (or if the
        compile was taken or stopped already) it is stopped and ``None`` returned."""
        try:
            fits = (begun.source == "\n".join(spec.cpp_sources) and self._may_begin(spec)
                    and os.path.dirname(begun.staging) == os.path.join(self.store.base, "staging"))
        except BaseException:
            begun.discard()
            raise
        proc = begun.take() if fits else None
        if proc is None:
            begun.discard()
            return None
        speculation = Speculation(self, spec)
        speculation.tried = True  # (nothing to start: this is its compile)
        try:
            from ..build.builder import Started
            from ..hit.early import ORIGIN

            speculation.started = Started(proc, begun.cmd, begun.build_dir, begun.started_ns, begun.staging, ORIGIN)
        except BaseException:
            begun.proc = proc
            begun.discard()
            raise
        return speculation

    def leave_start_template(self) -> None:
        """After a direct build, once the request it served has its hit record (or none can be
        left): this environment's start template in a private root, from which the next
        process's first call of a plain stub new here starts its compile before the lookup
        (:mod:`stubcache.hit.early`, which begins none where the call's record exists: in that
        order, a process that sees the template of a build that served its very call sees that
        call's record too). Never fails: a template is only a shortcut."""
        if not self._template_due:
            return
        self._template_due = False
        policy = self._policies.get(self.root)
        if (policy is None or policy.shared or not self.store.ready or self.seeds or self._remote_config is not None
                or self.fingerprint.read_only):
            return
        try:
            from ..build.builder import start_template
            from ..hit import early
            from ..key.fingerprint import torch_dir

            digest = early.template_digest()
            if digest is None:
                return
            template = early.StartTemplate(start_template(self.fingerprint.compiler_facts()), hit.key_env_rows(),
                                           torch_dir()).to_dict()
            state_fd = hit.open_state(self.root)
            if state_fd is None:
                return
            try:
                there = early.read_template(state_fd, digest)
            finally:
                os.close(state_fd)
            if there is None or there.to_dict() != template:  # (a write costs a file and a rename)
                write_state_file(self.root, early.template_name(digest), template)
        except Exception as exc:  # noqa: BLE001 - a missing shortcut must not fail a build
            log.logger().debug("stubcache: no start template: %r", exc)

    def _may_begin(self, spec: StubSpec) -> bool:
        """Whether ``spec``'s compile may begin before its key is known (see :class:`Speculation`
        and :mod:`stubcache.hit.early`): a plain direct build in a root that builds (no seeds,
        fleet or ``STUBCACHE_REQUIRE_HIT``, which may not build here)."""
        if (spec.build_method != "direct" or spec.cuda_sources or spec.effective_with_cuda or spec.host_targets
                or spec.tool_flags or self.seeds or self._remote_config is not None or self.fingerprint.read_only):
            return False
        try:
            return not settings.require_hit()
        except StubCacheError:
            return False  # the lookup reports it

    def _speculation(self, spec: StubSpec) -> Speculation | None:
        """Where a probe of the compiler may run before ``spec``'s key is known (a fresh host),
        the compile that a miss would run can start as soon as the probe knows the command
        (:class:`Speculation`): for a plain direct build in a root that builds (no seeds, fleet or
        ``STUBCACHE_REQUIRE_HIT``, which may not build here)."""
        if not self._may_begin(spec):
            return None
        try:
            # Asked again when the probe has the facts; asked now too, because a probe with a
            # compile to start defers its hashes until it has started (key.toolchain).
            if Speculation.pointless(self):
                return None
        except Exception:  # noqa: BLE001 - the lookup reports a root it cannot use
            return None
        return Speculation(self, spec)

    def _get_or_build(self, spec: StubSpec, base: str, since: float | None = None,
                      speculation: Speculation | None = None) -> Entry:
        """The steps of :meth:`get_or_build` once the key is known (under this process's lock for
        it): look up; on a miss wait for the key's build lock, look again, then build (or fetch
        from the fleet) and publish. A root that cannot be used (not trusted, not writable, its
        lock held past the timeout) degrades to a private build. ``since``: see
        :meth:`get_or_build_since`."""
        t_start = time.time()
        if since is not None:
            t_start = min(t_start, since)
        try:
            found = self._first_look(spec, base)
        except UntrustedRootError as exc:
            if speculation is not None:
                speculation.discard()
            return self._untrusted_root(spec, base, exc)
        if found is not None:
            return found
        log.debug("stubcache: %s: not in the cache (key %s)", spec.name, base)
        require_hit = settings.require_hit()
        if require_hit and self._remote_config is None:
            raise _require_hit_error(spec, base, self.root)
        # One bound for the whole start: time already spent waiting for a pin counts against it.
        timeout = max(self._lock_timeout_s() - (time.time() - t_start), 0.0)
        t_wait = time.time()
        try:
            lock = self._wait(spec, base, timeout, t_wait, speculation)
        except (LockTimeoutError, OSError) as exc:
            if speculation is not None:
                speculation.discard()  # (before a private build: it builds elsewhere)
            if isinstance(exc, LockTimeoutError):
                return self._lock_timed_out(spec, base, exc, t_wait)
            if exc.errno in _UNWRITABLE:
                return self._degraded(spec, base, exc)
            raise
        if speculation is not None:
            speculation.release_memo_lock()
        if isinstance(lock, Entry):
            return lock  # published by another process while this one waited
        try:
            faults.point("build_lock_taken")
            # A failure recorded since this request began waiting is this wait's (``since``).
            found = self._look_again(spec, base, t_wait, t_wait if since is None else min(t_wait, since),
                                     lock.contended)
            if found is not None:
                return found
            self._event(Event.MISS, base, name=spec.name)
            return self._build(spec, base, timeout, t_wait, require_hit, speculation)
        finally:
            lock.release()

    def _first_look(self, spec: StubSpec, base: str) -> Entry | None:
        """Look up: the seed stores, then this root, after checking that this user trusts it
        (:class:`UntrustedRootError` if not). Records a hit; ``None`` on a miss (a corrupt entry is
        left to :meth:`_look_again`, under the key's lock)."""
        self._trusted_policy(self.store.root)  # checks the root (once)
        found = self._find_in_stores(spec, base)
        if not isinstance(found, Entry):
            return None
        if not hit.counted_here(self.root, found.key):  # (counted once, through its record)
            self._event(Event.HIT, found.key, name=spec.name, seed=found.seed or None)
        return found

    def _wait(self, spec: StubSpec, base: str, timeout: float, t_wait: float,
              speculation: Speculation | None = None) -> "Entry | Lock":
        """Wait, at most ``timeout`` seconds, for the key's build lock. Returns the held lock, or
        the entry if another process published it meanwhile (a hit after the wait, without
        queueing on the lock). Raises :class:`LockTimeoutError` past the bound, ``OSError`` where
        the root cannot take a lock. A ``speculation``'s memo lock is let go once the build lock
        is found held: others need not wait for this wait."""
        from ..storage import locking

        def published() -> bool:
            if speculation is not None:
                speculation.release_memo_lock()
            return bool(self.store.variant_keys(base)) or os.path.isdir(self.store.entry_dir(base))

        self.store.ensure()
        from ..edge import progress

        with progress.status(lambda: f"waiting for {locking.describe_holder(self.store, base)}"):
            lock = locking.acquire(self.store, base, timeout, spec.name, published)
        if lock is None:  # published while we waited: a plain lookup, no lock queue
            found = self._find_in_store(self.store, spec, base)
            if isinstance(found, Entry):
                self._event(Event.WAIT, base, time.time() - t_wait, name=spec.name)
                self._event(Event.HIT, found.key, name=spec.name, after_wait=True)
                return found
            lock = locking.acquire(self.store, base, max(timeout - (time.time() - t_wait), 0.0), spec.name)
        return lock  # type: ignore[return-value]  # acquire returns None only to a 'published' probe

    def _look_again(self, spec: StubSpec, base: str, t_wait: float, failed_since: float,
                    contended: bool) -> Entry | None:
        """Look again, holding the key's build lock: the entry if another process published it
        while this one waited (for the lock, since ``t_wait``), else ``None`` (build it). A
        corrupt entry is quarantined (where the root cannot take that, the private build is
        returned); a build that failed since ``failed_since`` (the lock wait's start, or earlier
        for a request that waited for another process first) raises its :class:`BuildError`.
        ``contended``: another process held the lock first; only then is the time a wait (taking a
        free lock on a loaded host can take longer than the 50 ms a wait must last to count)."""
        waited = time.time() - t_wait
        if contended and waited > 0.05:
            self._event(Event.WAIT, base, waited, name=spec.name)
        found = self._find_in_store(self.store, spec, base)
        if isinstance(found, Entry):
            self._event(Event.HIT, found.key, name=spec.name, after_wait=True)
            return found
        if isinstance(found, CorruptEntry):
            try:
                self.store.quarantine(found.key, found.reason)
            except OSError as exc:
                return self._degraded(spec, base, exc)
            self._event(Event.QUARANTINE, found.key, reason=found.reason)
        from ..edge.values import finite

        failure = self.store.read_failure(base)
        # A failure recorded while we waited; a time in the future (clock skew, or a hostile
        # member) proves nothing and must not block the key.
        failed_at = finite(failure.get("time"), failed_since, time.time() + 1.0) if failure else None
        if failure and failed_at is not None:  # (failed_at is None without a failure)
            raise BuildError(
                f"Error building extension '{spec.name}' (failed in pid {failure.get('pid')} while this "
                "process waited)", output=str(failure.get("output", ""))[-(256 << 10):], key=base,
                name=spec.name)
        return None

    def _build(self, spec: StubSpec, base: str, timeout: float, t_wait: float, require_hit: bool,
               speculation: Speculation | None = None) -> Entry:
        """Build, holding the key's build lock, with a lease that tells waiters who is at work:
        from the fleet's remote store if it has the entry (:meth:`_fetch_or_claim`), else here,
        then publish (and upload, for a fleet-wide claim). A root that cannot take the build
        degrades to a private one."""
        claim = None
        store = self.store

        def hint() -> None:  # on a miss only (a hit never imports pidhint); while the compiler runs
            from . import pidhint

            pidhint.check_miss(store, spec.name, spec.canonical())

        try:
            self.store.clear_failure(base)
            self.store.write_lease(base, spec.name)  # waiters on this host see who is at work
            if self._remote_config is not None and not spec.tracks_headers:
                got = self._fetch_or_claim(spec, base, max(timeout - (time.time() - t_wait), 0.0), require_hit)
                if isinstance(got, Entry):
                    hint()
                    return got
                claim = got  # this host builds for the fleet (or None: build, no upload)
            if require_hit:
                hint()
                raise _require_hit_error(spec, base, self.root)
            from ..edge import progress

            with progress.status(lambda: f"building {spec.name} ({spec.build_method} build)"):
                entry = self._build_and_publish(spec, base, meanwhile=hint, speculation=speculation)
            if claim is not None:
                claim.upload(entry.manifest, entry.path)  # after the local publish
            return entry
        except OSError as exc:
            if exc.errno in _UNWRITABLE:
                return self._degraded(spec, base, exc)
            raise
        finally:
            try:
                self.store.clear_lease(base)
            finally:  # even if that fails: a live heartbeat would hold the key for the fleet
                if claim is not None:
                    claim.release()

    def _fetch_or_claim(self, spec: StubSpec, base: str, budget: float, require_hit: bool) -> Entry | Claim | None:
        """Ask the remote tier: the entry, published here from a verified blob; else this host's
        fleet-wide claim to build it (``None``: build without uploading)."""
        got = self._remote_tier().fetch_or_claim(
            base, preimage(spec.canonical(), self._fingerprint(spec)), spec.name, budget,
            may_build=not require_hit)
        from ..remote.tier import Fetched

        if isinstance(got, Fetched):
            return self._publish_fetched(spec, base, got)
        return got

    # --- degrade: a private build, loaded from a temporary directory, never published ----------

    def _lock_timed_out(self, spec: StubSpec, base: str, exc: LockTimeoutError, t_wait: float) -> Entry:
        """Another process held the key's build past the bound: build privately (one warning)."""
        log.warning("stubcache: %s; building privately without publishing", exc)
        self._event(Event.LOCK_TIMEOUT, base, time.time() - t_wait, name=spec.name)
        return self._private_build(spec, base, reason=str(exc))

    def _untrusted_root(self, spec: StubSpec, base: str, exc: UntrustedRootError) -> Entry:
        """A root this user has not chosen to trust: seeds, else a private build (one warning)."""
        for seed in self.seeds:
            try:
                found = self._find_in_store(seed, spec, base, seed=True)
            except UntrustedRootError:
                continue
            if isinstance(found, Entry):
                return found
        if self.root not in _warned_degraded:
            _warned_degraded.add(self.root)
            log.warning("stubcache: not using the cache at %s: %s; building privately (%s; see "
                         "`stubcache doctor`)", self.root, exc, exc.how)
        if settings.require_hit():
            raise CacheMissError(f"STUBCACHE_REQUIRE_HIT is set and the cache at {self.root} is not trusted: {exc}")
        return self._private_build(spec, base, reason=str(exc))

    def _degraded(self, spec: StubSpec, base: str, exc: OSError) -> Entry:
        if self.root not in _warned_degraded:
            _warned_degraded.add(self.root)
            log.warning("stubcache: cannot write the cache at %s (%s); building privately, nothing is "
                         "shared until this is fixed (see `stubcache doctor`)", self.root, exc)
        return self._private_build(spec, base, reason=str(exc))

    # --- looking up: every entry is checked (trust, shape, checksum) before it is returned --------

    def _find_in_stores(self, spec: StubSpec, base: str) -> "Entry | CorruptEntry | None":
        for seed in self.seeds:
            try:
                found = self._find_in_store(seed, spec, base, seed=True)
            except UntrustedRootError as exc:
                if seed.root not in _warned_degraded:
                    _warned_degraded.add(seed.root)
                    log.warning("stubcache: ignoring seed store %s: %s (%s)", seed.root, exc, exc.how)
                continue
            if isinstance(found, Entry):
                return found
            if isinstance(found, CorruptEntry):
                log.warning("stubcache: ignoring seed entry %s in %s: %s", found.key, seed.root, found.reason)
        try:
            return self._find_in_store(self.store, spec, base)
        except UntrustedRootError:
            return None  # get_or_build says so once and builds privately

    def _find_in_store(self, store: Store, spec: StubSpec, base: str, seed: bool = False) -> "Entry | CorruptEntry | None":
        # Variants built with tracked input files (any header the fingerprint does not pin, any
        # linker input), then the plain entry of a build that read none.
        keys = store.variant_keys(base) + [base]
        try:
            entries_fd = store.dir("entries")
        except OSError:
            return None  # no entries/ (or something else in its place): nothing to find here
        try:
            for key in keys:
                try:
                    efd = os.open(fsroot.check_name(key), fsroot.O_DIR, dir_fd=entries_fd)
                except FileNotFoundError:
                    continue
                except OSError as exc:  # a symlink (ELOOP) or a file (ENOTDIR) where an entry should be
                    return CorruptEntry(key, f"entry is not a directory ({exc.strerror})")
                try:
                    found = self._check_entry(store, efd, spec, base, key, seed, entries_fd)
                finally:
                    os.close(efd)
                if found is not None:
                    return found
        finally:
            os.close(entries_fd)
        return None

    def _sig_memo(self, store: Store, key: str) -> str | None:
        """Where this root remembers re-checked signatures of an entry's tracked files."""
        if not self.store.ready:
            return None
        if store is self.store:
            tag = key
        else:  # a seed store's entry: its files were checked against this host's
            import hashlib

            tag = f"{key}-{hashlib.sha256(store.root.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
        return os.path.join(self.store.path("state"), inputs_memo_name(tag))

    def _check_entry(self, store: Store, efd: int, spec: StubSpec, base: str, key: str,
                   seed: bool, entries_fd: int) -> "Entry | CorruptEntry | None":
        try:
            manifest = store.read_manifest_at(efd)
        except FileNotFoundError:
            return CorruptEntry(key, "manifest missing")
        except (OSError, ValueError) as exc:  # a FIFO, a link, garbage, an absurd size
            return CorruptEntry(key, f"manifest unreadable: {exc}")
        if manifest.key != key or manifest.base_key != base:
            return CorruptEntry(key, "manifest describes another key")
        try:
            if (manifest.headers or manifest.inputs) and not still_valid(manifest.headers, manifest.inputs,
                                                    self._sig_memo(store, key)):
                return None
        except ValueError as exc:  # same key, so a rebuild could never replace it: quarantine
            return CorruptEntry(key, str(exc))
        entry = Entry(key, os.path.join(store.entry_dir(key), manifest.library), manifest, seed=seed,
                      root=store.root)
        try:
            policy = self._trusted_policy(store.root)
            if not seed:
                self._pin(key)
                # Pinned now: prune can no longer take it. Is the directory we read still the
                # entry (not evicted between our open and our pin)?
                if os.stat(key, dir_fd=entries_fd, follow_symlinks=False).st_ino != os.fstat(efd).st_ino:
                    return None
            self._verify(entry, policy, efd)
        except FileNotFoundError:
            return None  # removed under us (prune): a miss, rebuild
        except IntegrityError as exc:
            return CorruptEntry(key, str(exc))
        except UntrustedRootError:
            raise
        except TrustError as exc:
            # Content this user does not trust (a link, another owner, writable by others):
            # never loaded; moved aside and rebuilt like a corrupt entry, so that no one who
            # can write an entry can stop everyone else's engines from starting.
            return CorruptEntry(key, str(exc))
        return entry

    def _pin(self, key: str) -> None:
        """Pin an entry before it is used (prune skips pinned entries). Best-effort: a read-only
        or unwritable root, or a pin held exclusively past the lock timeout, loads unpinned."""
        slot = (self.root, key)
        if slot in self._pins:
            return
        try:
            fd = self.store.pin(key, self._lock_timeout)  # None: STUBCACHE_LOCK_TIMEOUT, read only if contended
        except OSError as exc:
            if exc.errno in _UNWRITABLE or isinstance(exc, fsroot.NotRegularFile):
                return
            raise
        if fd is not None:
            with self._mutex:
                if slot in self._pins:
                    os.close(fd)
                else:
                    self._pins[slot] = fd

    def _open_checked(self, entry: Entry, policy: TrustPolicy | None = None, dir_fd: int | None = None) -> int:
        try:
            if dir_fd is None:
                fd = fsroot.open_regular(None, entry.path)
            else:
                fd = fsroot.open_regular(dir_fd, entry.manifest.library)
        except fsroot.NotRegularFile as exc:
            raise IntegrityError(f"library {entry.path} {exc.strerror}") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise TrustError(f"refusing library {entry.path}: it is a symlink; remove the entry "
                                 "(stubcache never follows links)") from None
            raise
        try:
            st = os.fstat(fd)
            if policy is None:
                policy = self._trusted_policy(entry.root) if entry.root else private_policy()
            policy.check(st, entry.path, "library")
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if self._verified.get(entry.path) != ident:
                if st.st_size > fsroot.LIBRARY_CAP:  # hashing a planted sparse file would take hours
                    raise IntegrityError(f"library {entry.path} is {st.st_size} bytes, over the "
                                         f"{fsroot.LIBRARY_CAP}-byte limit for a library")
                if st.st_size != entry.manifest.size or file_sha256(fd) != entry.manifest.sha256:
                    raise IntegrityError(f"checksum mismatch for {entry.path}")
                self._verified[entry.path] = ident
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _verify(self, entry: Entry, policy: TrustPolicy, efd: int) -> None:
        """Checksum (first time per process), trust checks and a whole-entry shape check, all on
        the entry directory open as ``efd`` (invariants 5 and 6 of docs/design.md)."""
        if entry.path in self._verified:
            return
        edir = os.path.dirname(entry.path)
        policy.check(os.fstat(efd), edir, "cache entry")
        names = set(os.listdir(efd))
        expected = {MANIFEST_NAME, entry.manifest.library}
        if names != expected:
            raise IntegrityError(f"entry has unexpected files "
                                 f"{fsroot.printable(sorted(names ^ expected))}")
        fd = self._open_checked(entry, policy, efd)
        with self._mutex:
            # load_entry reuses this very fd (no second open) and compares what the loader mapped
            # with it; one fd per library is kept for the life of the process.
            keep = self._lib_fds.setdefault(entry.path, fd)
        if keep != fd:
            os.close(fd)

    # --- building and publishing -----------------------------------------------------------------

    def _manifest_for(self, spec: StubSpec, base: str, result: BuildResult, sha: str, size: int) -> Manifest:
        key = entry_key(base, result.headers, absent_paths(result.inputs))
        return Manifest(
            key=key, base_key=base, name=spec.name, module_name=result.module_name,
            library=os.path.basename(result.library), sha256=sha, size=size,
            preimage=preimage(spec.canonical(), self._fingerprint(spec)), headers=result.headers,
            inputs=result.inputs,
            build_method=result.method, build_seconds=round(result.seconds, 6), build_log=result.log,
            created=time.time(), stubcache_version=__version__,
        )

    def _build_and_publish(self, spec: StubSpec, base: str, retry: bool = True,
                           meanwhile: Callable[[], None] | None = None,
                           speculation: Speculation | None = None) -> Entry:
        """Build in a fresh staging directory (the ``speculation``'s, if it started a compile
        before the key was known), then publish. A build during which an input changed is
        published under no key: built once more, then privately. ``meanwhile``: see
        :func:`stubcache.build.builder.build`."""
        started = staging = None
        try:
            started = speculation.take() if speculation is not None else None
            staging = self.store.new_staging(base) if started is None or started.staging is None else started.staging
            result = self._compile(spec, base, staging, meanwhile, started)
            if result.unstable and set(result.unstable) == {_unexpressed()}:
                # Nothing moved: the build read a file it cannot name, and so would every build
                # again. This library is used, from a private copy, and never published.
                log.warning("stubcache: %r read a file whose name its dependency output cannot express; "
                            "using this build without caching it", spec.name)
                return self._keep_private(spec, base, result, reason="a file the build read cannot be named")
            if result.unstable:
                # An input changed while the compiler ran: the library may hold either version,
                # so it is published under no key. Once more, then privately.
                self._event(Event.UNSTABLE_INPUTS, base, name=spec.name, files=len(result.unstable))
                log.warning("stubcache: %s changed during the build of %r; not publishing it",
                             ", ".join(result.unstable[:3]), spec.name)
                if retry:
                    self.store.rmtree(staging)
                    # Past the clock slack, an edit made before now no longer looks concurrent.
                    time.sleep(2 * CLOCK_SLACK_NS / 1e9)
                    return self._build_and_publish(spec, base, retry=False)
                return self._private_build(spec, base, reason="inputs changed during the build")
            staged_entry = os.path.join(staging, "entry")
            fsroot.mkdir_mode(staged_entry, self.store.mode(0o700, 0o2770))
            lib = os.path.join(staged_entry, os.path.basename(result.library))
            os.rename(result.library, lib)
            manifest = self._manifest_for(spec, base, result, file_sha256(lib), os.path.getsize(lib))
            faults.point("before_publish")
            self._publish(staged_entry, manifest)
            faults.point("after_publish")
            log.debug("stubcache: %s: published as %s", spec.name, manifest.key)
            if result.method == "direct":
                self._template_due = True  # (left by the caller, after the request's record)
            self._event(Event.BUILD, manifest.key, result.seconds, name=spec.name, method=result.method)
            return self._find_published(spec, base, manifest.key)
        finally:
            if started is not None:
                started.stop()  # (nothing once the build has taken it and reaped it)
                if started.staging is not None and staging is None:  # (taken, then interrupted)
                    self.store.rmtree(started.staging)
            if staging is not None:
                self.store.rmtree(staging)

    def _compile(self, spec: StubSpec, base: str, staging: str, meanwhile: Callable[[], None] | None = None,
                 started: Started | None = None) -> BuildResult:
        """Run the builder in ``<staging>/build``. A failed build is recorded for the processes
        waiting on the key and raised (:class:`BuildError`; ``OSError`` ENOSPC for a full disk)."""
        from ..build.builder import build

        build_dir = os.path.join(staging, "build")
        if started is None:
            fsroot.mkdir_mode(build_dir, self.store.mode(0o700, 0o2770))  # shared: the owner can clean it
        try:
            result = build(spec, build_dir, self.fingerprint.compiler_facts(), meanwhile, started)
        except BuildError as exc:
            exc.key = base
            if "No space left on device" in (exc.output or ""):
                raise OSError(errno.ENOSPC, f"no space left while building {spec.name!r}") from exc
            self.store.record_failure(base, exc.output or str(exc))
            self._event(Event.FAIL, base, name=spec.name)
            raise
        faults.point("after_build")
        return result

    def _publish(self, staged_entry: str, manifest: Manifest) -> None:
        """Publish a complete staged entry (by one rename; an existing entry of the key wins),
        pinned before it becomes visible, so that prune cannot take it in between."""
        self._pin(manifest.key)
        self.store.publish(staged_entry, manifest)  # False: an existing entry won
        self._cap_pending = True

    def _find_published(self, spec: StubSpec, base: str, key: str) -> Entry:
        """The entry just published, looked up (and so verified) from the root, like any hit:
        nothing loads from a staging or temporary copy."""
        found = self._find_in_store(self.store, spec, base)
        if not isinstance(found, Entry):
            raise StubCacheError(f"entry {key} vanished right after publishing")
        return found

    def _remote_tier(self) -> RemoteTier:
        if self._remote is None:
            from ..remote.tier import RemoteTier

            self._remote = RemoteTier(self._remote_config, self._event)  # type: ignore[arg-type]  # set: see get_or_build
        return self._remote

    def _publish_fetched(self, spec: StubSpec, base: str, fetched: Fetched) -> Entry:
        """Publish a verified remote blob into this root (staging + atomic rename, as a build
        would) and return the entry looked up from there: nothing loads from a temporary copy."""
        from ..storage import locking

        manifest = fetched.manifest
        staging = self.store.new_staging(base)
        try:
            staged_entry = os.path.join(staging, "entry")
            fsroot.mkdir_mode(staged_entry, self.store.mode(0o700, 0o2770))
            with fsroot.Dir(staged_entry) as efd:
                locking.write_file(efd, manifest.library, fetched.library, mode=0o600, exclusive=True)
            self._publish(staged_entry, manifest)
            entry = self._find_published(spec, base, manifest.key)  # verifies the published copy again
            entry.fetched = True
            return entry
        finally:
            self.store.rmtree(staging)

    def _private_build(self, spec: StubSpec, base: str, reason: str) -> Entry:
        """Build in a private temporary directory, load from there, never publish."""
        from ..build.builder import build

        build_dir = os.path.join(_private_dir(), "build")
        os.mkdir(build_dir, 0o700)
        from ..edge import progress

        with progress.status(lambda: f"building {spec.name} privately ({spec.build_method} build)"):
            result = build(spec, build_dir, self.fingerprint.compiler_facts())
        return self._private_entry(spec, base, result, reason)

    def _keep_private(self, spec: StubSpec, base: str, result: BuildResult, reason: str) -> Entry:
        """This build's library, moved out of its staging directory (removed by the caller) into
        a private temporary one, loaded from there and never published."""
        import shutil

        library = os.path.join(_private_dir(), os.path.basename(result.library))
        shutil.move(result.library, library)  # (a copy where /tmp is another file system)
        result.library = library
        return self._private_entry(spec, base, result, reason)

    def _private_entry(self, spec: StubSpec, base: str, result: BuildResult, reason: str) -> Entry:
        manifest = self._manifest_for(spec, base, result, file_sha256(result.library),
                                      os.path.getsize(result.library))
        self._event(Event.PRIVATE_BUILD, manifest.key, result.seconds, name=spec.name, reason=reason)
        return Entry(manifest.key, result.library, manifest, published=False)
