"""A module imported on first use, for what only a build or a wait needs (the terminal status
line, fault injection): ``progress = lazy_module("stubcache.progress")`` reads like the import it
stands for, and a hit, which never touches it, never pays for it."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any


class lazy_module:
    """Stands for the module ``name``; the first attribute read imports it."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = __import__(self._name, fromlist=["_"])
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"
