"""Checking values read from files someone else may have written (manifests, leases, failure
records, event lines): JSON allows ``NaN``, ``Infinity``, ``1e400`` and 4000-digit integers,
and a hostile group member will use them. Nothing read from a root reaches arithmetic or a
format string without passing through one of these."""

from __future__ import annotations

import math
from typing import Any

MAX_BYTES = 1 << 50          # a size beyond a petabyte is not a real file
MAX_SECONDS = 10 * 365 * 86400.0


def finite(value: Any, lo: float, hi: float) -> float | None:
    """``value`` as a float if it is a real JSON number (not a bool) in ``[lo, hi]``, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        v = float(value)
    except OverflowError:
        return None
    if not math.isfinite(v) or v < lo or v > hi:
        return None
    return v


def count(value: Any, lo: int = 0, hi: int = MAX_BYTES) -> int | None:
    """``value`` if it is an integer (not a bool) in ``[lo, hi]``, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or value > hi:
        return None
    return value


def timestamp(value: Any, now: float, slack: float = 86400.0) -> float | None:
    """A time since the epoch that is positive and not more than ``slack`` in the future."""
    return finite(value, 0.0, now + slack)
