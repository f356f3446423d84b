"""Parsing and printing sizes and durations for the command line (``2G``, ``14d``, ``1.2 MiB``)."""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*\Z", re.I)

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "": 1}  # "": only for 0
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*\Z", re.I)


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``10K``, ``1.5M``, ``2G``, ``2GiB``, ``1T`` (powers of 1024), or
    ``123B``. A bare number other than 0 is refused: ``10`` is far more often a forgotten unit than 10 bytes."""
    if text.strip().startswith("-"):
        raise ValueError(f"bad size {text!r}: a size cannot be negative")
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"bad size {text!r}: use a number with a K, M, G or T suffix (e.g. 2G)")
    if not m.group(2) and not text.strip().lower().endswith("b") and float(m.group(1)) != 0:
        raise ValueError(f"bad size {text!r}: give a unit, e.g. {m.group(1)}G or {m.group(1)}M "
                         f"(or {m.group(1)}B for {m.group(1)} bytes)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``45s``, ``90m``, ``12h``, ``14d``, ``2w``. A bare number other than 0
    is refused: ``14`` is far more often a forgotten ``d`` than 14 seconds."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"bad duration {text!r}: use a number with s, m, h, d or w (e.g. 14d)")
    if not m.group(2) and float(m.group(1)) != 0:
        n = m.group(1)
        raise ValueError(f"bad duration {text!r}: give a unit, e.g. {n}d, {n}h, {n}m or {n}s")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def human_size(n: int | float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_age(seconds: float | None) -> str:
    """An age in the largest sensible unit: ``42s``, ``5m``, ``3h``, ``12d``."""
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    if s < 120:
        return f"{int(s)}s"
    if s < 7200:
        return f"{int(s // 60)}m"
    if s < 2 * 86400:
        return f"{int(s // 3600)}h"
    return f"{int(s // 86400)}d"


def human_seconds(seconds: float) -> str:
    """A total of seconds: ``0.41s``, ``12.3s``, ``4m05s``, ``2h13m``."""
    if seconds < 60:
        return f"{seconds:.2f}s" if seconds < 10 else f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
