"""Auditing keys by rebuilding (``stubcache verify --rebuild``).

Builds are reproducible (the staging path never reaches the library), so a published entry and a
fresh build of its spec with today's toolchain and inputs must be byte-identical. If they are
not, something the compiler or linker read is not covered by the key: the report names the
entry and shows its pre-image, so the hole can be found field by field.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any, Sequence

from ..edge.errors import BuildError, TrustError
from ..key.derive import diff_preimages
from ..storage.manifest import MANIFEST_NAME, Manifest
from ..key import spec_from_canonical
from ..storage.store import Store, file_sha256

UNCOVERED = "the key does not cover an input"


class AuditResult:
    """One entry's verdict: ``status`` is ``same``, ``differs`` (the key has a hole), ``skipped``
    (cannot be rebuilt comparably here; ``detail`` says why) or ``failed`` (the rebuild failed)."""

    __slots__ = ("key", "name", "status", "detail", "preimage", "rebuilt_sha256", "sha256")

    def __init__(self, key: str, name: str, status: str, detail: str = "", preimage: Any = None,
                 rebuilt_sha256: str | None = None, sha256: str | None = None) -> None:
        self.key = key
        self.name = name
        self.status = status
        self.detail = detail
        self.preimage = preimage
        self.rebuilt_sha256 = rebuilt_sha256
        self.sha256 = sha256

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}


def select_keys(store: Store, keys: Sequence[str], sample: int | None) -> list[str]:
    """The given keys (unique prefixes allowed), else all entries or a random sample of them."""
    every = store.entry_keys()
    if keys:
        out = []
        for k in keys:
            matches = [e for e in every if e.startswith(k)]
            if len(matches) != 1:
                raise KeyError(f"{k!r} matches {len(matches)} entries")
            out.append(matches[0])
        return out
    if sample is not None and sample < len(every):
        return sorted(random.sample(every, sample))
    return every


def trusted_manifest(store: Store, key: str) -> Manifest:
    """The manifest of entry ``key``, if the loader would load the entry as this user: the
    root by :func:`stubcache.cache.core.checked_loader_policy` (the loading user's trust rule), then the entry
    directory, the manifest and the library by that policy's check, each on the descriptor it is
    read from.
    :class:`TrustError` otherwise. (A rebuild compiles what the manifest says, as this user.)"""
    from ..edge import fsroot
    from ..cache.core import checked_loader_policy
    from ..storage.trust import private_policy

    policy = checked_loader_policy(store.root) or private_policy()
    with store.at("entries", fsroot.check_name(key)) as efd:
        policy.check(os.fstat(efd), store.entry_dir(key), "cache entry")
        fd = fsroot.open_regular(efd, MANIFEST_NAME)
        try:
            policy.check(os.fstat(fd), os.path.join(store.entry_dir(key), MANIFEST_NAME), "manifest")
            data = fsroot.read_fd(fd, fsroot.MANIFEST_CAP, MANIFEST_NAME)
        finally:
            os.close(fd)
        try:
            manifest = Manifest.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"manifest is not valid: {exc}") from None
        fd = fsroot.open_regular(efd, fsroot.check_name(manifest.library))
        try:
            policy.check(os.fstat(fd), os.path.join(store.entry_dir(key), manifest.library), "library")
        finally:
            os.close(fd)
    return manifest


def rebuild_entry(store: Store, key: str) -> AuditResult:
    """Rebuild one entry's spec in a private directory and compare the bytes."""
    from ..key import inputs
    from ..build.builder import build
    from ..hit.front import StubCache

    try:
        manifest = trusted_manifest(store, key)
    except TrustError as exc:  # its flags could run code (-wrapper, -fplugin, -B, -specs)
        return AuditResult(key, "?", "skipped", f"not rebuilt, the loader would not trust it: {exc}")
    except (OSError, ValueError) as exc:
        return AuditResult(key, "?", "skipped", f"manifest unreadable: {exc}")
    pre = manifest.preimage if isinstance(manifest.preimage, dict) else {}
    try:
        spec = spec_from_canonical(pre["spec"])
    except (KeyError, TypeError, ValueError) as exc:
        return AuditResult(key, str(manifest.name), "skipped", f"pre-image is not a spec: {exc}")
    if spec.canonical() != pre["spec"]:
        return AuditResult(key, spec.name, "skipped", "pre-image spec does not round-trip")
    cache = StubCache(store.root, seeds=[])
    fp_now = cache._fingerprint(spec)
    diffs = diff_preimages(pre.get("fingerprint"), fp_now)
    if diffs:
        fields = ", ".join(d[0] for d in diffs[:4])
        return AuditResult(key, spec.name, "skipped", f"built with another toolchain ({fields})")
    try:
        if (manifest.headers or manifest.inputs) and not inputs.still_valid(manifest.headers, manifest.inputs):
            return AuditResult(key, spec.name, "skipped", "its tracked inputs changed since (it would miss now)")
    except ValueError as exc:
        return AuditResult(key, spec.name, "skipped", str(exc))
    tmp = tempfile.mkdtemp(prefix="stubcache-audit-")
    try:
        build_dir = os.path.join(tmp, "build")
        os.mkdir(build_dir, 0o700)
        try:
            result = build(spec, build_dir, cache.fingerprint.compiler_facts())
        except BuildError as exc:
            return AuditResult(key, spec.name, "failed", f"rebuild failed: {exc}")
        if result.unstable:
            return AuditResult(key, spec.name, "failed", "inputs changed during the rebuild; run it again")
        sha = file_sha256(result.library)
    finally:
        Store.rmtree(tmp)
    if sha != manifest.sha256:
        return AuditResult(key, spec.name, "differs", UNCOVERED, pre, sha, manifest.sha256)
    return AuditResult(key, spec.name, "same", "", None, sha, manifest.sha256)
