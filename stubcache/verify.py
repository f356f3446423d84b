"""Re-checking published entries against their manifests (``stubcache verify``)."""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from typing import Any

from .errors import TrustError
from .manifest import MANIFEST_NAME
from .store import Store, file_sha256
from .trust import TrustPolicy, load_policy


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
    trusted ownership/permissions, no symlinks, and the library's size and SHA-256."""
    edir = store.entry_dir(key)
    if policy is None:
        policy = load_policy(store.root)
    try:
        manifest = store.read_manifest(key)
    except FileNotFoundError:
        if not os.path.lexists(edir):
            return VerifyResult(key, "?", "gone", "removed while verifying")
        return VerifyResult(key, "?", "bad", "manifest missing")
    except (ValueError, OSError) as exc:
        return VerifyResult(key, "?", "bad", f"manifest unreadable: {exc}")
    name = str(manifest.name)
    if manifest.key != key:
        return VerifyResult(key, name, "bad", f"manifest describes key {manifest.key}")
    try:
        policy.check(os.lstat(edir), edir, "cache entry")
        names = set(os.listdir(edir))
        expected = {MANIFEST_NAME, manifest.library}
        if names != expected:
            return VerifyResult(key, name, "bad", f"unexpected files {sorted(names ^ expected)}")
        lib = os.path.join(edir, manifest.library)
        fd = os.open(lib, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            policy.check(st, lib, "library")
            if not stat.S_ISREG(st.st_mode):
                return VerifyResult(key, name, "bad", "library is not a regular file")
            if st.st_size != manifest.size:
                return VerifyResult(key, name, "bad", f"size {st.st_size} != manifest {manifest.size}")
            digest = file_sha256(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        if not os.path.lexists(edir):
            return VerifyResult(key, name, "gone", "removed while verifying")
        return VerifyResult(key, name, "bad", "library missing")
    except TrustError as exc:
        return VerifyResult(key, name, "bad", str(exc))
    except OSError as exc:
        return VerifyResult(key, name, "bad", f"cannot read: {exc}")
    if digest != manifest.sha256:
        return VerifyResult(key, name, "bad", f"checksum mismatch (sha256 {digest[:12]}…, manifest "
                                              f"{str(manifest.sha256)[:12]}…)")
    return VerifyResult(key, name, "ok")


def verify_store(store: Store, quarantine: bool = True) -> list[VerifyResult]:
    """Check every entry; move the bad ones to ``quarantine/`` (unless ``quarantine=False``)."""
    from . import events

    results = []
    policy = load_policy(store.root)
    store.shared = policy.shared
    for key in store.entry_keys():
        res = check_entry(store, key, policy)
        if res.status == "bad" and quarantine:
            res = _quarantine_locked(store, key, policy, res)
            if res.quarantined_to:
                events.record(store.path("events"), "quarantine", key, reason=res.detail, by="verify")
        results.append(res)
    return results


def _quarantine_locked(store: Store, key: str, policy: TrustPolicy, res: VerifyResult) -> VerifyResult:
    """Quarantine under the entry's build lock, after checking again: a builder may have
    replaced the bad entry with a good one between our check and the move."""
    import filelock

    import re

    try:
        base = store.read_manifest(key).base_key
    except (OSError, ValueError):
        base = key
    if not isinstance(base, str) or not re.fullmatch(r"[0-9a-f]{16,64}", base):
        base = key  # a bad manifest's field must not become a path
    lock = filelock.FileLock(store.lock_path(str(base)), mode=store.mode(0o600, 0o660), thread_local=False)
    try:
        with lock.acquire(timeout=60):
            res = check_entry(store, key, policy)
            if res.status == "bad":
                res.quarantined_to = store.quarantine(key, f"stubcache verify: {res.detail}")
    except filelock.Timeout:
        res.detail += " (not quarantined: its build lock stayed busy)"
    return res
