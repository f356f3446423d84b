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
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar, cast

from . import resp
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


_backends: weakref.WeakSet[RedisBackend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child (an engine's worker) starts with its parent's connection and with its locks
    # in whatever state the parent's threads left them: it takes neither. Two processes on one
    # socket would read each other's replies; closing the child's copy leaves the parent's open.
    for backend in list(_backends):
        backend._client_lock = threading.Lock()
        backend._fetch_lock = threading.Lock()
        backend._close_fetch()


os.register_at_fork(after_in_child=_after_fork_in_child)


class RedisBackend(RemoteBackend):
    """:class:`~.backend.RemoteBackend` on one Redis server. A fetch (:meth:`get_blob`) speaks the
    protocol itself (:mod:`.resp`) where the URL allows, so a remote hit never imports redis-py;
    everything else goes through a ``redis-py`` client made on first use."""

    def __init__(self, config: RemoteConfig) -> None:
        self._config = config
        self._timeout = config.timeout
        self._errors: tuple[type[BaseException], ...] = (OSError, resp.RespError)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._scripts: tuple[Any, Any] = (None, None)  # LUA scripts of the lease, with the client
        self._fetch_target = resp.fetch_target(config.url)
        self._fetch_lock = threading.Lock()
        self._fetch_conn: tuple[_BoundedSocket, resp.Reader] | None = None
        _backends.add(self)

    @property
    def _redis(self) -> Any:
        """The redis-py client (imported and made here, the first time it is needed)."""
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = self._make_client()
                except Exception as exc:  # a URL redis-py refuses, a broken install: local-only
                    raise RemoteUnavailable(f"cannot make the redis client: {type(exc).__name__}: {exc}") from exc
                if getattr(_call, "end", None) is not None:
                    # The bound is for the network: importing redis-py (0.1-0.2 s, more on a
                    # loaded host) must not use up the first call's, or a 0.3 s bound failed
                    # a host's lease claim before a byte was sent.
                    _call.end, _call.moved = time.monotonic() + self._timeout, 0
        return self._client

    def _make_client(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        tcp, tls = _connection_classes()
        client = redis.Redis.from_url(
            self._config.url, connection_class=tls if self._config.scheme == "rediss" else tcp,
            socket_timeout=self._timeout, socket_connect_timeout=self._timeout,
            retry_on_timeout=False, retry=Retry(NoBackoff(), 0), health_check_interval=0,
            lib_name=None, lib_version=None)
        self._scripts = (client.register_script(_RENEW), client.register_script(_RELEASE))
        self._errors = (redis.exceptions.RedisError, OSError, resp.RespError)
        return client

    @_wrap
    def get_blob(self, key: str, limit: int) -> bytes | None:
        if self._fetch_target is None:
            value = self._redis.getrange(BLOB + key, 0, limit)
            return value or None  # bytes: no decode_responses
        with self._fetch_lock:
            if self._fetch_conn is not None and self._fetch_conn[1].pending():
                # The server sent what no command asked for (a second reply left in the buffer,
                # or bytes since), or closed: never read as this command's reply.
                self._close_fetch()
            try:
                if self._fetch_conn is None:
                    end = getattr(_call, "end", None) or time.monotonic() + self._timeout
                    left = max(end - time.monotonic(), 0.001)
                    sock = _BoundedSocket(resp.connect(self._fetch_target, min(self._timeout, left)))
                    sock.settimeout(self._timeout)
                    self._fetch_conn = (sock, resp.Reader(sock))  # type: ignore[arg-type]  # a socket's interface
                    resp.handshake(sock, self._fetch_conn[1], self._fetch_target)  # type: ignore[arg-type]
                sock, reader = self._fetch_conn
                return resp.getrange(sock, reader, BLOB + key, 0, limit) or None  # type: ignore[arg-type]
            except BaseException:
                self._close_fetch()  # a connection in an unknown state is never reused
                raise

    def _close_fetch(self) -> None:
        if self._fetch_conn is not None:
            conn, self._fetch_conn = self._fetch_conn, None
            try:
                conn[0].close()
            except OSError:
                pass

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
        self._redis  # (registers the scripts)
        return bool(self._scripts[0](keys=[LEASE + key], args=[value, max(int(ttl * 1000), 1)]))

    @_wrap
    def release_lease(self, key: str, value: str) -> None:
        self._redis  # (registers the scripts)
        self._scripts[1](keys=[LEASE + key], args=[value])

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
        with self._fetch_lock:
            self._close_fetch()
        if self._client is None:
            return
        try:
            self._client.close()
        except Exception:  # closing a broken connection must not raise
            pass
