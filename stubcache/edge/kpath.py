"""Path spelling as the kernel reads it.

``os.path.normpath`` and ``abspath`` collapse ``a/../b`` on paper, but the kernel resolves ``..``
from wherever ``a`` really is: when ``a`` is a symlink, ``a/../b`` and ``b`` are different
files. The compiler opens what it was given, so a path it names is kept as it named it, and
only the steps that mean the same file under any symlink are tidied away.
"""

from __future__ import annotations

import os


def tidy(path: str) -> str:
    """``path`` without empty and ``.`` components and trailing slashes; ``..`` kept as it is
    (what the kernel opens for ``tidy(p)`` is what it opens for ``p``, for a file)."""
    if not path:
        return path
    parts = [p for p in path.split("/") if p not in ("", ".")]
    head = "/" if path.startswith("/") else ""
    return head + "/".join(parts) if parts or head else "."


def absolute(path: str) -> str:
    """``path`` made absolute against the working directory, tidied, never collapsing ``..``."""
    return tidy(path if os.path.isabs(path) else os.path.join(os.getcwd(), path))


def has_dotdot(path: str) -> bool:
    """Whether ``path`` has a ``..`` component (its meaning then depends on the symlinks before it)."""
    return ".." in path.split("/")
