"""Presenting key pre-images field by field (``stubcache explain``). Pure functions."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..key.derive import diff_preimages

MAX_INLINE = 72


def flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``{"a": {"b": 1}}`` -> ``[("a.b", 1)]`` (lists stay values)."""
    if isinstance(data, dict) and data:
        out: list[tuple[str, Any]] = []
        for k in sorted(data):
            out += flatten(data[k], f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, data)]


def summarize(value: Any, full: bool = False) -> str:
    """A one-line rendering; long values become a size and a short digest unless ``full``."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
    if full or (len(text) <= MAX_INLINE and "\n" not in text):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    if isinstance(value, list):
        return f"[{len(value)} item(s), {len(text)} chars, sha256 {digest}]"
    first = text.splitlines()[0] if text else ""
    if len(first) > 40:
        first = first[:40] + "…"
    return f"{first!r}… ({len(text)} chars, sha256 {digest})"


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Differing fields of two pre-images, as ``(dotted field, a, b)``."""
    return diff_preimages(a, b)


def closest(preimage: dict[str, Any], candidates: dict[str, dict[str, Any]]) -> tuple[str, list[Any]] | None:
    """The candidate (key -> pre-image) with the fewest differing fields, and those differences."""
    best: tuple[str, list[Any]] | None = None
    for key, other in sorted(candidates.items()):
        diff = differences(other, preimage)
        if best is None or len(diff) < len(best[1]):
            best = (key, diff)
    return best
