"""torch's own ``cpp_extension.load_inline`` and ``load``, whatever the module attributes hold now.

The builder must never call ``torch.utils.cpp_extension.load_inline`` through the module
attribute: once that attribute is stubcache's drop-in (:func:`stubcache.patch_torch`), the build
would call back into the cache while holding its locks. :func:`torch_original` returns torch's
own function; :func:`mark` and :func:`is_dropin` tell stubcache's functions from torch's.
"""

from __future__ import annotations

import threading

from ..hit import DROPIN_MARK

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Callable

_originals: dict[str, Callable[..., Any]] = {}
_lock = threading.RLock()


def is_dropin(fn: Any) -> bool:
    """True for stubcache's drop-ins and the wrappers :func:`patch_torch` installs."""
    return bool(getattr(fn, DROPIN_MARK, False))


def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(fn, DROPIN_MARK, True)
    return fn


def _fresh_module() -> Any:
    """A private copy of torch's ``cpp_extension`` module, for when its attributes were replaced
    by someone else before stubcache first looked (``cpp_extension.load_inline = stubcache...``)."""
    import importlib.util

    import torch.utils.cpp_extension as cpp_ext

    spec = importlib.util.spec_from_file_location("torch.utils._stubcache_cpp_extension", cpp_ext.__file__)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]  # a .py file: a spec
    spec.loader.exec_module(module)  # type: ignore[union-attr]  # a source file's spec has a loader
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


def remembered_original(name: str) -> Callable[..., Any] | None:
    """torch's own ``name`` if :func:`torch_original` has looked it up already, else ``None``."""
    return _originals.get(name)
