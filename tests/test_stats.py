"""``stubcache stats``: counters folded from per-process event files, including a killed process."""

from __future__ import annotations

import os
import signal

from stubcache.store import Store

from .conftest import spawn_py
from .test_cli_support import cli_json, run_cli

WORKER = """
    import os, sys, time
    from stubcache import StubCache, StubSpec
    wid = int(os.environ["WID"])
    hits = int(os.environ["HITS"])
    spec = StubSpec("w%d" % wid, 'extern "C" int stub_value(void) { return %d; }' % wid)
    assert StubCache().load(spec).stub_value() == wid      # miss + build
    for _ in range(hits):
        StubCache().get_or_build(spec)                      # a fresh cache object: a hit each
    print("done", flush=True)
    if os.environ.get("HANG"):
        time.sleep(120)
"""


def test_stats_add_up_across_processes_including_a_killed_one(cache_root, cxx):
    hits = {0: 1, 1: 2, 2: 3, 3: 4}
    procs = [spawn_py(WORKER, env={"WID": str(w), "HITS": str(h)}) for w, h in hits.items()]
    victim = spawn_py(WORKER, env={"WID": "9", "HITS": "5", "HANG": "1"})
    assert victim.stdout.readline().strip() == "done"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    store = Store(str(cache_root))
    # a process killed in the middle of a write leaves a torn last line: it is counted, not fatal
    with open(os.path.join(store.path("events"), "crashed-1-dead.jsonl"), "w") as fh:
        fh.write('{"t":1,"ev":"hit","key":"x"}\n{"t":2,"ev":"bui')
    s = cli_json(cache_root, "stats")
    assert s["entries"] == 5
    assert s["misses"] == 5 and s["builds"] == 5
    assert s["hits"] == sum(hits.values()) + 5 + 1
    assert s["processes"] == 6 and s["bad_lines"] == 1
    assert s["build_seconds"] > 0 and s["saved_seconds"] > 0
    assert s["failed_builds"] == 0 and s["hit_rate"] == round(s["hits"] / (s["hits"] + s["misses"]), 4)


def test_stats_counts_failed_builds_and_handles_an_empty_root(cache_root, cxx):
    bad = spawn_py("""
        from stubcache import StubCache, StubSpec, BuildError
        try:
            StubCache().get_or_build(StubSpec("broken", "int f( {"))
        except BuildError:
            print("failed")
    """)
    assert bad.communicate(timeout=120)[0].strip() == "failed"
    s = cli_json(cache_root, "stats")
    assert s["failed_builds"] == 1 and s["builds"] == 0 and s["entries"] == 0
    empty = cli_json(cache_root.parent / "nothing-here", "stats")
    assert empty["entries"] == 0 and empty["hits"] == 0 and empty["hit_rate"] is None
    assert run_cli(cache_root, "stats").returncode == 0


def test_remote_byte_counts_from_event_files_are_range_checked():
    """Event files are written by every process using the root: a negative, boolean or absurd
    ``bytes`` value is ignored rather than folded into the totals."""
    from stubcache.stats import EventTotals

    totals = EventTotals()
    for n in (-5, True, 1 << 62, 1.5, "7", 100):
        totals.add({"ev": "remote_hit", "key": "k", "s": 0.1, "bytes": n})
        totals.add({"ev": "upload", "key": "k", "s": 0.1, "bytes": n})
    assert totals.remote.hits == 6 and totals.remote.uploads == 6
    assert totals.remote.bytes_downloaded == 100 and totals.remote.bytes_uploaded == 100
