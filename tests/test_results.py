"""Results whose meanings a reader cannot merge by accident (docs/design.md, "Errors and results")."""

from __future__ import annotations

import pytest

import stubcache
from stubcache.cache.core import CorruptEntry
from stubcache.edge import errors


def test_a_corrupt_entry_is_neither_a_hit_nor_a_miss():
    found = CorruptEntry("0" * 32, "manifest missing")
    with pytest.raises(TypeError, match="neither a hit nor a miss"):
        bool(found)
    with pytest.raises(TypeError):
        if not found:
            pass


def test_every_deliberate_error_is_a_stubcache_error_with_the_bases_callers_catch():
    public = {name: getattr(stubcache, name) for name in stubcache.__all__ if name.endswith("Error")}
    assert set(public) == {"BuildError", "CacheMissError", "IntegrityError", "LockTimeoutError", "StubCacheError",
                           "TrustError", "UnsupportedError"}
    assert all(issubclass(cls, stubcache.StubCacheError) for cls in public.values())
    assert issubclass(stubcache.BuildError, RuntimeError)  # torch's build failures are RuntimeErrors
    assert issubclass(stubcache.UnsupportedError, ValueError)
    assert issubclass(errors.UntrustedRootError, stubcache.TrustError)
    defined = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, Exception)}
    assert all(issubclass(getattr(errors, n), errors.StubCacheError) for n in defined)


def test_the_module_names_before_the_layer_folders_still_answer():
    """docs/cache.md quoted ``stubcache.compat.Unsupported`` before the package had layer folders."""
    assert stubcache.compat.Unsupported is stubcache.UnsupportedError
    assert stubcache.compat.load is stubcache.load and stubcache.patch.patch_torch is stubcache.patch_torch
