"""``StubCache``, the public class: a warm ``load`` through the compact hit path, the rest in
:class:`stubcache.cache.core.CacheCore`.

An engine's start makes one cache and loads a few stubs. On a warm host each ``load`` is a hit,
and importing the cache (its store, fingerprint, trust and build machinery) would cost more than
the hit itself; so a :class:`StubCache` made where no setting needs checking is a light object
until something needs the whole cache: ``load`` first asks :mod:`stubcache.hit` for the
record the full path left for the same spec (every check a hit makes is made there), and any
other method or attribute, or a ``load`` that the record cannot answer, goes to the
:class:`~stubcache.cache.core.CacheCore` made on first use, with the same arguments.
"""

from __future__ import annotations

import os

from .. import hit

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from ctypes import CDLL
    from typing import Any

    from ..cache.core import CacheCore, Entry
    from ..key import StubSpec


class StubCache:
    """A content-addressed cache of built stubs under one root directory.

    Args:
        root: cache root; default ``STUBCACHE_DIR`` or ``platformdirs.user_cache_dir("stubcache")``.
        lock_timeout: seconds to wait for another process's build of the same key (default
            ``STUBCACHE_LOCK_TIMEOUT`` or 600). After that this process builds privately and does
            not publish.
        seeds: read-only stores consulted before ``root`` (default ``STUBCACHE_SEED_DIRS``).

    With ``STUBCACHE_REMOTE`` set, a local miss asks the fleet's remote store before building,
    and a build is uploaded after it is published (docs/remote.md). Its settings are checked
    here: :class:`stubcache.remote.RemoteConfigError` on a misconfiguration, and a malformed
    ``STUBCACHE_*`` setting raises :class:`stubcache.edge.settings.SettingsError`.

    Every method and attribute of :class:`stubcache.cache.core.CacheCore` (``get_or_build``,
    ``lookup``, ``key``, ``preimage``, ``load_entry``, ``loaded_path``, ``store``, ...) is
    available here; see there.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, lock_timeout: float | None = None,
                 seeds: list[str] | None = None) -> None:
        self._args = (root, lock_timeout, seeds)
        self._core: CacheCore | None = None
        quick_root = None
        if seeds is None and hit.quick_settings():
            quick_root = hit.default_root() if root is None else os.path.abspath(os.fspath(root))
        self._quick_root = quick_root
        if quick_root is None:  # settings to check now, seed stores, no known root: the whole cache
            self._full()

    def _full(self) -> CacheCore:
        core = self._core
        if core is None:
            from ..cache.core import CacheCore

            root, lock_timeout, seeds = self._args
            if self._quick_root is not None:
                # As resolved when this cache was made (and no STUBCACHE_SEED_DIRS then): a later
                # chdir or change of STUBCACHE_DIR must not move a cache that may have hit already.
                root, seeds = self._quick_root, []
            core = self._core = CacheCore(root, lock_timeout=lock_timeout, seeds=seeds)
        return core

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_args", "_core", "_quick_root"):
            raise AttributeError(name)
        return getattr(self._full(), name)

    @property
    def root(self) -> str:
        """The cache root (absolute)."""
        return self._quick_root if self._core is None else self._core.root  # type: ignore[return-value]  # no core: a quick root

    def __repr__(self) -> str:
        return f"StubCache({self.root!r})"

    def load(self, spec: StubSpec) -> CDLL:
        """``get_or_build`` and ``dlopen`` the library; returns a ``ctypes.CDLL``."""
        miss = hit.Miss()
        root = self._quick_root
        if root is not None and self._core is None:  # (once the whole cache is made, its memo answers)
            from ..key import StubSpec  # loaded already: the caller made the spec

            digest = hit.request_digest("spec", (spec.canonical(),)) if type(spec) is StubSpec else None
            if digest is not None:
                found, miss = hit.serve(root, digest, make_root=True)  # a valid request: a spec
                if found is not None:
                    lib = hit.load(found)
                    if lib is not None:
                        miss.release()
                        return lib
        try:
            core = self._full()
            entry = core.get_or_build_since(spec, miss.since)
            lib = core.load_entry(entry)
            if miss.digest is not None:
                core.remember_hit(spec, entry, miss.digest)  # (then the start template)
            else:
                core.leave_start_template()
            return lib
        finally:
            miss.release()  # the record is there (or cannot be): the next process's turn

    def get_or_build(self, spec: StubSpec) -> Entry:
        """See :meth:`stubcache.cache.core.CacheCore.get_or_build`."""
        return self._full().get_or_build(spec)
