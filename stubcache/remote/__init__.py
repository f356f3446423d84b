"""The remote tier: a fleet-wide store of built stubs on an existing distributed engine.

Hosts that miss locally download a verified blob and publish it into their own root; one host
per key builds (holding a fleet-wide lease) and uploads. Redis is the first backend
(:mod:`stubcache.remote.redis_backend`); :class:`stubcache.remote.backend.RemoteBackend` is the
interface another backend implements (see docs/remote.md).

Nothing here is imported by ``import stubcache`` or on a local hit: :mod:`stubcache.cache.core`
imports :mod:`.config` only when ``STUBCACHE_REMOTE`` is set, and :mod:`.tier` (and the Redis
client) only on a local miss.
"""

from __future__ import annotations

from .config import RemoteConfig, RemoteConfigError, config_from_env

__all__ = ["RemoteConfig", "RemoteConfigError", "config_from_env"]
