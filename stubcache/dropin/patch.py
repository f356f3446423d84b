"""Routing torch's own loaders through the cache: :func:`patch_torch`, :func:`unpatch_torch`
(torch's own functions are kept by :mod:`stubcache.build.torchjit`)."""

from __future__ import annotations

import sys
import threading

from ..build.torchjit import is_dropin, mark, remembered_original, torch_original

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Callable

NAMES = ("load_inline", "load")
_MODULE = "torch.utils.cpp_extension"
_lock = threading.RLock()


def _wrapper(name: str) -> Callable[..., Any]:
    # Nothing heavy is imported here: under `stubcache run` this runs as torch's cpp_extension is
    # first imported, and a warm load_inline call then takes the compact hit path (through the
    # public drop-in, stubcache.load_inline); the whole drop-ins (stubcache.dropin.compat) load on
    # the first call that needs them.
    original = torch_original(name)
    front: Callable[..., Any] | None = None
    if name == "load_inline":
        from .. import load_inline as front

    def patched(*args: Any, **kwargs: Any) -> Any:
        fn = front
        if fn is None:
            from . import compat

            fn = getattr(compat, name)
        try:
            return fn(*args, **kwargs)
        except ValueError as exc:  # UnsupportedError is one
            from ..edge.errors import UnsupportedError

            if not isinstance(exc, UnsupportedError):
                raise
            # An option stubcache does not handle (SYCL, is_standalone, ...): torch's own loader,
            # exactly as the unpatched program would have called it.
            return original(*args, **kwargs)

    patched.__name__ = patched.__qualname__ = name
    patched.__doc__ = (front or original).__doc__  # load: torch's own text (same parameters)
    patched.__wrapped__ = original  # type: ignore[attr-defined]
    return mark(patched)


def patch_torch(module: Any = None) -> None:
    """Route ``torch.utils.cpp_extension.load_inline`` and ``load`` through the cache.

    Idempotent; :func:`unpatch_torch` restores torch's functions. Code that already did
    ``from torch.utils.cpp_extension import load_inline`` keeps the binding it took; run such
    programs under ``stubcache run``, which patches before any user code runs. Calls with options
    stubcache does not support go to torch's own function unchanged.
    """
    if module is None:
        import torch.utils.cpp_extension as module
    with _lock:
        for name in NAMES:  # all of torch's functions remembered before any is replaced
            torch_original(name)
        for name in NAMES:
            if not is_dropin(getattr(module, name)):
                setattr(module, name, _wrapper(name))


def unpatch_torch() -> None:
    """Undo :func:`patch_torch` (a no-op if torch was never patched or never imported)."""
    module = sys.modules.get(_MODULE)
    if module is None:
        return
    with _lock:
        for name in NAMES:
            original = remembered_original(name)
            if is_dropin(getattr(module, name, None)) and original is not None:
                setattr(module, name, original)


def is_patched() -> bool:
    """Whether torch's loaders currently go through stubcache."""
    module = sys.modules.get(_MODULE)
    return module is not None and all(is_dropin(getattr(module, n, None)) for n in NAMES)
