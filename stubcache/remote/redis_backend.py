"""The Redis backend of the remote tier (``redis://`` and ``rediss://`` URLs).

Key layout (one versioned prefix, so a future format can live beside this one)::

    stubcache:v1:blob:<key>     the blob (see :mod:`.blob`), one SET NX, no expiry
    stubcache:v1:lease:<key>    a build lease: SET NX PX, renewed by the builder, JSON value

Eviction is Redis' own: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``.
Every call is tried once (no client-side retries: a fleet start must not stall on a sick server)
and bounded as a whole, not only per read: it must end within the configured timeout plus one
second per :data:`MIN_RATE` bytes it moves, so a link that delivers a byte at a time fails it as
surely as a silent one (redis-py's own socket timeout restarts with every byte received).
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar, cast

from .backend import BlobHead, RemoteBackend, RemoteUnavailable
from .config import RemoteConfig

if TYPE_CHECKING:
    from redis.connection import Connection, SSLConnection

_F = TypeVar("_F", bound=Callable[..., Any])
PREFIX = "stubcache:v1:"
BLOB = PREFIX + "blob:"
LEASE = PREFIX + "lease:"

# Compare-and-set on the lease value: only its holder may renew or release it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


LEASE_MAX = 1024    # bytes of a lease value read (ours are ~150; anyone may write a larger one)
MIN_RATE = 1 << 20  # bytes per second a transfer must keep up, on average, past the timeout

# The bound of the backend call running in this thread (the heartbeat thread has its own).
_call = threading.local()


class _BoundedSocket:
    """A connected socket whose every send and receive ends by the bound of the backend call in
    progress: ``start + timeout + bytes moved / MIN_RATE`` (see the module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._base = sock.gettimeout()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def settimeout(self, value: float | None) -> None:
        self._base = value
        self._sock.settimeout(value)

    def _arm(self) -> None:
        end = getattr(_call, "end", None)
        if end is None:
            self._sock.settimeout(self._base)
            return
        left = end + _call.moved / MIN_RATE - time.monotonic()
        if left <= 0:
            raise socket.timeout("the call ran past STUBCACHE_REMOTE_TIMEOUT (too slow a transfer)")
        self._sock.settimeout(left if self._base is None else min(self._base, left))

    def _moved(self, n: int) -> int:
        if getattr(_call, "end", None) is not None:
            _call.moved += n
        return n

    def recv(self, *args: Any) -> bytes:
        self._arm()
        data = self._sock.recv(*args)
        self._moved(len(data))
        return data

    def recv_into(self, *args: Any) -> int:
        self._arm()
        return self._moved(self._sock.recv_into(*args))

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            self._arm()
            view = view[self._moved(self._sock.send(view[:1 << 20])):]


def _wrap(fn: _F) -> _F:
    """Bound the call as a whole (see the module docstring) and turn every client or socket
    error into :class:`RemoteUnavailable`."""
    @functools.wraps(fn)
    def call(self: RedisBackend, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_call, "end", None) is not None
        if not outer:
            _call.end, _call.moved = time.monotonic() + self._timeout, 0
        try:
            return fn(self, *args, **kwargs)
        except RemoteUnavailable:
            raise
        except self._errors as exc:
            raise RemoteUnavailable(f"{type(exc).__name__}: {exc}") from exc
        finally:
            if not outer:
                _call.end = None
    return cast(_F, call)


def _connection_classes() -> tuple[type[Connection], type[SSLConnection]]:
    """redis-py's TCP and TLS connections with their sockets bounded per call."""
    from redis.connection import Connection, SSLConnection

    class BoundedConnection(Connection):
        def _connect(self) -> Any:
            return _BoundedSocket(super()._connect())  # type: ignore[no-untyped-call]  # redis-py leaves it untyped

    class BoundedSSLConnection(SSLConnection):
        def _connect(self) -> Any:
            return _BoundedSocket(super()._connect())  # type: ignore[no-untyped-call]  # redis-py leaves it untyped

    return BoundedConnection, BoundedSSLConnection


class RedisBackend(RemoteBackend):
    """:class:`~.backend.RemoteBackend` on one Redis server (``redis-py`` client)."""

    def __init__(self, config: RemoteConfig) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.exceptions.RedisError, OSError)
        self._timeout = config.timeout
        tcp, tls = _connection_classes()
        self._redis = redis.Redis.from_url(
            config.url, connection_class=tls if config.scheme == "rediss" else tcp,
            socket_timeout=config.timeout, socket_connect_timeout=config.timeout,
            retry_on_timeout=False, retry=Retry(NoBackoff(), 0), health_check_interval=0,
            lib_name=None, lib_version=None)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)

    @_wrap
    def get_blob(self, key: str, limit: int) -> bytes | None:
        value = self._redis.getrange(BLOB + key, 0, limit)
        return value or None  # type: ignore[return-value]  # bytes: no decode_responses

    @_wrap
    def put_blob(self, key: str, value: bytes) -> bool:
        return bool(self._redis.set(BLOB + key, value, nx=True))

    @_wrap
    def poll(self, key: str) -> tuple[bool, str | None]:
        pipe = self._redis.pipeline(transaction=False)
        pipe.exists(BLOB + key)
        pipe.getrange(LEASE + key, 0, LEASE_MAX - 1)  # polled often: never a planted huge value
        exists, lease = pipe.execute()
        return bool(exists), lease.decode("utf-8", "replace") if lease else None

    @_wrap
    def acquire_lease(self, key: str, value: str, ttl: float) -> bool:
        return bool(self._redis.set(LEASE + key, value, nx=True, px=max(int(ttl * 1000), 1)))

    @_wrap
    def renew_lease(self, key: str, value: str, ttl: float) -> bool:
        return bool(self._renew(keys=[LEASE + key], args=[value, max(int(ttl * 1000), 1)]))

    @_wrap
    def release_lease(self, key: str, value: str) -> None:
        self._release(keys=[LEASE + key], args=[value])

    def heads(self, nbytes: int) -> Iterator[BlobHead]:
        keys = self._scan()
        for i in range(0, len(keys), 200):
            yield from self._heads(keys[i:i + 200], nbytes)

    @_wrap
    def _scan(self) -> list[str]:
        return sorted(k.decode("ascii", "replace")[len(BLOB):]
                      for k in self._redis.scan_iter(match=BLOB + "*", count=1000))

    @_wrap
    def _heads(self, keys: list[str], nbytes: int) -> list[BlobHead]:
        pipe = self._redis.pipeline(transaction=False)
        for k in keys:
            pipe.getrange(BLOB + k, 0, nbytes - 1)
            pipe.strlen(BLOB + k)
        res = pipe.execute()
        return [BlobHead(k, res[2 * i], int(res[2 * i + 1])) for i, k in enumerate(keys) if res[2 * i + 1]]

    def head(self, key: str, nbytes: int) -> BlobHead | None:
        found = self._heads([key], nbytes)
        return found[0] if found else None

    @_wrap
    def delete_blob(self, key: str) -> bool:
        return bool(self._redis.delete(BLOB + key))

    @_wrap
    def describe(self) -> dict[str, Any]:
        server = self._redis.info("server")
        memory = self._redis.info("memory")
        return {"server": f"redis {server.get('redis_version', '?')}",
                "maxmemory": int(memory.get("maxmemory", 0) or 0),
                "used_memory": int(memory.get("used_memory", 0) or 0),
                "maxmemory_policy": str(memory.get("maxmemory_policy", "?"))}

    def close(self) -> None:
        try:
            self._redis.close()
        except Exception:  # closing a broken connection must not raise
            pass
