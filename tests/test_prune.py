"""``stubcache prune``: policies, dry runs, leftovers, and eviction racing live loaders."""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from pathlib import Path

from stubcache.admin.prune import PrunePolicy, current_fingerprint, plan_prune
from stubcache.admin.scan import scan_cache
from stubcache.storage.store import Store

from _synthetic import fake_entry  # benchmarks/_synthetic.py, on sys.path by conftest

from .conftest import run_py, spawn_py, wait_until
from .test_cli_support import build_real, cli_json, run_cli, tree_snapshot

DAY = 86400.0


def _keys(root: Path) -> set[str]:
    return {d["key"] for d in cli_json(root, "ls")}


def test_prune_max_size_evicts_lru_first_and_reaches_target(cache_root):
    store = Store(str(cache_root))
    store.ensure()
    now = time.time()
    # ten 10 KiB entries; entry i was last used i days ago
    keys = [fake_entry(store, f"s{i}", 10 * 1024, created=now - 60 * DAY, last_used=now - i * DAY)
            for i in range(10)]
    plan = cli_json(cache_root, "prune", "--max-size", "35K", "--dry-run")
    planned = [i["name"] for i in plan["items"] if i["action"] == "remove"]
    assert planned == [f"s{i}" for i in range(9, 2, -1)]  # oldest use first
    res = cli_json(cache_root, "prune", "--max-size", "35K", "--yes")
    assert res["summary"]["removed"] == 7 and res["summary"]["target_reached"]
    assert _keys(cache_root) == set(keys[:3])
    assert sum(d["size"] for d in cli_json(cache_root, "ls")) <= 35 * 1024
    assert os.listdir(store.path("trash")) == []
    # already under the target: nothing to do
    assert cli_json(cache_root, "prune", "--max-size", "35K", "--yes")["summary"]["planned_removals"] == 0


def test_prune_older_than_uses_last_use_not_creation(cache_root):
    store = Store(str(cache_root))
    store.ensure()
    now = time.time()
    recent = fake_entry(store, "recent", created=now - 90 * DAY, last_used=now - 1 * DAY)
    stale = fake_entry(store, "stale", created=now - 90 * DAY, last_used=now - 20 * DAY)
    ancient = fake_entry(store, "ancient", created=now - 90 * DAY, last_used=now - 40 * DAY)
    res = cli_json(cache_root, "prune", "--older-than", "14d", "--yes")
    assert {i["key"] for i in res["items"] if i["outcome"] == "removed"} == {stale, ancient}
    assert _keys(cache_root) == {recent}


def test_prune_toolchain_mismatch(cache_root, cxx):
    real = build_real([1], run_py)
    store = Store(str(cache_root))
    fp = copy.deepcopy(current_fingerprint(store))
    same = fake_entry(store, "same", fingerprint=fp)
    old_torch = copy.deepcopy(fp)
    old_torch["torch"]["version"] = "2.9.0+cpu"
    t_key = fake_entry(store, "oldtorch", fingerprint=old_torch)
    old_py = copy.deepcopy(fp)
    old_py["python"]["version"] = "3.10.2"
    p_key = fake_entry(store, "oldpy", fingerprint=old_py)
    old_cc = copy.deepcopy(fp)
    old_cc["cxx"]["version"] = "g++ (GCC) 9.1.0"
    c_key = fake_entry(store, "oldcc", fingerprint=old_cc)
    plan = cli_json(cache_root, "prune", "--toolchain-mismatch", "--dry-run")
    reasons = {i["key"]: i["reason"] for i in plan["items"]}
    assert set(reasons) == {t_key, p_key, c_key}
    assert "torch 2.9.0+cpu" in reasons[t_key] and "python 3.10.2" in reasons[p_key]
    assert "9.1.0" in reasons[c_key]
    cli_json(cache_root, "prune", "--toolchain-mismatch", "--yes")
    assert _keys(cache_root) == {real[0], same}


def _leftovers(store: Store) -> dict[str, str]:
    """A dead builder's staging dir, a stale lease, an abandoned trash item, old and new quarantine."""
    dead = spawn_py("pass")
    dead.wait()
    stg = os.path.join(store.path("staging"), f"{'a' * 32}-{dead.pid}-x1y2z3")
    os.makedirs(os.path.join(stg, "build"))
    Path(stg, "build", "main.cpp").write_text("int x;")
    lease = store.lease_path("b" * 32)
    Path(lease).write_text(json.dumps({"pid": dead.pid, "host": "h", "started": 0, "name": "n"}))
    trash = os.path.join(store.path("trash"), f"{'c' * 32}-{int(time.time())}-{dead.pid}")
    os.makedirs(trash)
    old_q = os.path.join(store.path("quarantine"), f"{'d' * 32}-{int(time.time() - 30 * DAY)}-{dead.pid}")
    new_q = os.path.join(store.path("quarantine"), f"{'e' * 32}-{int(time.time() - 60)}-{dead.pid}")
    os.makedirs(old_q)
    os.makedirs(new_q)
    return {"staging": stg, "lease": lease, "trash": trash, "old_q": old_q, "new_q": new_q}


def test_dry_run_changes_nothing(cache_root, cxx):
    build_real([1, 2], run_py)
    store = Store(str(cache_root))
    now = time.time()
    for i in range(5):
        fake_entry(store, f"f{i}", 8192, last_used=now - i * 10 * DAY)
    _leftovers(store)
    before = tree_snapshot(cache_root)
    plan = cli_json(cache_root, "prune", "--dry-run", "--max-size", "0", "--older-than", "1d",
                    "--toolchain-mismatch")
    assert plan["summary"]["planned_removals"] >= 7 + 4
    text = run_cli(cache_root, "prune", "-n", "--max-size", "0", "--older-than", "1d")
    assert text.returncode == 0 and "dry run: nothing changed" in text.stdout
    assert run_cli(cache_root, "clear", "--dry-run").returncode == 0
    assert tree_snapshot(cache_root) == before


def test_leftovers_removed_but_live_ones_kept(cache_root):
    store = Store(str(cache_root))
    store.ensure()
    lo = _leftovers(store)
    res = cli_json(cache_root, "prune", "--yes")
    kinds = sorted(i["kind"] for i in res["items"] if i["outcome"] == "removed")
    assert kinds == ["lease", "quarantine", "staging", "trash"]
    for k in ("staging", "lease", "trash", "old_q"):
        assert not os.path.exists(lo[k]), k
    assert os.path.exists(lo["new_q"])  # younger than --quarantine-age
    cli_json(cache_root, "prune", "--yes", "--quarantine-age", "10s")
    assert not os.path.exists(lo["new_q"])


def test_killed_builders_staging_removed_live_builders_kept(cache_root, cxx, tmp_path):
    mark = tmp_path / "compiling"
    code = """
        from stubcache import StubCache, StubSpec
        StubCache().get_or_build(StubSpec("slow", 'extern "C" int stub_value(void) { return 5; }'))
    """
    builder = spawn_py(code, env={"STUBCACHE_TEST_CXX_SLEEP": "60", "STUBCACHE_TEST_CXX_MARK": str(mark)})
    store = Store(str(cache_root))
    try:
        def compiling_under_lease() -> bool:
            # (On a fresh host the compile starts while the toolchain is probed, before the lease.)
            return mark.exists() and os.path.isdir(store.path("leases")) and bool(os.listdir(store.path("leases")))

        wait_until(compiling_under_lease, "the builder to compile under its lease", proc=builder)
        staging = os.listdir(store.path("staging"))
        assert len(staging) == 1 and f"-{builder.pid}-" in staging[0]
        assert os.listdir(store.path("leases"))
        res = cli_json(cache_root, "prune", "--yes")
        assert res["summary"]["removed"] == 0
        assert any(i["kind"] == "staging" and i["action"] == "skip" and str(builder.pid) in i["reason"]
                   for i in res["items"])
        assert os.listdir(store.path("staging")) == staging and os.listdir(store.path("leases"))
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait()
    # the compiler wrapper (a child of the builder) may linger in its sleep; its staging dir is dead
    res = cli_json(cache_root, "prune", "--yes")
    removed = sorted(i["kind"] for i in res["items"] if i["outcome"] == "removed")
    assert removed == ["lease", "staging"]
    assert os.listdir(store.path("staging")) == [] and os.listdir(store.path("leases")) == []
    # and a fresh process builds normally afterwards
    assert len(build_real([5], run_py)) == 1


def test_in_use_entry_is_skipped_and_said_so(cache_root, cxx):
    keys = build_real([1, 2], run_py)
    holder = spawn_py("""
        from stubcache import StubCache, StubSpec
        import time
        lib = StubCache().load(StubSpec("stub1", 'extern "C" int stub_value(void) { return %d; }\\n' % 1))
        print(lib.stub_value(), flush=True)
        time.sleep(60)
    """)
    try:
        assert holder.stdout.readline().strip() == "1"
        proc = run_cli(cache_root, "prune", "--max-size", "0", "--yes")
        assert proc.returncode == 0
        assert "in use by a live process" in proc.stdout and "still total" in proc.stderr
        assert _keys(cache_root) == {keys[0]}
    finally:
        holder.kill()
        holder.wait()
    cli_json(cache_root, "prune", "--max-size", "0", "--yes")
    assert _keys(cache_root) == set()


LOADER = """
    import os, random, sys, time, hashlib
    from stubcache import StubCache, StubSpec
    wid = int(sys.argv[1]) if len(sys.argv) > 1 else int(os.environ["WID"])
    rng = random.Random(wid)
    def spec(v):
        return StubSpec("race%d" % v, 'extern "C" int stub_value(void) { return %d; }\\n' % v)
    # a long-lived hold: this process keeps stub 100+wid%2 loaded the whole run
    keep = StubCache()
    held = keep.get_or_build(spec(100 + wid % 2))
    assert keep.load_entry(held).stub_value() == 100 + wid % 2
    print("ready", flush=True)
    while not os.path.exists(os.environ["GO"]):  # until the pruner has run once, held entries and all
        time.sleep(0.005)
    loads = failures = 0
    for _ in range(int(os.environ["LOADS"])):
        v = rng.choice([0, 1, 2, 3, wid + 10])   # shared stubs and one of its own
        c = StubCache()                          # a fresh "process": new pins, no memo
        try:
            e = c.get_or_build(spec(v))
            lib = c.load_entry(e)
            if lib.stub_value() != v:
                failures += 1
            time.sleep(rng.uniform(0, 0.03))
            # held entries must still be there, whole
            for path in (e.path, os.path.join(os.path.dirname(e.path), "manifest.json"), held.path):
                if not os.path.exists(path):
                    failures += 1
                    print("MISSING", path, flush=True)
            loads += 1
        except Exception as exc:
            failures += 1
            print("FAIL", type(exc).__name__, exc, flush=True)
        finally:
            # pins are per process (shared by instances): drop all but the long-lived hold
            for slot in [s for s in c._pins if s[1] != held.key]:
                os.close(c._pins.pop(slot))
    print("RESULT", loads, failures, flush=True)
"""

PRUNER = """
    import io, os, sys, time, json, contextlib
    from stubcache.cli import main
    deadline = time.time() + 300  # a bound, not a pace: it stops when told and has removed something
    runs = removed = in_use = 0
    while time.time() < deadline:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["prune", "--max-size", "0", "--yes", "--format", "json"])
        assert rc == 0, rc
        s = json.loads(buf.getvalue())["summary"]
        runs += 1
        removed += s.get("removed", 0)
        in_use += s.get("skipped", 0) + s.get("in_use_at_removal", 0)
        if runs == 1:
            open(os.environ["GO"], "w").close()
        if os.path.exists(os.environ["STOP"]) and removed:
            break
    print("PRUNED", runs, removed, in_use, flush=True)
"""


def test_prune_loop_races_eight_loaders(cache_root, cxx, tmp_path):
    # Counted, not timed: each loader does LOADS loads while the pruner loops. The pruner's first
    # run happens while every loader holds an entry (so it must skip some), and it stops only after
    # the loaders have exited (so its last run removes what they left).
    sync = {"GO": str(tmp_path / "go"), "STOP": str(tmp_path / "stop")}
    n_loads = 10
    loaders = [spawn_py(LOADER, env={"WID": str(i), "LOADS": str(n_loads), **sync}) for i in range(8)]
    for p in loaders:
        assert p.stdout.readline().strip() == "ready", p.communicate()
    pruner = spawn_py(PRUNER, env=sync)
    outs = [p.communicate(timeout=300) for p in loaders]
    (tmp_path / "stop").touch()
    pout, perr = pruner.communicate(timeout=300)
    assert pruner.returncode == 0, perr
    total_loads = 0
    for (out, err), p in zip(outs, loaders):
        assert p.returncode == 0, err
        result = [ln for ln in out.splitlines() if ln.startswith("RESULT")]
        assert result, (out, err)
        _, loads, failures = result[-1].split()
        assert int(failures) == 0 and int(loads) == n_loads, out
        total_loads += int(loads)
    _, runs, removed, in_use = pout.split()
    assert int(removed) > 0 and int(in_use) > 0, pout
    print(f"loads={total_loads} prune runs={runs} removed={removed} skipped in use={in_use}")
    # everything the loaders built was published correctly
    assert run_cli(cache_root, "verify").returncode == 0


def test_plan_is_pure_and_skips_in_use(cache_root):
    store = Store(str(cache_root))
    store.ensure()
    now = time.time()
    for i in range(4):
        fake_entry(store, f"p{i}", 1000, last_used=now - i * DAY)
    scan = scan_cache(store)
    before = tree_snapshot(cache_root)
    oldest_first = sorted(scan.entries, key=lambda e: e.last_used)
    oldest_first[0].in_use = True  # pretend a live process holds the least recently used one
    one = oldest_first[0].size
    plan = plan_prune(scan, PrunePolicy(max_size=one + 10))
    actions = [(i.name, i.action) for i in plan.items]
    assert actions == [("p3", "skip"), ("p2", "remove"), ("p1", "remove"), ("p0", "remove")]
    assert plan.target_reached and plan.entry_size_after == one
    assert tree_snapshot(cache_root) == before
