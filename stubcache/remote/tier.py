"""The fleet logic on top of a backend: verified fetch, fleet-wide single flight, upload, and
falling back to local-only behaviour when the remote store misbehaves.

Used by :class:`stubcache.StubCache` under its per-key host lock, so one process per host talks
to the remote store for a key. Nothing here raises on a remote fault: the tier warns once per
process, stays out of the way for :data:`RETRY_AFTER` seconds, and the caller builds locally.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Any, Callable

from ..edge import log
from ..storage.events import Event
from ..storage.manifest import MANIFEST_NAME, Manifest
from .backend import RemoteBackend, RemoteUnavailable
from .blob import MAX_BLOB, BlobError, encode, open_blob
from .config import BACKENDS, RemoteConfig

RETRY_AFTER = 30.0          # seconds a process leaves the remote store alone after a fault
NOTICE_AFTER = 5.0          # a wait for another host's build is logged after this long
POLL_MIN, POLL_MAX = 0.02, 0.1

_warned_down = False        # one warning per process for an unusable remote store
_warned_rejected = False    # one warning per process for a refused blob

EventFn = Callable[..., None]


def make_backend(config: RemoteConfig) -> RemoteBackend:
    """Instantiate the backend registered for the URL's scheme (imports its client here)."""
    import importlib

    module, _, cls = BACKENDS[config.scheme].partition(":")
    backend: RemoteBackend = getattr(importlib.import_module(module), cls)(config)
    return backend


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class Fetched:
    """A verified blob: the manifest and the library bytes, ready to publish locally."""

    __slots__ = ("manifest", "library", "seconds", "nbytes")

    def __init__(self, manifest: Manifest, library: bytes, seconds: float, nbytes: int) -> None:
        self.manifest = manifest
        self.library = library
        self.seconds = seconds  # download and verification
        self.nbytes = nbytes    # the whole blob


_REJECTED = object()
_DOWN = object()


class Claim:
    """This host holds the fleet-wide build lease of a key: build, :meth:`upload`, :meth:`release`.

    A daemon thread renews the lease every third of its lifetime while the build runs; if this
    process dies the renewals stop and the lease expires, so another host takes over. A renewal
    that fails (a blip: timeout, reconnect) is reported and tried again every twelfth of the
    lifetime while the lease may still live: waiting a whole third after a failure lost the lease
    to a blip that covered two renewals, with Redis back and a second of the lease left, and
    handed the build to a second host.
    """

    def __init__(self, tier: "RemoteTier", key: str, value: str) -> None:
        self._tier = tier
        self.key = key
        self._value = value
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name=f"stubcache-lease-{key[:8]}", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        lease = self._tier.config.lease
        period = lease / 3
        renewed = time.monotonic()  # about when the lease was last set
        wait = period
        while not self._stop.wait(wait):
            started = time.monotonic()
            try:
                if not self._tier.backend.renew_lease(self.key, self._value, lease):
                    log.info("stubcache: lost the fleet build lease of %s (expired); building on", self.key)
                    return
                renewed, wait = started, period
            except RemoteUnavailable as exc:
                self._tier.down(exc, self.key, pause=False)
                if time.monotonic() - renewed >= lease:
                    log.info("stubcache: lost the fleet build lease of %s (not renewed in time); building on",
                             self.key)
                    return
                wait = period / 4

    def upload(self, manifest: Manifest, library_path: str) -> None:
        """Upload a published entry (read from the local root, after publishing it there)."""
        self._tier.upload(manifest, library_path)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._tier.config.timeout + 1)
        if self._tier.usable():
            try:
                self._tier.backend.release_lease(self.key, self._value)
            except RemoteUnavailable as exc:
                self._tier.down(exc, self.key)


class RemoteTier:
    """One process's view of the remote store.

    Args:
        config: validated settings.
        event: ``event(ev, key, seconds=None, **extra)``, records a stats event (``ev``: an
            :class:`~stubcache.storage.events.Event` name).
    """

    def __init__(self, config: RemoteConfig, event: EventFn, backend: RemoteBackend | None = None) -> None:
        self.config = config
        self._event = event
        self._backend = backend
        self._down_until = 0.0

    @property
    def backend(self) -> RemoteBackend:
        if self._backend is None:
            self._backend = make_backend(self.config)
        return self._backend

    # --- faults --------------------------------------------------------------------------------

    def usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def down(self, exc: BaseException, key: str = "", pause: bool = True) -> None:
        """Record a remote fault: warn once per process and (``pause``) go local-only for a while."""
        global _warned_down
        if pause:
            self._down_until = time.monotonic() + RETRY_AFTER
        self._event(Event.REMOTE_ERROR, key, error=str(exc)[:200])
        if not _warned_down:
            _warned_down = True
            log.warning("stubcache: remote cache %s unusable (%s); continuing with the local cache only",
                         self.config.display_url, exc)

    def _rejected(self, key: str, reason: str) -> None:
        global _warned_rejected
        self._event(Event.REMOTE_REJECTED, key, reason=reason[:200])
        if not _warned_rejected:
            _warned_rejected = True
            log.warning("stubcache: refused remote blob %s from %s: %s; building locally instead",
                         key, self.config.display_url, reason)

    # --- fetch -------------------------------------------------------------------------------

    def _fetch(self, key: str, expected: str) -> Fetched | object | None:
        """GET and verify one blob: a :class:`Fetched`, ``None`` (absent), ``_REJECTED`` or ``_DOWN``."""
        t0 = time.perf_counter()
        try:
            raw = self.backend.get_blob(key, MAX_BLOB)
        except RemoteUnavailable as exc:
            self.down(exc, key)
            return _DOWN
        if raw is None:
            return None
        try:
            manifest, library = self.verify(key, raw, expected)
        except BlobError as exc:
            self._rejected(key, exc.reason)
            return _REJECTED
        return Fetched(manifest, library, time.perf_counter() - t0, len(raw))

    def verify(self, key: str, raw: bytes, expected: str) -> tuple[Manifest, bytes]:
        """Authenticate and check one blob against the key and pre-image this host computed."""
        manifest_bytes, library, _ = open_blob(key, raw, self.config.secret)
        try:
            manifest = Manifest.loads(manifest_bytes.decode("utf-8"))
        except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise BlobError(f"unreadable manifest: {str(exc)[:200]}") from None
        if (manifest.library == MANIFEST_NAME or not manifest.library.endswith(".so")
                or "\x00" in manifest.library):
            raise BlobError(f"manifest names a bad library file {manifest.library!r}")
        # Blobs are stored under the base key; the entry key adds the files the build read.
        if manifest.base_key != key or manifest.key != _entry_key_of(manifest):
            raise BlobError("manifest describes another key")
        if canonical_json(manifest.preimage) != expected:
            raise BlobError("manifest pre-image differs from this host's (another toolchain or spec)")
        if len(library) != manifest.size or hashlib.sha256(library).hexdigest() != manifest.sha256:
            raise BlobError("library does not match the manifest's size and sha256")
        if manifest.headers or manifest.inputs:
            from ..key.inputs import still_valid

            try:
                same = still_valid(manifest.headers, manifest.inputs)
            except ValueError as exc:
                raise BlobError(str(exc)) from None
            if not same:
                raise BlobError("it was built from headers or linker inputs that differ on this host")
        return manifest, library

    def fetch_or_claim(self, key: str, preimage: dict[str, Any], name: str, budget: float,
                       may_build: bool = True) -> "Fetched | Claim | None":
        """After a local miss (under the host lock): the verified blob, or a :class:`Claim` if
        this host should build and upload it, or ``None`` to build locally without uploading.

        If another host holds the key's lease, wait for its blob up to ``budget`` seconds; a
        lease that expires (its holder died) is taken over. Never raises on remote faults.
        """
        if not self.usable():
            return None
        expected = canonical_json(preimage)
        got = self._fetch(key, expected)
        if got is _DOWN or got is _REJECTED:
            # Blobs are immutable (SET NX): a refused one will not get better, and no upload
            # can replace it. Build here; it stays until evicted or removed.
            return None
        if isinstance(got, Fetched):
            self._hit(key, got)
            return got
        self._event(Event.REMOTE_MISS, key, name=name)
        claim_ok = may_build and self.config.writable
        t0 = time.monotonic()
        deadline = t0 + budget
        notice_at: float | None = t0 + NOTICE_AFTER
        delay = POLL_MIN
        waited = False
        while True:
            try:
                if claim_ok:
                    value = json.dumps({"host": os.uname().nodename, "pid": os.getpid(), "name": name,
                                        "started": time.time(), "token": os.urandom(8).hex()})
                    if self.backend.acquire_lease(key, value, self.config.lease):
                        # Look again under the lease: the last holder may have uploaded and
                        # released between our first look and the lease.
                        got = self._fetch(key, expected) if self.backend.poll(key)[0] else None
                        if got is not None:
                            self.backend.release_lease(key, value)
                        if isinstance(got, Fetched):
                            if waited:
                                self._event(Event.LEASE_WAIT, key, time.monotonic() - t0, name=name, outcome="blob")
                            self._hit(key, got)
                            return got
                        if got is not None:  # down, or a refused blob in the way
                            return None
                        if waited:
                            self._event(Event.LEASE_WAIT, key, time.monotonic() - t0, name=name, outcome="takeover")
                        return Claim(self, key, value)
                exists, lease = self.backend.poll(key)
            except RemoteUnavailable as exc:
                self.down(exc, key)
                return None
            if exists:
                got = self._fetch(key, expected)
                if isinstance(got, Fetched):
                    if waited:
                        self._event(Event.LEASE_WAIT, key, time.monotonic() - t0, name=name, outcome="blob")
                    self._hit(key, got)
                    return got
                if got is not None:  # down, or refused: build here
                    return None
            if lease is None and not claim_ok:
                if waited:  # the builder gave up or died: build here
                    self._event(Event.LEASE_WAIT, key, time.monotonic() - t0, name=name, outcome="gone")
                return None
            now = time.monotonic()
            if notice_at is not None and now >= notice_at:
                notice_at = None
                log.warning("stubcache: waiting for %s to build %r (key %s) for the fleet",
                             _describe(lease), name, key)
            if now >= deadline:
                self._event(Event.LEASE_WAIT, key, now - t0, name=name, outcome="timeout")
                log.warning("stubcache: gave up after %.0fs waiting for %s to build %r for the fleet; "
                             "building on this host", now - t0, _describe(lease), name)
                return None
            waited = True
            time.sleep(min(delay, max(deadline - now, 0.0)))
            delay = min(delay * 1.5, POLL_MAX)

    def _hit(self, key: str, got: Fetched) -> None:
        self._event(Event.REMOTE_HIT, key, got.seconds, bytes=got.nbytes)

    # --- upload ------------------------------------------------------------------------------

    def upload(self, manifest: Manifest, library_path: str) -> None:
        """Sign and store a published entry's manifest and library (one atomic write)."""
        if not self.config.writable or self.config.secret is None or not self.usable():
            return
        with open(library_path, "rb") as fh:
            library = fh.read()
        if len(library) != manifest.size or hashlib.sha256(library).hexdigest() != manifest.sha256:
            log.warning("stubcache: not uploading %s: the local library does not match its manifest", manifest.key)
            return
        key = manifest.base_key  # what another host can compute before building
        value = encode(key, manifest.dumps().encode("utf-8"), library, self.config.secret)
        try:
            stored = self.backend.put_blob(key, value)
        except RemoteUnavailable as exc:
            self.down(exc, key)
            return
        if stored:
            self._event(Event.UPLOAD, key, bytes=len(value))
        else:  # a blob this host refused is in the way: it stays until evicted or removed
            log.info("stubcache: not uploading %s: the remote store already holds a blob for it", key)


def _entry_key_of(manifest: Manifest) -> str | None:
    from ..key.inputs import absent_paths
    from ..key.derive import entry_key

    try:
        return entry_key(manifest.base_key, manifest.headers, absent_paths(manifest.inputs))
    except (TypeError, ValueError, AttributeError):
        return None


def _describe(lease: str | None) -> str:
    if not lease:
        return "another host"
    try:
        from ..edge.fsroot import printable

        info = json.loads(lease)
        return f"pid {printable(info.get('pid'), 32)} on {printable(info.get('host'), 64)}"
    except (ValueError, AttributeError, RecursionError):  # anyone may write a lease: nested past the parser
        return "another host"
