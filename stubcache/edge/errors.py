"""Exception types. Every error stubcache raises on purpose derives from :class:`StubCacheError`."""

from __future__ import annotations


class StubCacheError(Exception):
    """Base class of all stubcache errors."""


class BuildError(StubCacheError, RuntimeError):
    """A stub failed to compile or link (invariant 8 of docs/design.md).

    A :class:`RuntimeError`, as torch's own build failures are, so ``except RuntimeError`` written
    against ``torch.utils.cpp_extension`` keeps catching it; the message has torch's shape,
    ``Error building extension 'name': <compiler output>``.

    ``output`` holds the compiler's (or ninja's) output; ``key`` the key that was being built.
    Nothing was published for that key.
    """

    def __init__(self, message: str, *, output: str = "", key: str = "", name: str = "") -> None:
        super().__init__(message if not output else f"{message}: {output}")
        self.output = output
        self.key = key
        self.name = name


class LockTimeoutError(StubCacheError):
    """Another process held a build lock for longer than ``STUBCACHE_LOCK_TIMEOUT``."""


class IntegrityError(StubCacheError):
    """A published entry did not match its manifest (it has been quarantined)."""


class TrustError(StubCacheError):
    """A cache path failed the ownership/permission checks; nothing was loaded from it."""


class UntrustedRootError(TrustError):
    """This user has not chosen to trust the root: nothing is loaded from it or published into
    it (the cache builds privately). ``how`` says how to trust it."""

    def __init__(self, message: str, how: str) -> None:
        super().__init__(message)
        self.how = how


class UnsupportedError(StubCacheError, ValueError):
    """An option of torch's loaders that stubcache's drop-ins do not handle (SYCL, ``gil_not_used``,
    ...). A :class:`ValueError`, as before it had a base of its own; the patched torch loaders hand
    such a call to torch's own function instead."""


class CacheMissError(StubCacheError):
    """``STUBCACHE_REQUIRE_HIT`` is set and the requested stub is not in any cache."""
