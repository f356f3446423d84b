"""What ``explain`` and ``ls`` read, tested beside the data: key prefixes, entries by name, and
the ``--filter``/``--sort`` selection over scan records."""

from __future__ import annotations

import os

import pytest
from _synthetic import fake_entry  # benchmarks/_synthetic.py, on sys.path by conftest

from stubcache.admin.entryfilter import FilterError, parse_filter, select
from stubcache.admin.manifestscan import EntryLookupError, entry_by_prefix, key_status, preimages_named
from stubcache.admin.scan import scan_entries
from stubcache.storage.store import Store


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(str(tmp_path / "root"))
    s.ensure()
    return s


def test_entry_by_prefix(store):
    keys = [fake_entry(store, f"e{i}", 4096, salt=str(i)) for i in range(20)]
    key, manifest = entry_by_prefix(store, keys[3][:10])
    assert key == keys[3] and manifest.name == "e3"
    shared = next(c for c in "0123456789abcdef" if sum(k[0] == c for k in keys) > 1)  # 20 keys, 16 digits
    with pytest.raises(EntryLookupError, match="is ambiguous"):
        entry_by_prefix(store, shared)
    with pytest.raises(EntryLookupError, match="no entry with a key starting"):
        entry_by_prefix(store, "g")
    # an entry whose manifest is gone is named, not skipped
    entry = store.entry_dir(keys[5])
    os.chmod(entry, 0o700)
    os.unlink(os.path.join(entry, "manifest.json"))
    with pytest.raises(EntryLookupError, match="cannot read its manifest"):
        entry_by_prefix(store, keys[5])


def test_key_status_and_preimages_named(store):
    a = fake_entry(store, "alloc", 4096, salt="1")
    b = fake_entry(store, "alloc", 4096, salt="2")
    fake_entry(store, "other", 4096)
    assert key_status(store, a) == (True, {})
    assert key_status(store, "f" * 32) == (False, {})
    named = preimages_named(store, "alloc")
    assert sorted(named) == sorted([a, b]) and named[a]["spec"]["name"] == "alloc"
    assert preimages_named(store, "none") == {}


def test_select_filters_names_and_sorts(store):
    now = 1_750_000_000.0
    fake_entry(store, "big", 1 << 20, created=now - 86400, last_used=now - 3600)
    fake_entry(store, "small", 4096, created=now - 40 * 86400, last_used=now - 35 * 86400)
    fake_entry(store, "smaller", 2048, created=now - 2 * 86400, last_used=now - 60)
    entries = scan_entries(store, probe_in_use=False)
    names = lambda es: [e.name for e in es]  # noqa: E731
    assert names(select(entries, now)) == ["small", "big", "smaller"]  # least recently used first
    assert names(select(entries, now, sort="size", reverse=True)) == ["big", "small", "smaller"]
    assert names(select(entries, now, name="small*", sort="name")) == ["small", "smaller"]
    assert names(select(entries, now, [parse_filter("accessed>30d")])) == ["small"]
    assert names(select(entries, now, [parse_filter("size<1M"), parse_filter("name!=smaller")])) == ["small"]
    for bad in ("colour=red", "size>lots", "name>x"):
        with pytest.raises(FilterError):
            parse_filter(bad)


def test_manifest_annotations_are_its_slots():
    """Manifest declares its slots' types for type checkers: the same names, in order."""
    from stubcache.storage.manifest import Manifest

    assert list(Manifest.__annotations__) == list(Manifest.__slots__)
