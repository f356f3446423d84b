"""Start-up hook of ``stubcache run`` (this directory is put first on ``PYTHONPATH``).

With ``STUBCACHE_PATCH_TORCH=1`` it arranges for ``torch.utils.cpp_extension`` to be patched the
moment it is first imported (so even ``from torch.utils.cpp_extension import load_inline`` gets the
cache), without importing torch or stubcache before that. Then it runs the ``sitecustomize`` that
this one shadows, if there is one. Child processes inherit both variables, so a whole process
tree, ``multiprocessing`` spawns included, is covered.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (every process's start-up)
if TYPE_CHECKING:
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any, Sequence

_TARGET = "torch.utils.cpp_extension"


class _PatchingLoader:
    def __init__(self, inner: Loader) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ...: the real loader's
        return getattr(self._inner, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            from stubcache.dropin.patch import patch_torch
        except ImportError as exc:
            sys.stderr.write(f"stubcache run: cannot import stubcache in this Python ({exc}); "
                             "torch's loaders are not patched\n")
            return
        try:
            patch_torch(module)
        except Exception as exc:  # the program imported torch, not stubcache: never fail its import
            sys.stderr.write(f"stubcache run: torch's loaders are not patched ({type(exc).__name__}: {exc})\n")


class _Finder:
    """Finds ``torch.utils.cpp_extension`` through the other finders and wraps its loader."""

    def __init__(self) -> None:
        import threading

        self._busy = threading.local()

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        # Re-entered through another finder that also asks sys.meta_path (a second copy of this
        # hook, from a nested `stubcache run` of another install): answer nothing the second time.
        if name != _TARGET or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _PatchingLoader(spec.loader)  # type: ignore[assignment]  # a loader by duck typing
                    return spec
            return None
        finally:
            self._busy.on = False


def _install() -> None:
    if os.environ.get("STUBCACHE_PATCH_TORCH", "") not in ("", "0"):
        if _TARGET in sys.modules:
            from stubcache.dropin.patch import patch_torch

            patch_torch(sys.modules[_TARGET])
        else:
            sys.meta_path.insert(0, _Finder())


def _chain() -> None:
    """Import the ``sitecustomize`` this file shadows, as site.py would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    removed = [(i, p) for i, p in enumerate(sys.path) if os.path.abspath(p or os.curdir) == here]
    me = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401  (the next one on the path)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        # Put this directory back where it was, keeping what that sitecustomize did to sys.path
        # (a site.addsitedir, an append): restoring a saved copy would undo it.
        for i, p in removed:
            sys.path.insert(i, p)
        if me is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = me


_install()
_chain()
