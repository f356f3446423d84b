"""Eviction and bookkeeping an operator relies on: ``stubcache rm``, ``stats --reset``, entries
never hit (counted, evicted first), the default size cap and ``off``, a last-used stamp as
precise as ``ls`` shows it, and the hint for names that embed the pid. Real builds of header-free
stubs, the CLI in subprocesses, live processes holding entries."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stubcache.storage.manifest import Manifest
from stubcache.storage.store import Store

from .conftest import run_py
from .test_hostile_root import shared, users  # noqa: F401 - fixtures (real users; root only)
from .test_cli_support import build_real, cli_json, run_cli, stub_source, tree_snapshot

HOLD = """
import sys, stubcache
spec = stubcache.StubSpec("held", 'extern "C" int stub_value(void) { return 7; }\\n')
cache = stubcache.StubCache()
lib = cache.load(spec)
print(cache.get_or_build(spec).key, flush=True)
sys.stdin.readline()          # the test removes (or tries to) meanwhile
print(lib.stub_value(), flush=True)
"""


def _spawn(code: str) -> subprocess.Popen:
    """A child that the test steps through its stdin."""
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _entries(root: Path) -> set[str]:
    d = root / "v1" / "entries"
    return set(os.listdir(d)) if d.is_dir() else set()


def _publish(store: Store, key: str, base: str, name: str, size: int = 4096) -> str:
    """A synthetic entry with a chosen entry key and spec key (a variant when they differ)."""
    data = hashlib.sha256(key.encode()).digest() * (size // 32)
    staging = store.new_staging(base)
    entry = os.path.join(staging, "entry")
    os.mkdir(entry, 0o700)
    with open(os.path.join(entry, f"{name}.so"), "wb") as fh:
        fh.write(data)
    store.publish(entry, Manifest(
        key=key, base_key=base, name=name, module_name=name, library=f"{name}.so",
        sha256=hashlib.sha256(data).hexdigest(), size=len(data), preimage={"spec": {"name": name}},
        headers={}, build_method="direct", build_seconds=0.05, build_log="", created=time.time(),
        stubcache_version="test"))
    Store.rmtree(staging)
    return key


# --- stubcache rm ----------------------------------------------------------------------------


def test_rm_takes_an_entry_key_a_spec_key_or_a_prefix_and_refuses_an_ambiguous_one(cache_root):
    store = Store(str(cache_root))
    store.ensure()
    a = _publish(store, "abcd1111" + "0" * 24, "abcd1111" + "0" * 24, "alpha")
    b = _publish(store, "abcd2222" + "0" * 24, "9999" + "1" * 28, "beta")   # spec key 9999…
    c1 = _publish(store, "cccc" + "2" * 28, "dddd" + "3" * 28, "gamma")     # two entries of
    c2 = _publish(store, "eeee" + "4" * 28, "dddd" + "3" * 28, "gamma")     # one spec key

    amb = run_cli(cache_root, "rm", "abcd", "-y")
    assert amb.returncode == 2 and "ambiguous" in amb.stderr and "abcd1111" in amb.stderr
    assert "Traceback" not in amb.stderr and _entries(cache_root) == {a, b, c1, c2}
    none = run_cli(cache_root, "rm", "0123", "-y")
    assert none.returncode == 2 and "no entry has a spec key or an entry key starting '0123'" in none.stderr
    bad = run_cli(cache_root, "rm", "../etc", "-y")
    assert bad.returncode == 2 and "is not a key" in bad.stderr

    dry = cli_json(cache_root, "rm", "dddd", "-n")  # a spec key: every entry built from it
    assert sorted(i["key"] for i in dry["items"]) == sorted([c1, c2]) and dry["dry_run"]
    assert _entries(cache_root) == {a, b, c1, c2}
    one = run_cli(cache_root, "rm", "cccc", "-y")  # an entry key: that entry only
    assert one.returncode == 0, one.stderr
    assert "asked: entry key cccc" in one.stdout and "removed" in one.stdout
    assert _entries(cache_root) == {a, b, c2}
    assert not (cache_root / "v1" / "pins" / c1).exists()
    both = cli_json(cache_root, "rm", "9999", "ABCD1111", "--yes")  # b by its spec key, a by entry key
    assert {i["key"]: i["outcome"] for i in both["items"]} == {a: "removed", b: "removed"}
    assert _entries(cache_root) == {c2}
    assert os.listdir(cache_root / "v1" / "variants" / ("dddd" + "3" * 28)) == [c2]
    assert run_cli(cache_root, "rm", "-y").returncode == 2  # nothing named


def test_rm_by_name_with_real_builds_and_confirmation(cache_root, cxx):
    keys = build_real([1, 2, 12], run_py)
    names = {d["key"]: d["name"] for d in cli_json(cache_root, "ls")}
    assert run_cli(cache_root, "rm", "--name", "stub1*").returncode == 3  # no terminal, no --yes
    assert _entries(cache_root) == set(keys)
    res = cli_json(cache_root, "rm", "--name", "stub1*", "-y")
    assert sorted(i["name"] for i in res["items"]) == ["stub1", "stub12"]
    assert [k for k in keys if k in _entries(cache_root)] == [k for k in keys if names[k] == "stub2"]
    nothing = run_cli(cache_root, "rm", "--name", "nomatch*", "-y")
    assert nothing.returncode == 0 and "no entry's name matches 'nomatch*'" in nothing.stdout
    # The spec key (what `explain SPEC` prints; the entry key adds the tracked headers' contents).
    (two,) = _entries(cache_root)
    spec_key = run_py(f"from stubcache import StubCache, StubSpec\n"
                      f"print(StubCache().key(StubSpec('stub2', {stub_source(2)!r})))").stdout.strip()
    assert spec_key != two
    res = cli_json(cache_root, "rm", spec_key[:8], "-y")
    assert [(i["key"], i["reason"], i["outcome"]) for i in res["items"]] == [
        (two, f"asked: spec key {spec_key[:12]}", "removed")]
    assert _entries(cache_root) == set()
    # A removed entry is simply rebuilt by the next caller.
    cxx.reset()
    build_real([1], run_py)
    assert cxx.compiles() == 1


def test_rm_never_removes_an_entry_a_live_process_holds(cache_root, cxx):
    proc = _spawn(HOLD)
    try:
        key = proc.stdout.readline().strip()
        assert key, proc.stderr.read()
        dry = run_cli(cache_root, "rm", key[:10], "-n")
        assert dry.returncode == 0 and "in use by a live process" in dry.stdout
        res = run_cli(cache_root, "rm", key[:10], "-y")
        assert res.returncode == 1 and "in use by a live process" in res.stdout
        assert key in _entries(cache_root)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "7"  # still loaded and working
    finally:
        proc.kill()
        proc.wait()
    after = run_cli(cache_root, "rm", key, "-y")
    assert after.returncode == 0 and key not in _entries(cache_root)


def test_rm_of_a_planted_symlink_or_fifo_changes_nothing_outside_the_root(cache_root, tmp_path):
    store = Store(str(cache_root))
    store.ensure()
    real = _publish(store, "aaaa" + "5" * 28, "aaaa" + "5" * 28, "real")
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "precious.so").write_bytes(b"keep me")
    (outside / "sub" / "manifest.json").write_text("{}")
    link_key, fifo_key = "bbbb" + "6" * 28, "cccc" + "7" * 28
    os.symlink(outside, cache_root / "v1" / "entries" / link_key)
    os.mkfifo(cache_root / "v1" / "entries" / fifo_key)
    # and an entry whose pin is a planted link to a file outside
    os.unlink(cache_root / "v1" / "pins" / real)
    os.symlink(outside / "precious.so", cache_root / "v1" / "pins" / real)
    before = tree_snapshot(outside)

    res = run_cli(cache_root, "rm", link_key, fifo_key, real[:8], "-y", timeout=60)
    assert "Traceback" not in res.stderr
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert _entries(cache_root) == set()
    # The links went (never their targets), the FIFO was never opened, and the planted pin
    # was replaced by a real lock file (the link itself removed), then dropped with its entry.
    assert tree_snapshot(outside) == before
    assert (outside / "precious.so").read_bytes() == b"keep me"
    assert not os.path.lexists(cache_root / "v1" / "pins" / real)
    assert os.listdir(cache_root / "v1" / "trash") == []


# --- never hit, the default cap, off -----------------------------------------------------------


def test_entries_never_hit_are_counted_and_evicted_first(cache_root, cxx):
    (one,) = build_real([1], run_py)
    stats = cli_json(cache_root, "stats")
    assert stats["never_hit"] == 1 and stats["never_hit_size"] == stats["total_size"]
    build_real([1], run_py)  # another process hits it
    (two,) = build_real([2], run_py)  # newer than 1's last use, and never hit
    stats = cli_json(cache_root, "stats")
    assert stats["never_hit"] == 1
    assert {e["key"]: e["never_hit"] for e in cli_json(cache_root, "ls")} == {one: False, two: True}
    prom = run_cli(cache_root, "stats", "--format", "prometheus").stdout
    assert f'stubcache_never_hit_entries{{root="{cache_root}"}} 1' in prom

    size = stats["total_size"] // 2
    plan = cli_json(cache_root, "prune", "--max-size", f"{size + size // 2}B", "-n")
    removals = [i for i in plan["items"] if i["action"] == "remove"]
    assert [i["key"] for i in removals] == [two] and removals[0]["reason"].startswith("never hit")
    # The cap a publishing process keeps: a third entry, room for two; the never-hit one goes,
    # though stub1 was used longer ago.
    assert run_cli(cache_root, "config", "set", "max_size", f"{2 * size + size // 2}B").returncode == 0
    build_real([3], run_py)
    remaining = _entries(cache_root)
    assert one in remaining and two not in remaining and len(remaining) == 2


def test_every_root_has_a_default_cap_that_off_turns_off(cache_root, cxx):
    from stubcache.edge.settings import DEFAULT_MAX_SIZE

    build_real([1], run_py)
    cfg = cli_json(cache_root, "config")
    assert cfg["max_size"] == DEFAULT_MAX_SIZE and cfg["max_size_from"] == "default"
    prom = run_cli(cache_root, "stats", "--format", "prometheus").stdout
    assert f'stubcache_max_size_bytes{{root="{cache_root}"}} {DEFAULT_MAX_SIZE}' in prom
    assert run_cli(cache_root, "config", "set", "max_size", "off").returncode == 0
    cfg = cli_json(cache_root, "config")
    assert cfg["max_size"] is None and cfg["root_max_size"] == "off"
    assert "stubcache_max_size_bytes" not in run_cli(cache_root, "stats", "--format", "prometheus").stdout
    cfg = cli_json(cache_root, "config", env={"STUBCACHE_MAX_SIZE": "1G"})  # tightens, as before
    assert cfg["max_size"] == 1 << 30 and cfg["max_size_from"] == "STUBCACHE_MAX_SIZE"
    assert run_cli(cache_root, "config", "unset", "max_size").returncode == 0
    cfg = cli_json(cache_root, "config", env={"STUBCACHE_MAX_SIZE": "off"})
    assert cfg["max_size"] is None and cfg["env_max_size"] == "off"
    bad = run_cli(cache_root, "config", "set", "max_size", "none")
    assert bad.returncode == 2 and "'off' for no cap" in bad.stderr
    # A tiny cap prunes at the next publish; with the cap off, a publish prunes nothing.
    assert run_cli(cache_root, "config", "set", "max_size", "1B").returncode == 0
    (two,) = build_real([2], run_py)
    assert _entries(cache_root) == {two}
    assert run_cli(cache_root, "config", "set", "max_size", "off").returncode == 0
    (three,) = build_real([3], run_py)
    assert _entries(cache_root) == {two, three}


# --- last used ---------------------------------------------------------------------------------


def test_a_hit_refreshes_last_used_so_prune_older_than_spares_what_was_just_loaded(cache_root, cxx):
    (key,) = build_real([1], run_py)
    pin = cache_root / "v1" / "pins" / key
    old = time.time() - 8 * 60
    os.utime(pin, (old, old))  # as if last loaded 8 minutes ago
    plan = cli_json(cache_root, "prune", "--older-than", "5m", "-n")
    assert [i["key"] for i in plan["items"] if i["action"] == "remove"] == [key]
    t_load = time.time()
    build_real([1], run_py)  # loaded now (a hit, in a process that then exits)
    assert os.stat(pin).st_mtime >= t_load - 1
    plan = cli_json(cache_root, "prune", "--older-than", "5m", "-n")
    assert [i for i in plan["items"] if i["action"] == "remove"] == []
    (entry,) = cli_json(cache_root, "ls")
    assert entry["last_used"] >= t_load - 1


# --- stats --reset -----------------------------------------------------------------------------

LIVE = """
import sys, stubcache
c = stubcache.StubCache()
c.load(stubcache.StubSpec("live1", 'extern "C" int f(void) { return 1; }\\n'))
print("ready", flush=True)
sys.stdin.readline()
c.load(stubcache.StubSpec("live2", 'extern "C" int f(void) { return 2; }\\n'))
print("done", flush=True)
sys.stdin.readline()
"""


def _counters(root: Path) -> dict:
    s = cli_json(root, "stats")
    return {k: s[k] for k in ("hits", "misses", "builds", "processes", "entries")}


def test_stats_reset_zeroes_counters_not_entries_while_a_writer_is_live(cache_root, cxx):
    build_real([1, 2], run_py)
    build_real([1], run_py)
    live = _spawn(LIVE)
    try:
        assert live.stdout.readline().strip() == "ready"
        assert _counters(cache_root) == {"hits": 1, "misses": 3, "builds": 3, "processes": 3, "entries": 3}
        res = run_cli(cache_root, "stats", "--reset")
        assert res.returncode == 0 and "deleted 2 event file(s)" in res.stdout and "1 live process(es)" in res.stdout
        assert _counters(cache_root) == {"hits": 0, "misses": 0, "builds": 0, "processes": 0, "entries": 3}
        events = cache_root / "v1" / "events"
        assert [p.name for p in events.glob(f"*-{live.pid}-*.jsonl")]  # the live file is kept
        live.stdin.write("\n")
        live.stdin.flush()
        assert live.stdout.readline().strip() == "done"
        after = {"hits": 0, "misses": 1, "builds": 1, "processes": 1, "entries": 4}
        assert _counters(cache_root) == after  # only what happened since the reset
    finally:
        live.kill()
        live.wait()
    # A compaction of the finished file keeps the same figures (old lines are dropped for good).
    build_real([1], run_py)
    after = dict(after, hits=1, processes=2)
    assert _counters(cache_root) == after
    assert run_cli(cache_root, "prune", "--yes").returncode == 0
    assert [p.name.startswith("archive-") for p in (cache_root / "v1" / "events").glob("*.jsonl")] == [True]
    assert _counters(cache_root) == after
    stats = cli_json(cache_root, "stats")
    assert stats["reset_at"] is not None and stats["never_hit"] == 3  # stub2, live1, live2


def test_a_planted_reset_file_is_no_reset(cache_root, cxx):
    build_real([1], run_py)
    marker = cache_root / "v1" / "events" / "stats-reset.json"
    for text in ('{"time": 1e300}', '[[[[' * 10000, '{"time": "soon"}', json.dumps({"time": time.time() + 86400})):
        marker.write_text(text)
        assert _counters(cache_root)["misses"] == 1
    marker.unlink()
    os.mkfifo(marker)
    assert _counters(cache_root)["misses"] == 1


# --- names that embed the pid -------------------------------------------------------------------

ARENA = """
import os, sys, stubcache
pid = os.getpid() if os.environ.get("WITH_PID") else 0
if os.environ.get("ORDER_LOG"):  # the build's phase lines and the hint, in the order logged
    import logging
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("stubcache").addHandler(handler)
    logging.getLogger("stubcache").setLevel(logging.DEBUG)
c = stubcache.StubCache()
for n in range(2):
    name = f"arena_stub_{pid}_{n}"
    lib = c.load(stubcache.StubSpec(name, f'extern "C" int arena_{pid}_{n}(void) {{ return {n}; }}\\n'))
    assert getattr(lib, f"arena_{pid}_{n}")() == n
"""


def test_a_name_that_embeds_the_pid_gets_one_hint_per_process(cache_root, cxx):
    first = run_py(ARENA, env={"WITH_PID": "1"})
    assert "embed the pid" not in first.stderr
    second = run_py(ARENA, env={"WITH_PID": "1", "ORDER_LOG": "1"})
    lines = second.stderr.splitlines()
    hints = [ln for ln in lines if "Names that embed the pid" in ln]
    assert len(hints) == 1, second.stderr
    assert "only by this process's id" in hints[0] and "name" in hints[0]
    # The hint reads other entries' manifests while the compiler runs, not before it starts.
    compiling = next(i for i, ln in enumerate(lines) if ": compiling (" in ln)
    assert compiling < lines.index(hints[0]), second.stderr
    assert cxx.compiles() == 4
    assert cli_json(cache_root, "stats")["never_hit"] == 4
    # Without the pid: two builds, then hits, and never a hint.
    for _ in range(2):
        quiet = run_py(ARENA)
        assert "embed the pid" not in quiet.stderr
    assert cxx.compiles() == 6


@pytest.mark.parametrize("candidate, wanted, pid, expected", [
    ("arena_41_0", "arena_42_0", 42, True),
    ("arena_41_1", "arena_42_0", 42, False),      # another digit changed too
    ("arena_42_0", "arena_42_0", 42, False),      # identical: not a pid difference
    ("arena_4_0", "arena_42_0", 4, False),        # 4 is not a whole digit run of 42
    ("x1234y", "x77y", 77, True),
    ("x77y", "x77y1", 77, False),
    ("a1b2", "a9b9", 9, True),                    # every run of the pid may differ
])
def test_differs_only_by_pid(candidate, wanted, pid, expected):
    from stubcache.cache.pidhint import differs_only_by_pid

    assert differs_only_by_pid(candidate, wanted, pid) is expected


# --- a shared root: a member's hit refreshes a pin another member owns ---------------------------


def test_in_a_shared_root_a_members_hit_counts_on_a_pin_it_does_not_own(users, shared):
    from .test_hostile_root import LOAD, run_as, src

    root, _ = shared
    (key,) = os.listdir(root / "v1" / "entries")
    pin = root / "v1" / "pins" / key
    assert pin.stat().st_uid == users["alice"].pw_uid
    old = time.time() - 3 * 86400
    os.utime(pin, ns=(0, int(old * 1e9)))  # published 3 days ago, never hit since
    owner = pin.stat().st_uid
    (entry,) = cli_json(root, "ls")
    assert entry["never_hit"] is True
    t_hit = time.time()
    proc = run_as(users["mallory"], LOAD, {"STUBCACHE_DIR": str(root), "SRC": src(1)})
    assert proc.returncode == 0 and proc.stdout.split()[:2] == ["1", "True"], proc.stderr
    st = pin.stat()
    assert st.st_uid == owner and st.st_mtime >= t_hit - 1 and st.st_atime_ns != 0
    (entry,) = cli_json(root, "ls")
    assert entry["never_hit"] is False and entry["last_used"] >= t_hit - 1
