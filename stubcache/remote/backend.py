"""The interface a remote backend implements. Redis is the first (:mod:`.redis_backend`).

A backend stores opaque values under entry keys and offers one lease per key. It needs four
properties, which is what another store (an object store, say) must provide to plug in:

* a value is written whole in one operation (never visible half written), and only if the
  key has none yet;
* a lease is created only if absent, with an expiry, and renewed or released only by the
  holder that created it (compare-and-set on the value);
* every call returns or fails within the configured timeout;
* every failure, whatever its cause, is raised as :class:`RemoteUnavailable`.

Verification (HMAC, checksums) and policy (waiting, taking over) live in :mod:`.tier`, not here.
"""

from __future__ import annotations

from typing import Any, Iterator


class RemoteUnavailable(Exception):
    """The remote store could not be reached, timed out, or refused the operation (for example
    Redis' ``OOM`` under ``maxmemory``). The caller falls back to local-only behaviour."""


class BlobHead:
    """The first bytes of a stored blob and its total size (for listing without downloading)."""

    __slots__ = ("key", "head", "size")

    def __init__(self, key: str, head: bytes, size: int) -> None:
        self.key = key
        self.head = head
        self.size = size


class RemoteBackend:
    """Abstract remote store. Constructed with ``(config)``: a :class:`~.config.RemoteConfig`."""

    def get_blob(self, key: str, limit: int) -> bytes | None:
        """The blob stored for ``key``, or ``None``. A value longer than ``limit`` bytes may be
        returned truncated to ``limit + 1`` bytes (so the caller can refuse it)."""
        raise NotImplementedError

    def put_blob(self, key: str, value: bytes) -> bool:
        """Store ``value`` for ``key`` in one atomic write, only if no blob exists for ``key``
        (blobs are immutable: a host can never replace what others may be verifying or loading,
        nor can a host with a wrong secret overwrite the fleet's blobs). True if stored."""
        raise NotImplementedError

    def poll(self, key: str) -> tuple[bool, str | None]:
        """``(a blob exists, the current lease value or None)`` in one round trip."""
        raise NotImplementedError

    def acquire_lease(self, key: str, value: str, ttl: float) -> bool:
        """Create the lease of ``key`` holding ``value`` for ``ttl`` seconds if none exists."""
        raise NotImplementedError

    def renew_lease(self, key: str, value: str, ttl: float) -> bool:
        """Extend the lease to ``ttl`` seconds from now if it still holds ``value``."""
        raise NotImplementedError

    def release_lease(self, key: str, value: str) -> None:
        """Delete the lease if it still holds ``value``."""
        raise NotImplementedError

    def heads(self, nbytes: int) -> Iterator[BlobHead]:
        """Every stored blob's first ``nbytes`` bytes and size (for ``ls``/``prune --remote``)."""
        raise NotImplementedError

    def head(self, key: str, nbytes: int) -> BlobHead | None:
        """One blob's first ``nbytes`` bytes and size, or ``None`` if it is gone."""
        raise NotImplementedError

    def delete_blob(self, key: str) -> bool:
        """Remove the blob of ``key``; True if it existed."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Server facts for ``stubcache doctor`` (version, memory limit, eviction policy...)."""
        return {}

    def close(self) -> None:
        """Release connections."""
