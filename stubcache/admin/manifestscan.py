"""Reading entries' manifests to answer ``stubcache explain``: which entry a key prefix names,
whether a key (or one of its header-tracking variants) is in the cache and still current, and
the pre-images of every entry of one name. Reads only; unreadable manifests are skipped."""

from __future__ import annotations

import os
from typing import Any

from ..storage.manifest import Manifest
from ..storage.store import Store


class EntryLookupError(LookupError):
    """A key prefix that names no entry, or more than one, or one whose manifest is unreadable."""

    def __str__(self) -> str:
        return str(self.args[0])


def entry_by_prefix(store: Store, prefix: str) -> tuple[str, Manifest]:
    """The one entry whose key starts with ``prefix``, and its manifest."""
    matches = [k for k in store.entry_keys() if k.startswith(prefix)]
    if not matches:
        raise EntryLookupError(f"no entry with a key starting {prefix!r} in {store.root}")
    if len(matches) > 1:
        raise EntryLookupError(f"key prefix {prefix!r} is ambiguous: {', '.join(m[:16] for m in matches[:5])}")
    try:
        return matches[0], store.read_manifest(matches[0])
    except (OSError, ValueError) as exc:
        raise EntryLookupError(f"entry {matches[0]}: cannot read its manifest: {exc}") from None


def stale_variants(store: Store, keys: list[str]) -> dict[str, list[str]]:
    """Entries of one base key whose tracked files changed since they were built: key -> why."""
    from ..key.inputs import changed_inputs

    out = {}
    for k in keys:
        try:
            m = store.read_manifest(k)
        except (OSError, ValueError):
            continue
        reasons = changed_inputs(m.headers, m.inputs) if m.headers else []
        if reasons:
            out[k] = reasons
    return out


def key_status(store: Store, key: str) -> tuple[bool, dict[str, list[str]]]:
    """Whether ``key`` or one of its variants (entries with tracked files) is in the cache and
    current, and the variants that are there but stale (key -> why)."""
    keys = store.variant_keys(key) + [key]
    stale = stale_variants(store, [k for k in keys if os.path.isdir(store.entry_dir(k))])
    in_cache = any(os.path.isdir(store.entry_dir(k)) and k not in stale for k in keys)
    return in_cache, stale


def preimages_named(store: Store, name: str | None) -> dict[str, dict[str, Any]]:
    """key -> pre-image of every entry called ``name`` (candidates for "closest cached entry")."""
    out = {}
    for k in store.entry_keys():
        try:
            m = store.read_manifest(k)
        except (OSError, ValueError):
            continue
        if m.name == name:
            out[k] = m.preimage
    return out
