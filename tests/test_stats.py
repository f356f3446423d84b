"""``stubcache stats``: counters folded from per-process event files, including a killed process,
and the compaction of finished processes' files into one archive (by ``prune``)."""

from __future__ import annotations

import ast
import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import time

import stubcache
from stubcache.storage.events import EVENTS, Event
from stubcache.admin.stats import COUNTED_EVENTS, UNCOUNTED_EVENTS, EventTotals
from stubcache.storage.store import Store

from .conftest import run_py, spawn_py
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
    assert_recorded_names_are_known(store)


def assert_recorded_names_are_known(store: Store) -> None:
    """Every event name the processes wrote is one that stats knows."""
    names = set()
    for path in glob.glob(os.path.join(store.path("events"), "*.jsonl")):
        with open(path, "rb") as fh:
            for line in fh:
                try:
                    names.add(json.loads(line)["ev"])
                except ValueError:
                    pass  # the torn line planted above
    assert names and names <= COUNTED_EVENTS | UNCOUNTED_EVENTS, names - (COUNTED_EVENTS | UNCOUNTED_EVENTS)


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
    assert_recorded_names_are_known(Store(str(cache_root)))
    empty = cli_json(cache_root.parent / "nothing-here", "stats")
    assert empty["entries"] == 0 and empty["hits"] == 0 and empty["hit_rate"] is None
    assert run_cli(cache_root, "stats").returncode == 0


def test_remote_byte_counts_from_event_files_are_range_checked():
    """Event files are written by every process using the root: a negative, boolean or absurd
    ``bytes`` value is ignored rather than folded into the totals."""
    from stubcache.admin.stats import EventTotals

    totals = EventTotals()
    for n in (-5, True, 1 << 62, 1.5, "7", 100):
        totals.add({"ev": "remote_hit", "key": "k", "s": 0.1, "bytes": n})
        totals.add({"ev": "upload", "key": "k", "s": 0.1, "bytes": n})
    assert totals.remote.hits == 6 and totals.remote.uploads == 6
    assert totals.remote.bytes_downloaded == 100 and totals.remote.bytes_uploaded == 100


def _stats(cache_root):
    out = subprocess.run([sys.executable, "-m", "stubcache", "--cache-dir", str(cache_root), "stats",
                          "--format", "json"], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    return {k: data[k] for k in ("hits", "misses", "builds", "processes")}


def test_prune_merges_event_files_of_finished_processes(cache_root):
    code = """
    import os, stubcache
    stubcache.StubCache().load(stubcache.StubSpec("ev" + os.environ["N"], 'extern "C" int f(void){return 1;}'))
    stubcache.StubCache().load(stubcache.StubSpec("ev0", 'extern "C" int f(void){return 1;}'))
    """
    for n in range(3):
        run_py(code, env={"N": str(n)})
    cli = [sys.executable, "-m", "stubcache", "--cache-dir", str(cache_root)]
    before = _stats(cache_root)
    assert before["processes"] == 3 and before["builds"] == 3
    events = cache_root / "v1" / "events"
    assert len(list(events.glob("*.jsonl"))) == 3
    pr = subprocess.run(cli + ["prune", "--yes"], capture_output=True, text=True)
    assert pr.returncode == 0, pr.stderr
    assert "merged the event files of 3" in pr.stdout
    assert [p.name.startswith("archive-") for p in events.glob("*.jsonl")] == [True]
    assert _stats(cache_root) == before
    run_py(code, env={"N": "9"})
    subprocess.run(cli + ["prune", "--yes"], capture_output=True, text=True, check=True)
    after = _stats(cache_root)
    assert len(list(events.glob("*.jsonl"))) == 1
    assert after["processes"] == 4 and after["builds"] == 4 and after["hits"] == before["hits"] + 1


def test_compaction_killed_before_deleting_its_sources_counts_nothing_twice(cache_root):
    from stubcache.admin.stats import compact_events

    for n in range(3):
        run_py('import stubcache; stubcache.StubCache().load(stubcache.StubSpec("k%d", '
               '\'extern "C" int f(void){return 1;}\'))' % n)
    before = _stats(cache_root)
    events = cache_root / "v1" / "events"
    sources = {p.name: p.read_bytes() for p in events.glob("*.jsonl")}
    assert compact_events(str(events), str(cache_root / "v1" / "locks" / "events-compact.lock")) == 3
    for name, data in sources.items():  # as if killed after the archive's rename, before unlinking
        (events / name).write_bytes(data)
    assert _stats(cache_root) == before
    assert compact_events(str(events), str(cache_root / "v1" / "locks" / "events-compact.lock")) == 0
    assert [p.name.startswith("archive-") for p in events.glob("*.jsonl")] == [True]
    assert _stats(cache_root) == before
    header = json.loads((next(events.glob("archive-*.jsonl"))).read_text().splitlines()[0])
    assert header["processes"] == 3 and sorted(header["merged"]) == sorted(sources)


def test_compaction_leaves_a_live_process_file_alone(cache_root):
    run_py('import stubcache; stubcache.StubCache().load(stubcache.StubSpec("a", \'extern "C" int f(void){return 1;}\'))')
    live = spawn_py("""
    import time, stubcache
    stubcache.StubCache().load(stubcache.StubSpec("b", 'extern "C" int f(void){return 2;}'))
    print("ready", flush=True)
    time.sleep(120)
    """)
    try:
        assert live.stdout.readline().strip() == "ready"
        events = cache_root / "v1" / "events"
        mine = [p.name for p in events.glob("*.jsonl") if f"-{live.pid}-" in p.name]
        assert len(mine) == 1
        subprocess.run([sys.executable, "-m", "stubcache", "--cache-dir", str(cache_root), "prune", "--yes"],
                       check=True, capture_output=True)
        assert (events / mine[0]).exists()  # still appended to: never merged away
    finally:
        live.kill()
        live.wait()


def test_stats_knows_every_event_name():
    """Each :class:`Event` is either folded into a figure by ``EventTotals.add`` (and then it
    changes the totals) or listed as recorded-only (and then it changes no figure)."""
    assert COUNTED_EVENTS | UNCOUNTED_EVENTS == EVENTS and not COUNTED_EVENTS & UNCOUNTED_EVENTS
    assert len(EVENTS) == len([k for k in vars(Event) if k.isupper()])  # no two names share a value
    empty = dataclasses.asdict(EventTotals())
    for name in EVENTS:
        totals = EventTotals()
        totals.add({"ev": name, "key": "k", "s": 1.5, "bytes": 10, "processes": 2, "outcome": "takeover"})
        folded = dataclasses.asdict(totals)
        changed = {k for k in folded if folded[k] != empty[k]} - {"first_event", "last_event"}
        assert bool(changed) == (name in COUNTED_EVENTS), (name, changed)
    totals = EventTotals()
    totals.add({"ev": "no_such_event", "key": "k", "s": 1.0})
    assert {k for k, v in dataclasses.asdict(totals).items() if v != empty[k]} == set()


def _writer_calls(tree: ast.AST):
    """``(call, event argument, enclosing function)`` for each event a module records: calls of
    ``events.record(dir, EV, ...)`` and ``*._event(EV, ...)``, and ``{"ev": EV}`` literals."""
    def walk(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                if child.func.attr == "_event" and child.args:
                    yield child, child.args[0], inner
                elif child.func.attr == "record" and ast.unparse(child.func.value) == "events":
                    yield child, child.args[1], inner
            if isinstance(child, ast.Dict):
                for k, v in zip(child.keys, child.values):
                    if isinstance(k, ast.Constant) and k.value == "ev":
                        yield child, v, inner
            yield from walk(child, inner)
    yield from walk(tree, None)


def test_every_writer_records_an_event_name():
    """No module records a bare string as an event: each passes an ``Event`` constant, which the
    test above ties to what stats folds (only ``events.record`` and ``_event`` forward theirs)."""
    pkg = os.path.dirname(stubcache.__file__)
    seen = []
    for path in glob.glob(os.path.join(pkg, "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for call, arg, func in _writer_calls(tree):
            where = f"{os.path.relpath(path, pkg)}:{call.lineno}"
            if isinstance(arg, ast.Name) and func in ("_event", "record"):
                continue  # the helpers that forward their argument
            assert isinstance(arg, ast.Attribute) and ast.unparse(arg.value) in ("Event", "events.Event"), \
                f"{where} records {ast.unparse(arg)}, not an Event constant"
            assert arg.attr in vars(Event) and arg.attr.isupper(), f"{where}: no Event.{arg.attr}"
            seen.append(where)
    assert len(seen) >= 20, seen  # the scan found the writers (cache, remote tier, verify, stats)


def test_a_slow_uncontended_lock_is_not_counted_as_a_wait(cache_root, cxx):
    """A lone process held up (a loaded host: here SIGSTOPped for 0.3 s) between taking its free
    build lock and looking under it waited for nobody: `stats` counts a build and no wait (one
    that found the lock held counts one: the test below)."""
    from pathlib import Path

    from .conftest import wait_until

    code = ("import stubcache\n"
            "print(stubcache.StubCache().load(stubcache.StubSpec('held', 'extern \"C\" int v(void) { return 4; }')).v())")
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, STUBCACHE_FAULT="build_lock_taken:stop"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
                   "the process to stop with its build lock taken", proc=proc)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 0.3:  # the stimulus: a host that did not run it for 0.3 s
            time.sleep(0.05)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.split() == ["4"], err
    data = json.loads(subprocess.run([sys.executable, "-m", "stubcache", "stats", "--format", "json"],
                                     capture_output=True, text=True, timeout=60, check=True).stdout)
    assert (data["builds"], data["waits"]) == (1, 0), data


def test_a_process_that_found_the_build_held_counts_a_wait(cache_root, cxx, tmp_path):
    from .conftest import wait_until

    mark = tmp_path / "compiling"
    code = ("import stubcache\n"
            "print(stubcache.StubCache().get_or_build(stubcache.StubSpec('waited', 'extern \"C\" int v(void) { return 5; }')).key)")
    holder = spawn_py(code, env={"STUBCACHE_TEST_CXX_SLEEP": "1.5", "STUBCACHE_TEST_CXX_MARK": str(mark)})
    wait_until(mark.exists, "the holder to start compiling", proc=holder)
    waiter = run_py(code)
    out, err = holder.communicate(timeout=120)
    assert holder.returncode == 0 and out.split() == waiter.stdout.split(), err
    assert cxx.compiles() == 1
    data = json.loads(subprocess.run([sys.executable, "-m", "stubcache", "stats", "--format", "json"],
                                     capture_output=True, text=True, timeout=60, check=True).stdout)
    assert (data["builds"], data["waits"]) == (1, 1), data


def test_importing_the_build_lock_is_not_counted_as_a_wait(cache_root, cxx, tmp_path):
    """A lone process's first miss imports filelock for the build lock; on a loaded machine that
    took more than the 50 ms that count as waiting for another build, and `stats` showed a wait
    nobody had (the docs' stats block drifted). Here filelock's import is made slow on purpose."""
    import filelock

    slow = tmp_path / "slow"
    (slow / "filelock").mkdir(parents=True)
    (slow / "filelock" / "__init__.py").write_text(
        "import time, sys, importlib.util\ntime.sleep(0.3)\n"
        f"spec = importlib.util.spec_from_file_location('filelock', {filelock.__file__!r}, "
        f"submodule_search_locations=[{os.path.dirname(filelock.__file__)!r}])\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['filelock'] = mod; spec.loader.exec_module(mod)\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import stubcache\n"
            "print(stubcache.StubCache().load(stubcache.StubSpec('lone', 'extern \"C\" int v(void) { return 3; }')).v())")
    out = subprocess.run([sys.executable, "-c", code, str(slow)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["3"], out.stderr
    stats = subprocess.run([sys.executable, "-m", "stubcache", "stats", "--format", "json"], capture_output=True,
                           text=True, timeout=60)
    data = json.loads(stats.stdout)
    assert (data["builds"], data["waits"]) == (1, 0), data
