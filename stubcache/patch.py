"""Routing torch's own loaders through the cache: :func:`patch_torch`, :func:`unpatch_torch`, and
the references to torch's original functions that the builder calls.

The builder must never call ``torch.utils.cpp_extension.load_inline`` through the module
attribute: once that attribute is stubcache's drop-in, the build would call back into the cache
while holding its locks. :func:`torch_original` returns torch's own function whatever the
attribute holds now.
"""

from __future__ import annotations

import sys
from _thread import RLock  # threading.RLock without importing threading (hit path)

from .dropin import MARK as _MARK  # set on the drop-ins and on the wrappers installed here

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Callable

NAMES = ("load_inline", "load")
_MODULE = "torch.utils.cpp_extension"
_originals: dict[str, Callable[..., Any]] = {}
_lock = RLock()


def is_dropin(fn: Any) -> bool:
    """True for stubcache's drop-ins and the wrappers :func:`patch_torch` installs."""
    return bool(getattr(fn, _MARK, False))


def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, _MARK, True)
    return fn


def _fresh_module() -> Any:
    """A private copy of torch's ``cpp_extension`` module, for when its attributes were replaced
    by someone else before stubcache first looked (``cpp_extension.load_inline = stubcache...``)."""
    import importlib.util

    import torch.utils.cpp_extension as cpp_ext

    spec = importlib.util.spec_from_file_location("torch.utils._stubcache_cpp_extension", cpp_ext.__file__)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]  # a .py file: a spec
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def torch_original(name: str) -> Callable[..., Any]:
    """torch's own ``cpp_extension.<name>`` (``load_inline`` or ``load``), never a drop-in."""
    fn = _originals.get(name)
    if fn is not None:
        return fn
    import torch.utils.cpp_extension as cpp_ext

    with _lock:
        fn = _originals.get(name)
        if fn is None:
            fn = getattr(cpp_ext, name)
            if is_dropin(fn):
                fn = getattr(_fresh_module(), name)
            _originals[name] = fn
    return fn


def _wrapper(name: str) -> Callable[..., Any]:
    # Nothing heavy is imported here: under `stubcache run` this runs as torch's cpp_extension is
    # first imported, and a warm load_inline call then takes the compact hit path (its front,
    # stubcache.dropin); the whole drop-ins (stubcache.compat) load on the first call that needs them.
    original = torch_original(name)
    front: Callable[..., Any] | None = None
    if name == "load_inline":
        from .dropin import load_inline as front

    def patched(*args: Any, **kwargs: Any) -> Any:
        fn = front
        if fn is None:
            from . import compat

            fn = getattr(compat, name)
        try:
            return fn(*args, **kwargs)
        except ValueError as exc:  # compat.Unsupported is one; compat is imported only then
            from .compat import Unsupported

            if not isinstance(exc, Unsupported):
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
            if is_dropin(getattr(module, name, None)) and name in _originals:
                setattr(module, name, _originals[name])


def is_patched() -> bool:
    """Whether torch's loaders currently go through stubcache."""
    module = sys.modules.get(_MODULE)
    return module is not None and all(is_dropin(getattr(module, n, None)) for n in NAMES)
