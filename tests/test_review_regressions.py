"""Regressions for defects found in review: header-tracking specs that track nothing, a crash
between the variant marker and the entry, loading by a replaced path, one build blocking other
keys in the same process, and an environment changed after the first call."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading

import stubcache
from stubcache import StubCache, StubSpec


def src(n: int) -> str:
    return f'extern "C" int value(void) {{ return {n}; }}\n'


def test_include_dir_without_used_headers(cache_root, cxx, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for _ in range(2):
        cache = StubCache()
        entry = cache.get_or_build(StubSpec("noinc", src(3), extra_include_paths=[str(empty)]))
        assert cache.load_entry(entry).value() == 3
        # Nothing from the include dir; system headers and linker inputs are tracked regardless.
        assert not any(p.startswith(str(empty)) for p in entry.manifest.headers)
    assert cxx.compiles() == 1


def test_load_of_a_self_contained_file(cache_root, cxx, tmp_path):
    f = tmp_path / "solo.cpp"
    f.write_text(src(4))
    for _ in range(2):
        path = stubcache.load("solo", [str(f)], is_python_module=False)
        assert ctypes.CDLL(path).value() == 4
    assert cxx.compiles() == 1


def test_lost_variant_marker_recovers(cache_root, cxx, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "v.h").write_text("#define V 8\n")
    spec = lambda: StubSpec("marker", '#include "v.h"\nextern "C" int value(void) { return V; }\n',
                            extra_include_paths=[str(inc)])
    e1 = StubCache().get_or_build(spec())
    for marker_dir in (cache_root / "v1" / "variants").iterdir():  # as if the marker was never written
        shutil.rmtree(marker_dir)
    cache = StubCache()
    e2 = cache.get_or_build(spec())
    assert e2.key == e1.key and cache.load_entry(e2).value() == 8
    assert StubCache().get_or_build(spec()).key == e1.key


COUNTER = 'static int n; extern "C" int bump(void) { return ++n; }\n'


def test_loaded_path_names_the_verified_file_after_replacement(cache_root):
    cache = StubCache()
    entry = cache.get_or_build(StubSpec("counter", COUNTER))
    assert cache.load_entry(entry).bump() == 1
    loaded = cache.loaded_path(entry)
    assert loaded == entry.path  # the real path: what /proc/self/maps shows, for symbolizers
    # Someone quarantines the entry and another process rebuilds it at the same path.
    cache.store.quarantine(entry.key, "test")
    StubCache().get_or_build(StubSpec("counter", COUNTER))
    # glibc matches the loaded name: same handle, same state, the file we verified
    assert ctypes.CDLL(loaded).bump() == 2


def test_a_slow_build_does_not_block_other_keys_in_the_process(cache_root, cxx, tmp_path, monkeypatch):
    ready = StubCache().get_or_build(StubSpec("fast", src(1)))  # published, not in `cache`'s memo
    cache = StubCache()
    mark = tmp_path / "compiling"
    monkeypatch.setenv("STUBCACHE_TEST_CXX_SLEEP", "5")
    monkeypatch.setenv("STUBCACHE_TEST_CXX_MARK", str(mark))
    slow = threading.Thread(target=lambda: cache.get_or_build(StubSpec("slow", src(2))))
    slow.start()
    while not mark.exists():
        slow.join(0.01)
    assert cache.get_or_build(StubSpec("fast", src(1))).key == ready.key
    assert cache.load_entry(ready).value() == 1
    assert slow.is_alive()  # the hit and the load finished while the slow build was running
    slow.join()


def test_environment_changed_after_first_call_changes_the_key(cache_root, monkeypatch):
    cache = StubCache()
    spec = StubSpec("envkey", src(1))
    k1 = cache.get_or_build(spec).key
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    k2 = cache.get_or_build(StubSpec("envkey", src(1))).key
    assert k1 != k2
    assert cache.preimage(spec)["fingerprint"]["env"]["TORCH_CUDA_ARCH_LIST"] == "9.0"


def test_prune_merges_event_files_of_finished_processes(cache_root):
    import json
    import subprocess
    import sys

    from .conftest import run_py

    code = """
    import os, stubcache
    stubcache.StubCache().load(stubcache.StubSpec("ev" + os.environ["N"], 'extern "C" int f(void){return 1;}'))
    stubcache.StubCache().load(stubcache.StubSpec("ev0", 'extern "C" int f(void){return 1;}'))
    """
    for n in range(3):
        run_py(code, env={"N": str(n)})
    cli = [sys.executable, "-m", "stubcache", "--cache-dir", str(cache_root)]

    def stats():
        out = subprocess.run(cli + ["stats", "--format", "json"], capture_output=True, text=True, check=True).stdout
        data = json.loads(out)
        return {k: data[k] for k in ("hits", "misses", "builds", "processes")}

    before = stats()
    assert before["processes"] == 3 and before["builds"] == 3
    events = cache_root / "v1" / "events"
    assert len(list(events.glob("*.jsonl"))) == 3
    pr = subprocess.run(cli + ["prune", "--yes"], capture_output=True, text=True)
    assert pr.returncode == 0, pr.stderr
    assert "merged the event files of 3" in pr.stdout
    assert [p.name.startswith("archive-") for p in events.glob("*.jsonl")] == [True]
    assert stats() == before
    run_py(code, env={"N": "9"})
    subprocess.run(cli + ["prune", "--yes"], capture_output=True, text=True, check=True)
    after = stats()
    assert len(list(events.glob("*.jsonl"))) == 1
    assert after["processes"] == 4 and after["builds"] == 4 and after["hits"] == before["hits"] + 1


def _stats(cache_root):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "stubcache", "--cache-dir", str(cache_root), "stats",
                          "--format", "json"], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    return {k: data[k] for k in ("hits", "misses", "builds", "processes")}


def test_compaction_killed_before_deleting_its_sources_counts_nothing_twice(cache_root):
    import json

    from stubcache.stats import compact_events

    from .conftest import run_py

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
    import subprocess
    import sys

    from .conftest import run_py, spawn_py

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


def test_init_shared_never_follows_planted_symlinks(tmp_path):
    import grp
    import subprocess
    import sys

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to pick a group")
    root = tmp_path / "cache"
    subprocess.run([sys.executable, "-m", "stubcache", "init", str(root)], check=True, capture_output=True)
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    (root / "v1" / "locks" / "evil.lock").symlink_to(victim)
    group = grp.getgrgid(os.getgid()).gr_name
    r = subprocess.run([sys.executable, "-m", "stubcache", "init", "--shared", "--group", group, str(root)],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert oct(victim.stat().st_mode & 0o777) == oct(0o600)


def test_fingerprint_memo_notices_a_compiler_added_earlier_on_path(cache_root, tmp_path, monkeypatch):
    import json
    import shutil

    from .conftest import run_py

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    real = shutil.which("c++")
    (b / "c++").write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
    (b / "c++").chmod(0o755)
    monkeypatch.setenv("PATH", f"{a}:{b}:{os.environ['PATH']}")
    monkeypatch.delenv("CXX", raising=False)
    code = """
    import json, stubcache
    print(json.dumps(stubcache.StubCache().preimage(stubcache.StubSpec("p", "int x;"))["fingerprint"]["cxx"]))
    """
    first = json.loads(run_py(code).stdout)
    again = json.loads(run_py(code).stdout)  # served by the whole-fingerprint memo
    assert first == again and first["path"] == str(b / "c++")
    (a / "c++").write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "shadow 1.0" && exit 0\nexec "{real}" "$@"\n')
    (a / "c++").chmod(0o755)
    shadow = json.loads(run_py(code).stdout)
    assert shadow["path"] == str(a / "c++") and shadow["version"] == "shadow 1.0"
