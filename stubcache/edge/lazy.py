"""A module imported on first use, for what only a build or a wait needs (the terminal status
line, fault injection): ``progress = lazy_module("stubcache.edge.progress")`` reads like the import it
stands for, and a hit, which never touches it, never pays for it."""

from __future__ import annotations


class lazy_module:
    """Stands for the module ``name``; the first attribute read imports it."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module = None

    def __getattr__(self, attr: str):
        module = self._module
        if module is None:
            module = self._module = __import__(self._name, fromlist=["_"])
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"
