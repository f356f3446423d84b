"""The once-per-process hint for stubs that can never be shared: a miss whose spec differs from
a cached entry's only where this process's id appears (SGLang's ``…_stub_{pid}_{n}``). Every
start of such a program compiles again and adds entries nobody will hit; the size cap evicts
those first (never-hit entries), and this says why, once.

Only a miss calls :func:`check_miss`, and it reads nothing unless the spec embeds the pid as a
digit run (a regular expression over the spec's key data); then at most :data:`MAX_MANIFESTS`
manifests."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ..edge import log

DOC_SECTION = "docs/engines.md, section \"Names that embed the pid\""
MAX_MANIFESTS = 256  # manifests read by one check (entries are listed by key: a sample at random)

_hinted = False


def _runs(pid: int) -> re.Pattern[str]:
    return re.compile(rf"(?<!\d){pid}(?!\d)")


def embeds_pid(text: str, pid: int) -> bool:
    """Whether ``pid`` appears in ``text`` as a whole digit run (``12`` is not in ``123``)."""
    return str(pid) in text and _runs(pid).search(text) is not None  # (a pattern costs ~0.3 ms to compile)


def differs_only_by_pid(candidate: str, wanted: str, pid: int) -> bool:
    """Whether ``candidate`` is ``wanted`` with some other number wherever ``wanted`` has
    ``pid`` as a digit run, and nothing else changed (pure)."""
    if candidate == wanted:
        return False
    parts = _runs(pid).split(wanted)
    if len(parts) < 2:
        return False
    pattern = r"(?<!\d)\d+(?!\d)".join(re.escape(p) for p in parts)
    return re.fullmatch(pattern, candidate, re.S) is not None


def _text(canonical: Any) -> str:
    return json.dumps(canonical, sort_keys=True, ensure_ascii=False)


def fields_with_pid(canonical: dict[str, Any], pid: int) -> list[str]:
    """The spec fields (``name``, ``cpp_sources``, …) in which the pid appears."""
    return [k for k, v in sorted(canonical.items()) if embeds_pid(_text(v), pid)]


def check_miss(store: Any, name: str, canonical: dict[str, Any]) -> bool:
    """On a miss of the spec ``name`` (its key data ``canonical``): log the hint if a cached
    entry's spec differs from it only by this process's id; at most once per process. Returns
    whether it logged. Never raises: a hint must not fail a build."""
    global _hinted
    if _hinted:
        return False
    try:
        pid = os.getpid()
        wanted = _text(canonical)
        if not embeds_pid(wanted, pid):
            return False
        for key in store.entry_keys()[:MAX_MANIFESTS]:
            try:
                manifest = store.read_manifest(key)
            except (OSError, ValueError):
                continue
            theirs = manifest.preimage.get("spec") if isinstance(manifest.preimage, dict) else None
            if isinstance(theirs, dict) and differs_only_by_pid(_text(theirs), wanted, pid):
                _hinted = True
                where = " and ".join(fields_with_pid(canonical, pid)) or "spec"
                log.warning(
                    "stubcache: stub %r differs from the cached %r only by this process's id (%d, in its %s): "
                    "every process start builds it again and adds an entry nobody will hit (the size cap "
                    "evicts those first). Take the pid out of the name and sources to share one build; "
                    "see %s.", name, manifest.name, pid, where, DOC_SECTION)
                return True
    except Exception:  # noqa: BLE001 - a hint is never worth failing a build for
        return False
    return False
