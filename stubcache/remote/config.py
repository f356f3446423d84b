"""Remote-tier settings from the environment (or CLI options), and the start-up checks.

Imported on the hit path whenever ``STUBCACHE_REMOTE`` is set, so it imports nothing heavy and
never the Redis client.
"""

from __future__ import annotations

import os
from typing import Mapping

from ..edge.errors import StubCacheError

from ..edge.settings import REMOTE, REMOTE_INSECURE, REMOTE_LEASE, REMOTE_MODE, REMOTE_SECRET, REMOTE_TIMEOUT

MODE_READ = "read"
MODE_READ_WRITE = "read-write"
MODES = (MODE_READ, MODE_READ_WRITE)
DEFAULT_TIMEOUT = 2.0    # seconds, per network call
DEFAULT_LEASE = 15.0     # seconds a build lease lives without a heartbeat
MIN_SECRET_BYTES = 16
ENV_REMOTE_HINT = f"{REMOTE} is set"

# URL scheme -> "module:class" of the backend. Adding a backend is one line here (docs/remote.md).
BACKENDS = {
    "redis": "stubcache.remote.redis_backend:RedisBackend",
    "rediss": "stubcache.remote.redis_backend:RedisBackend",
}
# The client package each backend needs (checked at start-up without importing it).
BACKEND_PACKAGES = {"redis": "redis", "rediss": "redis"}


class RemoteConfigError(StubCacheError):
    """The remote tier is misconfigured (raised when a :class:`~stubcache.StubCache` is made)."""


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _seconds(raw: str | None, name: str, default: float) -> float:
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise RemoteConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise RemoteConfigError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and CLI output)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    auth, at, host = rest.rpartition("@")
    if not at:
        return url
    user, colon, _ = auth.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}" if user else f"{scheme}://***@{host}"


def _check_url(url: str) -> None:
    """Refuse a URL the client would reject on first use (a bad port) or misread silently (a
    database that is not a number falls back to 0: another fleet's keyspace)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # raises on a port that is not a number in 0-65535
    except ValueError as exc:
        raise RemoteConfigError(f"{REMOTE}={redact(url)!r}: {exc}") from None
    if port == 0:  # redis-py before 8 connects to 6379, from 8 to port 0: no one reading means it
        raise RemoteConfigError(f"{REMOTE}={redact(url)!r}: port 0 names no server; give the port "
                                "(redis://host:6379/0) or leave it out for 6379")
    db = parts.path[1:] if parts.path.startswith("/") else parts.path
    if db and not (db.isascii() and db.isdigit()):
        raise RemoteConfigError(f"{REMOTE}={redact(url)!r}: the database must be a number "
                                f"(redis://host:port/DB), got {db!r}")


class RemoteConfig:
    """Validated remote-tier settings.

    Attributes:
        url: backend URL, e.g. ``redis://user:pw@host:6379/0`` (``rediss://`` for TLS).
        scheme: the URL scheme (selects the backend).
        mode: ``"read"`` or ``"read-write"``.
        secret: HMAC-SHA256 key (bytes) or ``None`` (allowed only in read mode with
            ``STUBCACHE_REMOTE_INSECURE=1``, or for admin commands that load no code).
        timeout: seconds allowed to each network call.
        lease: seconds a build lease lives unless renewed (the builder renews it every third).
    """

    __slots__ = ("url", "scheme", "mode", "secret", "timeout", "lease", "insecure")

    def __init__(self, url: str, mode: str, secret: bytes | None, timeout: float, lease: float,
                 insecure: bool) -> None:
        self.url = url
        self.scheme = url.partition("://")[0].lower()
        self.mode = mode
        self.secret = secret
        self.timeout = timeout
        self.lease = lease
        self.insecure = insecure

    @property
    def writable(self) -> bool:
        return self.mode == MODE_READ_WRITE

    @property
    def display_url(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:
        return (f"RemoteConfig(url={self.display_url!r}, mode={self.mode!r}, "
                f"secret={'set' if self.secret else 'unset'}, timeout={self.timeout}, lease={self.lease})")


def config_from_env(environ: Mapping[str, str] | None = None, *, url: str | None = None,
                    mode: str | None = None, timeout: str | float | None = None,
                    for_admin: bool = False) -> RemoteConfig | None:
    """The remote settings from ``environ`` (default ``os.environ``), overridden by CLI options.

    Returns ``None`` when no URL is configured. Raises :class:`RemoteConfigError` on anything a
    person has to fix: an unknown scheme, a bad mode or timeout, read-write without
    ``STUBCACHE_REMOTE_SECRET``, read without a secret unless ``STUBCACHE_REMOTE_INSECURE=1``, a
    secret shorter than 16 bytes, or the backend's client package not installed. ``for_admin``
    (``ls``/``prune``/``doctor``, which load no code) skips the secret requirements.
    """
    env = os.environ if environ is None else environ
    url = url if url is not None else env.get(REMOTE, "")
    url = url.strip()
    if not url:
        return None
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in BACKENDS:
        raise RemoteConfigError(
            f"{REMOTE}={redact(url)!r}: unsupported URL; use redis://[user:password@]host:port/db "
            f"or rediss://… for TLS (supported schemes: {', '.join(sorted(BACKENDS))})")
    _check_url(url)
    url = scheme + url[len(scheme):]  # REDIS://… as redis:// (the client accepts only the latter)
    mode = (mode if mode is not None else env.get(REMOTE_MODE, "")).strip().lower() or MODE_READ_WRITE
    if mode not in MODES:
        raise RemoteConfigError(f"{REMOTE_MODE} must be 'read' or 'read-write', got {mode!r}")
    t = _seconds(str(timeout) if timeout is not None else env.get(REMOTE_TIMEOUT), REMOTE_TIMEOUT, DEFAULT_TIMEOUT)
    lease = _seconds(env.get(REMOTE_LEASE), REMOTE_LEASE, DEFAULT_LEASE)
    raw_secret = env.get(REMOTE_SECRET, "")
    secret = raw_secret.encode("utf-8", "surrogateescape") if raw_secret else None
    insecure = _flag(env.get(REMOTE_INSECURE))
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise RemoteConfigError(f"{REMOTE_SECRET} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                                "random bytes (e.g. `openssl rand -hex 32`), the same on every host")
    if not for_admin and secret is None:
        if mode == MODE_READ_WRITE:
            raise RemoteConfigError(
                f"{ENV_REMOTE_HINT}: read-write mode needs {REMOTE_SECRET} (an HMAC key shared by the fleet, "
                f"so that a writer to the remote store cannot plant code on hosts); set it, or set "
                f"{REMOTE_MODE}=read")
        if not insecure:
            raise RemoteConfigError(
                f"{ENV_REMOTE_HINT}: read mode without {REMOTE_SECRET} loads unauthenticated native code "
                f"from the remote store; set {REMOTE_SECRET}, or set {REMOTE_INSECURE}=1 to accept that risk")
    pkg = BACKEND_PACKAGES.get(scheme)
    if pkg:
        import importlib.util

        if importlib.util.find_spec(pkg) is None:
            raise RemoteConfigError(f"{REMOTE} is set but the {pkg!r} client package is not installed: "
                                    "pip install 'stubcache[remote]'")
    return RemoteConfig(url, mode, secret, t, lease, insecure)

