"""Re-checking published entries against their manifests (``stubcache verify``)."""

from __future__ import annotations

import errno
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..edge import fsroot
from ..edge.errors import TrustError
from ..edge.fsroot import printable
from ..storage.manifest import MANIFEST_NAME
from ..storage.store import Store, file_sha256
from ..storage.trust import TrustPolicy, layout_policy


@dataclass
class VerifyResult:
    """The verdict on one entry: ``status`` is ``ok``, ``bad`` or ``gone`` (removed meanwhile)."""

    key: str
    name: str
    status: str
    detail: str = ""
    quarantined_to: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_entry(store: Store, key: str, policy: TrustPolicy | None = None) -> VerifyResult:
    """Check one entry: manifest parses and names this key, exactly the two expected files,
    trusted ownership/permissions, no symlinks, and the library's size and SHA-256.

    Everything is read through the entry directory's descriptor (opened without following a
    link); the library name from the manifest is only used relative to it, after the manifest
    parser has rejected anything that is not a plain file name."""
    edir = store.entry_dir(key)
    if policy is None:
        policy = layout_policy(store.root)
    try:
        efd = store.dir("entries", key)
    except FileNotFoundError:
        return VerifyResult(key, "?", "gone", "removed while verifying")
    except OSError as exc:
        return VerifyResult(key, "?", "bad", f"not a directory ({exc.strerror})")
    try:
        return _check_at(store, efd, edir, key, policy)
    finally:
        os.close(efd)


def _check_at(store: Store, efd: int, edir: str, key: str, policy: TrustPolicy) -> VerifyResult:
    try:
        manifest = store.read_manifest_at(efd)
    except FileNotFoundError:
        return VerifyResult(key, "?", "bad", "manifest missing")
    except fsroot.NotRegularFile as exc:
        return VerifyResult(key, "?", "bad", f"manifest {exc.strerror}")
    except (ValueError, OSError) as exc:
        return VerifyResult(key, "?", "bad", f"manifest unreadable: {printable(exc)}")
    name = printable(manifest.name)
    if manifest.key != key:
        return VerifyResult(key, name, "bad", f"manifest describes key {printable(manifest.key, 80)}")
    try:
        policy.check(os.fstat(efd), edir, "cache entry")
        names = set(os.listdir(efd))
        expected = {MANIFEST_NAME, manifest.library}
        if names != expected:
            return VerifyResult(key, name, "bad", f"unexpected files {printable(sorted(names ^ expected))}")
        lib = os.path.join(edir, manifest.library)
        try:
            fd = fsroot.open_regular(efd, manifest.library)
        except fsroot.NotRegularFile as exc:
            return VerifyResult(key, name, "bad", f"library {exc.strerror}")
        try:
            st = os.fstat(fd)
            policy.check(st, lib, "library")
            if st.st_size != manifest.size:
                return VerifyResult(key, name, "bad", f"size {st.st_size} != manifest {manifest.size}")
            if st.st_size > fsroot.LIBRARY_CAP:  # hashing a planted sparse file would take hours
                return VerifyResult(key, name, "bad", f"library is {st.st_size} bytes, over the "
                                                      f"{fsroot.LIBRARY_CAP}-byte limit for a library")
            digest = file_sha256(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return VerifyResult(key, name, "bad", "library missing")
    except TrustError as exc:
        return VerifyResult(key, name, "bad", printable(exc, 500))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return VerifyResult(key, name, "bad", "library is a symlink")
        return VerifyResult(key, name, "bad", f"cannot read: {printable(exc)}")
    if digest != manifest.sha256:
        return VerifyResult(key, name, "bad", f"checksum mismatch (sha256 {digest[:12]}…, manifest "
                                              f"{printable(manifest.sha256, 12)}…)")
    return VerifyResult(key, name, "ok")


def verify_store(store: Store, quarantine: bool = True,
                 progress: Callable[[int, int], object] | None = None) -> list[VerifyResult]:
    """Check every entry; move the bad ones to ``quarantine/`` (unless ``quarantine=False``).
    ``progress``, if given, is called with ``(done, total)`` after each entry."""
    from ..storage import events

    results: list[VerifyResult] = []
    policy = layout_policy(store.root)
    if store.shared != policy.shared:  # a store made without the root's policy: files get its modes
        store = Store(store.root, policy)
    keys = store.entry_keys()
    for key in keys:
        if progress is not None:
            progress(len(results), len(keys))
        res = check_entry(store, key, policy)
        if res.status == "bad" and quarantine:
            res = _quarantine_locked(store, key, policy, res)
            if res.quarantined_to:
                events.record(store.path("events"), events.Event.QUARANTINE, key, reason=res.detail, by="verify",
                              file_mode=events.file_mode(store.shared))
        results.append(res)
    return results


def _quarantine_locked(store: Store, key: str, policy: TrustPolicy, res: VerifyResult) -> VerifyResult:
    """Quarantine under the entry's build lock, after checking again: a builder may have
    replaced the bad entry with a good one between our check and the move. The lock wait is
    bounded (``STUBCACHE_LOCK_TIMEOUT``, at most 60 s) and the lock file is reached without
    following links; the base key comes from the manifest only if it is a plain key."""
    from ..storage import locking
    from ..storage.store import is_key

    try:
        base = store.read_manifest(key).base_key
    except (OSError, ValueError):
        base = key
    if not isinstance(base, str) or not is_key(base):
        base = key  # a bad manifest's field must not become a path
    try:
        fd = store.open_lock_file(store.lock_path(base))
    except (OSError, ValueError) as exc:
        res.detail += f" (not quarantined: cannot open its build lock: {printable(exc)})"
        return res
    try:
        if not locking.wait_flock(fd, locking.EX, min(locking.lock_timeout_from_env(), 60.0)):
            res.detail += " (not quarantined: its build lock stayed busy)"
            return res
        res = check_entry(store, key, policy)
        if res.status == "bad":
            res.quarantined_to = store.quarantine(key, f"stubcache verify: {res.detail}")
    finally:
        os.close(fd)
    return res
