"""The ``stubcache`` command line, run as real processes against real and synthetic stores."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from stubcache.cli import parse_filter
from stubcache.admin.scan import EntryRecord
from stubcache.storage.store import Store
from stubcache.edge.units import parse_duration, parse_size

from _synthetic import fake_entry  # benchmarks/_synthetic.py, on sys.path by conftest

from .conftest import run_py, spawn_py
from .test_cli_support import build_real, cli_json, run_cli


def test_units_and_filters():
    assert parse_size("2G") == 2 << 30 and parse_size("1.5K") == 1536 and parse_size("10MiB") == 10 << 20
    assert parse_duration("14d") == 14 * 86400 and parse_duration("90m") == 5400 and parse_duration("0") == 0
    with pytest.raises(ValueError, match="give a unit"):
        parse_duration("5")  # a bare number is a forgotten unit (issue 20 item 1)
    with pytest.raises(ValueError):
        parse_size("lots")
    now = 1_000_000.0
    e = EntryRecord(key="ab" * 16, path="/x", name="alloc", size=2 << 20, created=now - 3600,
                    last_used=now - 40 * 86400, in_use=False, build_method="direct")
    assert parse_filter("size>1M")(e, now) and not parse_filter("size<1M")(e, now)
    assert parse_filter("accessed>30d")(e, now) and not parse_filter("accessed>60d")(e, now)
    assert parse_filter("created<2h")(e, now) and parse_filter("name=al*")(e, now)
    assert parse_filter("method=direct")(e, now) and parse_filter("in_use=no")(e, now)


def test_no_torch_import_for_ls_stats_and_dry_run(cache_root, cxx):
    build_real([1, 2], run_py)
    code = f"""
        import sys
        from stubcache.cli import main
        for argv in (["ls"], ["ls", "--format", "json"], ["stats"], ["prune", "--dry-run", "--max-size", "0",
                     "--older-than", "1s", "--toolchain-mismatch"]):
            assert main(["--cache-dir", {str(cache_root)!r}, *argv]) == 0, argv
        assert "torch" not in sys.modules, "the CLI imported torch"
        print("ok")
    """
    assert run_py(code).stdout.strip().endswith("ok")


def test_dir_and_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("STUBCACHE_DIR", str(tmp_path / "envroot"))
    proc = run_cli(tmp_path / "flag", "dir")
    assert proc.stdout.strip() == str(tmp_path / "flag")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "stubcache", "dir"], capture_output=True, text=True).stdout
    assert out.strip() == str(tmp_path / "envroot")
    # global options are accepted after the command too
    out = subprocess.run([sys.executable, "-m", "stubcache", "dir", "--cache-dir", str(tmp_path / "x"),
                          "--format", "json"], capture_output=True, text=True).stdout
    assert json.loads(out) == {"root": str(tmp_path / "x")}


def test_ls_json_csv_and_table_agree(cache_root, cxx):
    keys = build_real([1, 2, 3], run_py)
    data = cli_json(cache_root, "ls")
    assert sorted(d["key"] for d in data) == sorted(keys)
    assert {d["name"] for d in data} == {"stub1", "stub2", "stub3"}
    table = run_cli(cache_root, "ls", "--sort", "name").stdout.splitlines()
    assert table[0].split()[:4] == ["ENTRY", "KEY", "NAME", "SIZE"]
    rows = [ln.split() for ln in table[1:-1]]
    by_name = {d["name"]: d for d in data}
    assert [r[1] for r in rows] == ["stub1", "stub2", "stub3"]
    for r in rows:
        d = by_name[r[1]]
        assert d["key"].startswith(r[0]) and r[4] == (d["torch"] or "-")  # "-": no torch here
        assert r[-1] == ("yes" if d["in_use"] else "no")
    assert table[-1].startswith("3 entries")
    csv_lines = run_cli(cache_root, "ls", "--format", "csv").stdout.splitlines()
    assert csv_lines[0].startswith("key,name,size") and len(csv_lines) == 4
    # filters and name patterns
    assert [d["name"] for d in cli_json(cache_root, "ls", "--name", "stub2")] == ["stub2"]
    assert cli_json(cache_root, "ls", "--filter", "size>100M") == []
    assert len(cli_json(cache_root, "ls", "--filter", "accessed<1h", "--filter", "size>1K")) == 3
    bad = run_cli(cache_root, "ls", "--filter", "colour=red")
    assert bad.returncode == 2 and "bad filter" in bad.stderr


def test_ls_shows_in_use(cache_root, cxx):
    holder = spawn_py("""
        import sys, time
        from stubcache import StubCache, StubSpec
        lib = StubCache().load(StubSpec("held", 'extern "C" int stub_value(void) { return 7; }'))
        assert lib.stub_value() == 7
        print("ready", flush=True)
        time.sleep(60)
    """)
    try:
        assert holder.stdout.readline().strip() == "ready"
        data = cli_json(cache_root, "ls")
        assert [(d["name"], d["in_use"]) for d in data] == [("held", True)]
    finally:
        holder.kill()
        holder.wait()
    assert cli_json(cache_root, "ls")[0]["in_use"] is False


def test_stats_json_matches_table(cache_root, cxx):
    build_real([1, 2], run_py)
    build_real([1, 2], run_py)  # two hits
    stats = cli_json(cache_root, "stats")
    assert (stats["entries"], stats["hits"], stats["misses"], stats["builds"]) == (2, 2, 2, 2)
    assert stats["saved_seconds"] > 0 and stats["build_seconds"] > 0
    table = dict(line.split(None, 1) if "  " not in line else [s.strip() for s in line.split("  ", 1)]
                 for line in run_cli(cache_root, "stats").stdout.splitlines()[1:])
    table = {k.strip(): v.strip() for k, v in table.items()}
    assert table["entries"] == "2" and table["hits"] == "2" and table["misses"] == "2"
    assert table["builds"] == "2" and table["total size"].endswith(f"({stats['total_size']} bytes)")
    assert table["hit rate"] == "50.0%"


def test_verify_quarantines_corrupt_entry(cache_root, cxx):
    keys = build_real([1, 2], run_py)
    assert run_cli(cache_root, "verify").returncode == 0
    store = Store(str(cache_root))
    lib = next(p for p in Path(store.entry_dir(keys[0])).iterdir() if p.suffix == ".so")
    os.chmod(lib, 0o644)
    with open(lib, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xde\xad\xbe\xef")
    os.chmod(lib, 0o555)
    dry = cli_json(cache_root, "verify", "--dry-run", ok=(1,))
    assert dry["bad"] == 1 and os.path.isdir(store.entry_dir(keys[0]))
    proc = run_cli(cache_root, "verify")
    assert proc.returncode == 1 and "checksum mismatch" in proc.stdout and "quarantined" in proc.stdout
    assert not os.path.exists(store.entry_dir(keys[0])) and os.path.isdir(store.entry_dir(keys[1]))
    q = os.listdir(store.path("quarantine"))
    assert len(q) == 1 and q[0].startswith(keys[0])
    res = cli_json(cache_root, "verify")
    assert res["bad"] == 0 and res["checked"] == 1
    assert cli_json(cache_root, "stats")["quarantine_items"] == 1
    # the next load rebuilds it
    assert build_real([1], run_py) == [keys[0]]


def test_explain_key_spec_and_difference(cache_root, cxx, tmp_path):
    keys = build_real([1, 2], run_py)
    one = cli_json(cache_root, "explain", keys[0][:8])
    assert one["key"] == keys[0] and one["preimage"]["spec"]["name"] == "stub1"
    text = run_cli(cache_root, "explain", keys[0]).stdout
    assert "spec.name" in text and "fingerprint.torch.version" in text and "in the cache" in text
    two = cli_json(cache_root, "explain", keys[0], keys[1])
    assert {d["field"] for d in two["differences"]} == {"spec.name", "spec.cpp_sources"}
    # a spec that misses: explain names the closest cached entry and the differing field
    spec = {"name": "stub1", "cpp_sources": ['extern "C" int stub_value(void) { return 1; }\n'],
            "extra_cflags": ["-O2"]}
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(spec))
    miss = cli_json(cache_root, "explain", str(f))
    assert miss["in_cache"] is False and miss["closest"]["key"] == keys[0]
    assert [d["field"] for d in miss["closest"]["differences"]] == ["spec.extra_cflags"]
    text = run_cli(cache_root, "explain", str(f), keys[0]).stdout
    assert "1 field(s) differ" in text and "spec.extra_cflags" in text
    assert run_cli(cache_root, "explain", "ffffffff").returncode == 2


def test_both_keys_are_named_and_accepted_by_every_key_argument(cache_root, cxx, tmp_path):
    """Issue 20 item 3: the spec key (``explain SPEC``, ``ls --remote``) and the entry key
    (``ls``) are labelled where they are shown, and every KEY argument takes either, or a unique
    prefix of either."""
    from .test_cli_support import stub_source

    entries = build_real([1, 2], run_py)
    spec = tmp_path / "stub1.json"
    spec.write_text(json.dumps({"name": "stub1", "cpp_sources": [stub_source(1)]}))
    by_spec = cli_json(cache_root, "explain", str(spec))
    spec_key, (entry_key,) = by_spec["spec_key"], by_spec["entry_keys"]
    assert entry_key in entries and spec_key != entry_key and by_spec["in_cache"]
    text = run_cli(cache_root, "explain", str(spec)).stdout.splitlines()
    assert text[1].split() == ["spec", "key:", spec_key, "(in", "the", "cache)"]
    assert text[2].split() == ["entry", "key:", entry_key]
    for ref, kind in ((spec_key[:6], "a spec key"), (spec_key, "a spec key"), (entry_key[:6], "an entry key")):
        res = cli_json(cache_root, "explain", ref)
        assert (res["spec_key"], res["entry_keys"]) == (spec_key, [entry_key]), ref
        assert kind in run_cli(cache_root, "explain", ref).stdout.splitlines()[0]
    two = cli_json(cache_root, "explain", spec_key[:8], entry_key[:8])
    assert two["differences"] == []
    audit = cli_json(cache_root, "verify", "--rebuild", spec_key[:8])
    assert [r["key"] for r in audit["results"]] == [entry_key]
    assert [d["key"] for d in cli_json(cache_root, "ls", "--filter", f"key={spec_key[:8]}*")] == [entry_key]
    assert [d["key"] for d in cli_json(cache_root, "ls", "--filter", f"key={entry_key[:8]}*")] == [entry_key]
    table = run_cli(cache_root, "ls", "-v").stdout.splitlines()
    assert table[0].startswith("ENTRY KEY") and table[0].rstrip().endswith("SPEC KEY")
    assert any(row.startswith(entry_key) and row.rstrip().endswith(spec_key) for row in table[1:])
    for args in (["explain", "0000ff"], ["verify", "--rebuild", "0000ff"], ["explain", ""]):
        bad = run_cli(cache_root, *args)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, (args, bad.stderr)
        assert len(bad.stderr.strip().splitlines()) == 1, (args, bad.stderr)


def test_warm_spec_file_and_module_reference(cache_root, cxx, tmp_path):
    from stubcache import StubSpec

    specs = [StubSpec(f"warm{i}", f'extern "C" int stub_value(void) {{ return {i}; }}') for i in (1, 2)]
    f = tmp_path / "specs.json"
    f.write_text(json.dumps([s.to_dict() for s in specs]))
    res = cli_json(cache_root, "warm", str(f))
    assert [r["status"] for r in res["results"]] == ["built", "built"] and res["failed"] == 0
    assert [r["status"] for r in cli_json(cache_root, "warm", str(f))["results"]] == ["cached", "cached"]
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "mystubs.py").write_text(textwrap.dedent("""
        from stubcache import StubSpec
        def allocator_spec():
            return StubSpec("alloc_like", 'extern "C" int stub_value(void) { return 42; }')
        ALL = [allocator_spec(), StubSpec("other", 'extern "C" int stub_value(void) { return 3; }')]
    """))
    env = {"PYTHONPATH": str(pkg)}
    proc = run_cli(cache_root, "warm", "mystubs:allocator_spec", "mystubs:ALL", "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert [r["status"] for r in json.loads(proc.stdout)["results"]] == ["built", "cached", "built"]
    # a warmed cache satisfies STUBCACHE_REQUIRE_HIT in a fresh process
    out = run_py("""
        from stubcache import StubCache, StubSpec
        lib = StubCache().load(StubSpec("alloc_like", 'extern "C" int stub_value(void) { return 42; }'))
        print(lib.stub_value())
    """, env={"STUBCACHE_REQUIRE_HIT": "1"}).stdout.strip()
    assert out == "42"
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"name": "bad", "cpp_sources": ["int f( {"]}))
    proc = run_cli(cache_root, "warm", str(broken))
    assert proc.returncode == 1 and "bad" in proc.stderr
    assert run_cli(cache_root, "warm", "nosuchmodule_xyz:spec").returncode == 2


def test_warm_kvarena_stub(cache_root, cxx):
    proc = run_cli(cache_root, "warm", "kvarena.stub:allocator_spec", "--format", "json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert all(r["status"] in ("built", "cached") for r in json.loads(proc.stdout)["results"])


def test_clear_needs_confirmation_off_a_terminal(cache_root, cxx):
    build_real([1, 2], run_py)
    proc = run_cli(cache_root, "clear")
    assert proc.returncode == 3 and "--yes" in proc.stderr
    assert len(cli_json(cache_root, "ls")) == 2
    plan = cli_json(cache_root, "clear", "--dry-run")
    assert plan["dry_run"] and plan["summary"]["planned_removals"] == 2
    res = cli_json(cache_root, "clear", "--yes", "--stats")
    assert res["summary"]["removed"] == 2
    assert cli_json(cache_root, "ls") == [] and cli_json(cache_root, "stats")["hits"] == 0


def test_doctor(cache_root, cxx):
    build_real([1], run_py)
    res = cli_json(cache_root, "doctor")
    names = {c["name"]: c["status"] for c in res["checks"]}
    assert names["compiler"] == "ok" and names["filesystem"] in ("ok", "warn") and names["free space"] == "ok"
    assert res["errors"] == 0
    os.chmod(cache_root, 0o777)
    try:
        proc = run_cli(cache_root, "doctor")
        assert proc.returncode == 1 and "chmod go-w" in proc.stdout
        bad = cli_json(cache_root, "doctor", ok=(1,))
        assert bad["errors"] >= 1
    finally:
        os.chmod(cache_root, 0o700)


def test_doctor_filesystem_type_parsing(tmp_path):
    from stubcache.admin.doctor import filesystem_type

    mi = tmp_path / "mountinfo"
    mi.write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                  "40 22 0:50 / /shared rw - nfs4 srv:/export rw\n")
    assert filesystem_type("/shared/cache/x", str(mi)) == ("nfs4", "/shared")
    assert filesystem_type("/home/u", str(mi)) == ("ext4", "/")


def test_every_command_has_json(cache_root, cxx, tmp_path):
    keys = build_real([1], run_py)
    store = Store(str(cache_root))
    fake_entry(store, "old", 4096, last_used=time.time() - 90 * 86400)
    for argv in (["ls"], ["stats"], ["prune", "--dry-run", "--older-than", "30d"], ["verify"],
                 ["explain", keys[0]], ["doctor"], ["dir"], ["clear", "--dry-run"]):
        proc = run_cli(cache_root, *argv, "--format", "json")
        assert proc.returncode == 0, (argv, proc.stderr)
        json.loads(proc.stdout)
    plan = cli_json(cache_root, "prune", "--dry-run", "--older-than", "30d")
    table = run_cli(cache_root, "prune", "--dry-run", "--older-than", "30d").stdout.splitlines()
    rows = [ln.split() for ln in table[1:] if ln.startswith(("remove", "skip"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [(i["action"], i["kind"], i["name"]) for i in plan["items"]]
    assert [i["name"] for i in plan["items"]] == ["old"]
