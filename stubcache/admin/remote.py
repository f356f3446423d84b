"""Administration of the remote store: listing, a prune plan, and ``doctor``'s checks.

Listing reads only each blob's header (magic, manifest), never the libraries. Pruning is a pure
plan (:func:`plan_prune`) that the CLI prints before :func:`execute_prune` runs it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ..remote.backend import RemoteBackend, RemoteUnavailable
from ..remote.blob import BlobError, header_length, open_blob, split
from ..remote.config import RemoteConfig

if TYPE_CHECKING:
    from .check import Check

HEAD_BYTES = 64 << 10
DOCTOR_SAMPLE = 5


@dataclass
class RemoteEntry:
    """One blob in the remote store, as read from its header."""

    key: str
    size: int                      # bytes of the whole blob
    name: str = "?"
    torch: str | None = None
    compiler: str | None = None
    build_method: str | None = None
    created: float = 0.0           # the builder's manifest time (≈ upload time)
    signed: bool = False           # carries an HMAC (checked by `doctor`, and before every use)
    error: str | None = None       # not a readable stubcache blob

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _entry(key: str, head: bytes, size: int, backend: RemoteBackend) -> RemoteEntry:
    need = header_length(head)
    if need is None:
        return RemoteEntry(key, size, error="not a stubcache blob (bad magic or header)")
    if need > len(head):
        found = backend.head(key, need)
        if found is None:
            return RemoteEntry(key, size, error="removed while listing")
        head = found.head
    try:
        tag, manifest_bytes, _ = split(head[:need])
        m = json.loads(manifest_bytes.decode("utf-8"))
        if not isinstance(m, dict):
            raise ValueError("manifest is not an object")
    except (BlobError, ValueError, RecursionError) as exc:  # nesting too deep for the parser
        return RemoteEntry(key, size, error=f"unreadable: {str(exc)[:200]}")
    pre: Any = m.get("preimage") if isinstance(m.get("preimage"), dict) else {}
    fp: Any = pre.get("fingerprint") if isinstance(pre.get("fingerprint"), dict) else {}
    torch = fp["torch"].get("version") if isinstance(fp.get("torch"), dict) else None
    cxx = fp.get("cxx") if isinstance(fp.get("cxx"), dict) else {}
    version = cxx.get("version") if isinstance(cxx.get("version"), str) else None
    created = m.get("created")
    return RemoteEntry(key, size, name=str(m.get("name", "?"))[:100], torch=torch,
                       compiler=version.splitlines()[0] if version else None,
                       build_method=m.get("build_method") if isinstance(m.get("build_method"), str) else None,
                       created=float(created) if isinstance(created, (int, float)) else 0.0, signed=bool(tag))


def list_entries(backend: RemoteBackend) -> list[RemoteEntry]:
    """Every blob under the stubcache prefix (raises :class:`RemoteUnavailable`)."""
    return [_entry(h.key, h.head, h.size, backend) for h in backend.heads(HEAD_BYTES)]


@dataclass
class RemotePruneItem:
    entry: RemoteEntry
    reason: str
    outcome: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.entry.key, "name": self.entry.name, "size": self.entry.size,
                "created": self.entry.created, "reason": self.reason, "outcome": self.outcome}


def plan_prune(entries: list[RemoteEntry], max_age: float, now: float) -> list[RemotePruneItem]:
    """Blobs built more than ``max_age`` seconds before ``now``, and blobs that are not readable
    stubcache blobs (pure). A host that needs a removed stub builds and uploads it again."""
    plan = []
    for e in entries:
        if e.error:
            plan.append(RemotePruneItem(e, e.error))
        elif now - e.created > max_age:
            plan.append(RemotePruneItem(e, f"built {int((now - e.created) // 86400)}d ago" if now - e.created >= 86400
                                        else f"built {int(now - e.created)}s ago"))
    return plan


def execute_prune(backend: RemoteBackend, plan: list[RemotePruneItem]) -> None:
    for item in plan:
        try:
            item.outcome = "removed" if backend.delete_blob(item.entry.key) else "already gone"
        except RemoteUnavailable as exc:
            item.outcome = f"failed: {exc}"


# --- doctor -----------------------------------------------------------------------------------


def doctor_checks(environ: Mapping[str, str] | None = None) -> list[Any]:
    """The remote tier's checks for ``stubcache doctor``: settings, connection, write access,
    eviction policy, and whether sampled blobs carry a valid HMAC under this secret."""
    from .check import Check
    from ..edge.settings import REMOTE, REMOTE_SECRET
    from ..remote.config import RemoteConfigError, config_from_env

    env = os.environ if environ is None else environ
    if not env.get(REMOTE):
        return [Check("remote", "ok", f"not configured ({REMOTE} unset): local cache only")]
    try:
        config = config_from_env(env)
    except RemoteConfigError as exc:
        return [Check("remote config", "error", str(exc), "fix the STUBCACHE_REMOTE_* settings (docs/remote.md)")]
    assert config is not None
    out = [Check("remote config", "ok", f"{config.display_url}, mode {config.mode}, timeout {config.timeout:g}s, "
                 f"secret {'set' if config.secret else 'NOT set (STUBCACHE_REMOTE_INSECURE=1)'}")]
    from ..remote.tier import make_backend

    try:
        backend = make_backend(config)
        t0 = time.perf_counter()
        backend.poll("doctor-probe")
        rtt = time.perf_counter() - t0
    except RemoteUnavailable as exc:
        out.append(Check("remote connection", "error", f"{config.display_url}: {exc}",
                         "check the URL, credentials, network and that the server runs; engines fall "
                         "back to their local cache meanwhile"))
        return out
    try:
        info = backend.describe()
    except RemoteUnavailable:
        info = {}
    out.append(Check("remote connection", "ok", f"{info.get('server', 'connected')}, {rtt * 1000:.1f} ms round trip"))
    if config.writable:
        probe = f"doctor-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            backend.acquire_lease(probe, "doctor", 5.0)
            backend.release_lease(probe, "doctor")
            out.append(Check("remote writes", "ok", "a lease key was written and removed"))
        except RemoteUnavailable as exc:
            out.append(Check("remote writes", "error", f"writes refused: {exc}",
                             "free memory or raise maxmemory (with allkeys-lru), or use STUBCACHE_REMOTE_MODE=read"))
    if info:
        if not info.get("maxmemory"):
            out.append(Check("remote eviction", "warn", "no maxmemory: the remote store grows without bound",
                             "set maxmemory and maxmemory-policy allkeys-lru on the server"))
        elif info.get("maxmemory_policy") != "allkeys-lru":
            out.append(Check("remote eviction", "warn",
                             f"maxmemory-policy is {info.get('maxmemory_policy')}: a full server refuses uploads",
                             "set maxmemory-policy allkeys-lru"))
        else:
            from ..edge.units import human_size

            out.append(Check("remote eviction", "ok", f"allkeys-lru within {human_size(info['maxmemory'])} "
                             f"({human_size(info.get('used_memory', 0))} used)"))
    out.append(_check_secret(backend, config, REMOTE_SECRET))
    backend.close()
    return out


def _check_secret(backend: RemoteBackend, config: RemoteConfig, env_secret: str) -> Check:
    from .check import Check
    from ..remote.blob import MAX_BLOB

    try:
        keys = [h.key for h in backend.heads(64)][:DOCTOR_SAMPLE]
    except RemoteUnavailable as exc:
        return Check("remote secret", "warn", f"could not list blobs: {exc}")
    if config.secret is None:
        return Check("remote secret", "warn", f"{env_secret} is not set: blobs are not authenticated",
                     f"set {env_secret} to the fleet's secret")
    if not keys:
        return Check("remote secret", "ok", "set; no blobs stored yet to check it against")
    bad = []
    for key in keys:
        try:
            raw = backend.get_blob(key, MAX_BLOB)
            if raw is not None:
                open_blob(key, raw, config.secret)
        except BlobError as exc:
            bad.append(f"{key[:12]}: {exc.reason}")
        except RemoteUnavailable as exc:
            return Check("remote secret", "warn", f"could not read blobs: {exc}")
    if len(bad) == len(keys):
        return Check("remote secret", "error", f"none of {len(keys)} sampled blobs carry a valid HMAC under this "
                     f"secret ({bad[0]})", f"use the same {env_secret} as the hosts that upload")
    if bad:
        return Check("remote secret", "warn", f"{len(bad)} of {len(keys)} sampled blobs fail the HMAC "
                     f"({bad[0]}); hosts refuse them and rebuild", "stubcache prune --remote, or find the writer")
    return Check("remote secret", "ok", f"valid HMAC on {len(keys)} sampled blob(s)")
