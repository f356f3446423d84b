"""The Redis backend of the remote tier (``redis://`` and ``rediss://`` URLs).

Key layout (one versioned prefix, so a future format can live beside this one)::

    stubcache:v1:blob:<key>     the blob (see :mod:`.blob`), one SET NX, no expiry
    stubcache:v1:lease:<key>    a build lease: SET NX PX, renewed by the builder, JSON value

Eviction is Redis' own: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``.
Every call uses the configured timeout for connecting and for each reply, and is tried once
(no client-side retries: a fleet start must not stall on a sick server).
"""

from __future__ import annotations

import functools
from typing import Iterator

from .backend import BlobHead, RemoteBackend, RemoteUnavailable
from .config import RemoteConfig

PREFIX = "stubcache:v1:"
BLOB = PREFIX + "blob:"
LEASE = PREFIX + "lease:"

# Compare-and-set on the lease value: only its holder may renew or release it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def _wrap(fn):
    """Turn every client or socket error into :class:`RemoteUnavailable`."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except RemoteUnavailable:
            raise
        except self._errors as exc:
            raise RemoteUnavailable(f"{type(exc).__name__}: {exc}") from exc
    return call


class RedisBackend(RemoteBackend):
    """:class:`~.backend.RemoteBackend` on one Redis server (``redis-py`` client)."""

    def __init__(self, config: RemoteConfig) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors = (redis.exceptions.RedisError, OSError)
        self._redis = redis.Redis.from_url(
            config.url, socket_timeout=config.timeout, socket_connect_timeout=config.timeout,
            retry_on_timeout=False, retry=Retry(NoBackoff(), 0), health_check_interval=0,
            lib_name=None, lib_version=None)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)

    @_wrap
    def get_blob(self, key: str, limit: int) -> bytes | None:
        value = self._redis.getrange(BLOB + key, 0, limit)
        return value or None

    @_wrap
    def put_blob(self, key: str, value: bytes) -> bool:
        return bool(self._redis.set(BLOB + key, value, nx=True))

    @_wrap
    def poll(self, key: str) -> tuple[bool, str | None]:
        pipe = self._redis.pipeline(transaction=False)
        pipe.exists(BLOB + key)
        pipe.get(LEASE + key)
        exists, lease = pipe.execute()
        return bool(exists), lease.decode("utf-8", "replace") if lease is not None else None

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
    def describe(self) -> dict:
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
