"""Which entries a KEY argument names (pure).

The command line shows two kinds of key: the **spec key** (the base key: a hash of what was
asked and the toolchain, what ``explain SPEC`` and ``ls --remote`` print) and the **entry
key** (the name under ``entries/``, what ``ls`` prints; the same as the spec key unless the stub
tracks headers, whose contents then extend it). A KEY argument may be either, in full or as a
unique prefix: a spec key names every entry built from it, an entry key that one entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Protocol

SPEC_KEY = "spec key"
ENTRY_KEY = "entry key"
_HEX = re.compile(r"[0-9a-f]{4,64}\Z")


class _Entry(Protocol):
    key: str
    base_key: str
    name: str


class KeyRefError(LookupError):
    """A KEY argument that is not a key, names nothing, or is an ambiguous prefix."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class KeyMatch:
    """What one KEY argument named: ``kind`` is :data:`SPEC_KEY` or :data:`ENTRY_KEY`, ``key``
    the full key, ``entries`` the entry keys it stands for."""

    ref: str
    kind: str
    key: str
    entries: tuple[str, ...]


def resolve_key(ref: str, entries: Iterable[_Entry]) -> KeyMatch:
    """The entries ``ref`` names among ``entries`` (records with ``key``, ``base_key``, ``name``).

    A prefix that starts more than one key (of either kind) is ambiguous; a key that is both an
    entry's entry key and its spec key (a stub that tracks no headers) is one key."""
    want = ref.strip().lower()
    if not _HEX.match(want):
        raise KeyRefError(f"{ref!r} is not a key: a spec key or an entry key, or a prefix of one "
                          "(4 to 64 hex digits)")
    entries = list(entries)
    found: dict[str, set[str]] = {}
    for e in entries:
        if e.key.startswith(want):
            found.setdefault(e.key, set()).add(ENTRY_KEY)
        if e.base_key.startswith(want):
            found.setdefault(e.base_key, set()).add(SPEC_KEY)
    if not found:
        raise KeyRefError(f"no entry has a spec key or an entry key starting {want!r}")
    if len(found) > 1:
        names = {e.key: e.name for e in entries} | {e.base_key: e.name for e in entries}
        shown = [f"{k[:16]} ({' and '.join(sorted(kinds))} of {names.get(k, '?')})"
                 for k, kinds in sorted(found.items())[:5]]
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        raise KeyRefError(f"key prefix {want!r} is ambiguous: it starts {', '.join(shown)}{more}; "
                          "give more digits")
    (key, kinds), = found.items()
    if SPEC_KEY in kinds:
        named = tuple(sorted(e.key for e in entries if e.base_key == key))
        return KeyMatch(ref, SPEC_KEY, key, named)
    return KeyMatch(ref, ENTRY_KEY, key, (key,))
