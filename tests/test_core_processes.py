"""Core behaviour with real processes, a real compiler and real kill -9 (header-free stubs)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

import stubcache
from stubcache import BuildError, StubCache, StubSpec

from .conftest import HAS_TORCH, open_files, run_py, spawn_py, wait_until


def value_src(n: int) -> str:
    return f'extern "C" int value(void) {{ return {n}; }}\n'


# A child that says it is ready, waits for the gate to open, then gets-or-builds and calls value().
CHILD = """
import json, os, sys, time
print("ready", flush=True)
while not os.path.exists(os.environ["GATE"]):
    time.sleep(0.001)
import stubcache
spec = stubcache.StubSpec(os.environ.get("NAME", "herd"), os.environ["SRC"])
lib = stubcache.StubCache().load(spec)
print(json.dumps({"value": lib.value(), "torch": "torch" in sys.modules}))
"""


def herd(sources: list[str], name_per_proc=None) -> list[dict]:
    gate = Path(tempfile.mkdtemp(prefix="gate-", dir=Path(os.environ["STUBCACHE_DIR"]).parent)) / "open"
    procs = []
    for i, src in enumerate(sources):
        env = {"GATE": str(gate), "SRC": src}
        if name_per_proc:
            env["NAME"] = name_per_proc[i]
        procs.append(spawn_py(CHILD, env=env))
    for p in procs:  # all of them up and at the gate, then open it: they start together
        assert p.stdout.readline().strip() == "ready", p.communicate()
    gate.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def published(root: Path) -> list[str]:
    d = root / "v1" / "entries"
    return sorted(os.listdir(d)) if d.exists() else []


def test_eight_processes_same_spec_compile_once(cache_root, cxx):
    results = herd([value_src(7)] * 8)
    assert [r["value"] for r in results] == [7] * 8
    assert cxx.compiles() == 1
    assert len(published(cache_root)) == 1


def test_eight_processes_same_name_different_sources_each_get_their_own(cache_root, cxx):
    results = herd([value_src(i) for i in range(8)])
    assert [r["value"] for r in results] == list(range(8))
    assert cxx.compiles() == 8
    assert len(published(cache_root)) == 8


def test_later_process_hits_without_compiling_or_importing_torch(cache_root, cxx):
    herd([value_src(3)])
    cxx.reset()
    results = herd([value_src(3)])
    assert results == [{"value": 3, "torch": False}]
    assert cxx.compiles() == 0


def test_hit_path_starts_no_subprocess(cache_root, cxx):
    herd([value_src(4)])
    code = """
    import subprocess, os, stubcache
    def boom(*a, **k): raise AssertionError("subprocess started on the hit path")
    subprocess.Popen = boom
    os.posix_spawn = boom
    lib = stubcache.StubCache().load(stubcache.StubSpec("herd", os.environ["SRC"]))
    print(lib.value())
    """
    assert run_py(code, env={"SRC": value_src(4)}).stdout.strip() == "4"


def test_in_process_repeat_returns_memoised_entry(cache_root, cxx):
    cache = StubCache()
    spec = StubSpec("memo", value_src(1))
    a = cache.get_or_build(spec)
    b = cache.get_or_build(StubSpec("memo", value_src(1)))
    assert a.path == b.path and a.key == b.key
    assert cxx.compiles() == 1


def test_a_reused_spec_gets_the_new_key_after_an_environment_change(cache_root, cxx, monkeypatch):
    """The cache remembers a spec object's key only while the fingerprint is the same: the same
    spec, asked for again after CXX changed in this process, is built for the new compiler."""
    cache = StubCache()
    spec = StubSpec("memo2", value_src(2))
    first = cache.get_or_build(spec)
    assert cache.get_or_build(spec) is first and cxx.compiles() == 1
    monkeypatch.setenv("CXX", "c++")
    second = cache.get_or_build(spec)
    assert second.key != first.key and cxx.compiles() == 1  # built by plain c++, not the wrapper
    monkeypatch.setenv("CXX", str(cxx.path))
    assert cache.get_or_build(spec).key == first.key and cxx.compiles() == 1


def test_used_header_content_is_part_of_the_key(cache_root, cxx, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "val.h").write_text("#define VAL 11\n")
    src = '#include "val.h"\nextern "C" int value(void) { return VAL; }\n'
    code = """
    import os, stubcache
    spec = stubcache.StubSpec("hdr", os.environ["SRC"], extra_include_paths=[os.environ["INC"]])
    e = stubcache.StubCache().get_or_build(spec)
    print(stubcache.StubCache().load_entry(e).value(), e.key)
    """
    env = {"SRC": src, "INC": str(inc)}
    v1, k1 = run_py(code, env=env).stdout.split()
    assert v1 == "11"
    v1b, k1b = run_py(code, env=env).stdout.split()
    assert (v1b, k1b) == (v1, k1) and cxx.compiles() == 1
    (inc / "val.h").write_text("#define VAL 12\n")
    v2, k2 = run_py(code, env=env).stdout.split()
    assert v2 == "12" and k2 != k1 and cxx.compiles() == 2
    (inc / "val.h").write_text("#define VAL 11\n")  # back to the first content: a hit again
    v3, k3 = run_py(code, env=env).stdout.split()
    assert (v3, k3) == ("11", k1) and cxx.compiles() == 2
    manifest = StubCache().store.read_manifest(k1)
    # The user header is tracked by content (system headers and linker inputs are tracked too).
    assert str(inc / "val.h") in manifest.headers


def test_irrelevant_load_inline_arguments_share_one_build(cache_root, cxx, tmp_path):
    (tmp_path / "b1").mkdir()
    (tmp_path / "b2").mkdir()
    a = stubcache.load_inline("irr", value_src(5), is_python_module=False, no_implicit_headers=True,
                              build_directory=str(tmp_path / "b1"), verbose=True)
    b = stubcache.load_inline("irr", value_src(5), is_python_module=False, no_implicit_headers=True,
                              build_directory=str(tmp_path / "b2"), verbose=False, keep_intermediates=False)
    assert cxx.compiles() == 1
    # Each caller's build_directory holds the library, as torch leaves it (see test_engines.py).
    assert (a, b) == (str(tmp_path / "b1" / "irr.so"), str(tmp_path / "b2" / "irr.so"))


def test_sigkill_mid_compile_does_not_block_the_next_process(cache_root, cxx, tmp_path):
    mark = tmp_path / "compiling"
    victim = subprocess.Popen(
        [sys.executable, "-c", "import os, stubcache; stubcache.StubCache().load(stubcache.StubSpec('kill', os.environ['SRC']))"],
        env=dict(os.environ, SRC=value_src(9), STUBCACHE_TEST_CXX_SLEEP="60", STUBCACHE_TEST_CXX_MARK=str(mark)),
        start_new_session=True)
    try:
        wait_until(mark.exists, "the victim to start compiling", proc=victim)
        # (On a fresh host the compile starts while the toolchain is probed, before the key's
        # build lock is taken: the victim holds it once the probe is done.)
        locks = str(cache_root / "v1" / "locks")
        held: set[str] = set()

        def holds() -> bool:
            held.update(f for f in open_files(victim.pid) if f.startswith(locks) and f.endswith(".lock"))
            return bool(held)

        wait_until(holds, "the victim to hold the build lock", proc=victim)
        waiter = spawn_py("""
        import os, stubcache
        print(stubcache.StubCache().load(stubcache.StubSpec('kill', os.environ['SRC'])).value())
        """, env={"SRC": value_src(9)})
        wait_until(lambda: held & open_files(waiter.pid), "the waiter to wait on the victim's lock", proc=waiter)
        assert published(cache_root) == []
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        # The victim's compiler child is still sleeping for a minute; the waiter must not wait for it.
        out, err = waiter.communicate(timeout=30)
        assert waiter.returncode == 0, err
        assert out.strip() == "9"
        assert cxx.compiles() == 2
        assert len(published(cache_root)) == 1
    finally:
        try:
            os.killpg(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


BROKEN = 'extern "C" int value(void) { return this is not C++; }\n'


def test_invalid_cpp_raises_build_error_and_publishes_nothing(cache_root, cxx):
    cache = StubCache()
    with pytest.raises(BuildError) as info:
        cache.get_or_build(StubSpec("broken", BROKEN))
    assert "error" in info.value.output and "main.cpp" in info.value.output
    assert published(cache_root) == []
    assert os.listdir(cache_root / "v1" / "staging") == []
    with pytest.raises(BuildError):  # again: retried, raised again, no hang
        cache.get_or_build(StubSpec("broken", BROKEN))
    assert cxx.compiles() == 2


@pytest.mark.parametrize("call", ["get_or_build", "load"])
def test_waiters_get_the_build_error_without_recompiling(cache_root, cxx, tmp_path, call):
    # With StubCache().load the waiters first wait for the process serving the same request (its
    # request lock), then take the full path, which must still raise the failure recorded since
    # they began waiting rather than compile again.
    mark = tmp_path / "compiling"
    code = f"""
    import os, sys, stubcache
    try:
        stubcache.StubCache().{call}(stubcache.StubSpec('broken', os.environ['SRC']))
    except stubcache.BuildError as e:
        print("BuildError", "error" in e.output)
        sys.exit(0)
    sys.exit(1)
    """
    # The failing compile is held 6 s: the waiters (started once it began) must be waiting
    # before it fails, even on a loaded host; one that came later would rightly compile again.
    first = spawn_py(code, env={"SRC": BROKEN, "STUBCACHE_TEST_CXX_SLEEP": "6", "STUBCACHE_TEST_CXX_MARK": str(mark)})
    wait_until(mark.exists, "the first process to start compiling", proc=first)
    waiters = [spawn_py(code, env={"SRC": BROKEN}) for _ in range(3)]
    for p in [first, *waiters]:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        assert out.strip() == "BuildError True"
    assert cxx.compiles() == 1
    assert published(cache_root) == []


def test_herd_waiters_take_the_builders_record_without_the_cache(cache_root, cxx, tmp_path):
    # A herd on a cold key: one process serves the request (the whole cache, the build, the hit
    # record); the others wait for it and take its record through the compact hit path, so they
    # never import the cache, and every check of a hit still runs (the hit is counted).
    mark = tmp_path / "compiling"
    code = """
    import json, os, sys, stubcache, stubcache.hit
    if os.environ.get("WAIT_LONG"):  # the mechanism under test, not its bound: a loaded CI host
        stubcache.hit.REQUEST_WAIT = 60.0  # may take over a second for the whole build
    lib = stubcache.StubCache().load(stubcache.StubSpec('herd', os.environ['SRC']))
    print(json.dumps({"value": lib.value(), "core": "stubcache.cache.core" in sys.modules}))
    """
    # The compile is held 0.3 s; the waiters wait for their server up to 60 s, not the 1 s of
    # REQUEST_WAIT (a waiter that starts after the record is there simply finds it).
    first = spawn_py(code, env={"SRC": value_src(5), "STUBCACHE_TEST_CXX_SLEEP": "0.3",
                                "STUBCACHE_TEST_CXX_MARK": str(mark)})
    wait_until(mark.exists, "the first process to start compiling", proc=first)
    waiters = [spawn_py(code, env={"SRC": value_src(5), "WAIT_LONG": "1"}) for _ in range(5)]
    results = []
    for p in [first, *waiters]:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["value"] for r in results] == [5] * 6
    # The server took the full path; the waiters took its record without the cache (with the
    # request lock gone, every waiter would import the cache).
    assert results[0]["core"] is True and [r["core"] for r in results[1:]] == [False] * 5, results
    assert cxx.compiles() == 1
    hits = sum(1 for f in (cache_root / "v1" / "events").iterdir() for ln in f.read_text().splitlines()
               if '"ev":"hit"' in ln)
    assert hits >= 5


def test_truncated_library_is_quarantined_and_rebuilt(cache_root, cxx):
    code = """
    import os, stubcache
    print(stubcache.StubCache().load(stubcache.StubSpec('corrupt', os.environ['SRC'])).value())
    """
    assert run_py(code, env={"SRC": value_src(21)}).stdout.strip() == "21"
    [key] = published(cache_root)
    entry = cache_root / "v1" / "entries" / key
    lib = next(p for p in entry.iterdir() if p.suffix == ".so")
    entry.chmod(0o755)
    lib.chmod(0o644)
    with open(lib, "r+b") as fh:
        fh.truncate(100)
    lib.chmod(0o555)
    proc = run_py(code, env={"SRC": value_src(21)})
    assert proc.stdout.strip() == "21"
    assert "quarantined" in proc.stderr
    assert cxx.compiles() == 2
    assert len(os.listdir(cache_root / "v1" / "quarantine")) == 1


def test_direct_stub_needs_no_libtorch(cache_root):
    entry = StubCache().get_or_build(StubSpec("needed", value_src(1)))
    needed = _dt_needed(entry.path)
    assert not any("torch" in n or "c10" in n for n in needed), needed


@pytest.mark.torch
def test_load_inline_path_links_as_needed(cache_root):
    """torch adds -lc10 -ltorch...; with --as-needed a stub that uses none keeps none."""
    entry = StubCache().get_or_build(StubSpec("needed_li", value_src(2), builder="load_inline"))
    assert entry.manifest.build_method == "load_inline"
    assert "--as-needed" in entry.manifest.build_log
    needed = _dt_needed(entry.path)
    assert not any("torch" in n or "c10" in n for n in needed), needed
    assert StubCache().load_entry(entry).value() == 2


def _dt_needed(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [ln.split("[", 1)[1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln]


def test_pythons_header_directory_is_known_without_sysconfig_on_this_python():
    """The direct build starts its compiler with the header directory posix_prefix's template
    gives (sysconfig's first lookup is ~1.5 ms of an engine's cold start); on the Pythons CI runs,
    the template is sysconfig's answer, so no build there starts twice."""
    out = run_py("""
        import sysconfig, sys
        from stubcache.build import buildinputs
        early = buildinputs.python_include_early()
        print(early == sysconfig.get_path("include", scheme="posix_prefix"), early)
    """).stdout.split()
    assert out[0] == "True", out


PY_HEADER_SRC = '#include <Python.h>\nextern "C" int major(void) { return PY_MAJOR_VERSION; }\n'


def test_a_wrong_guess_of_pythons_headers_builds_again_with_sysconfigs(cache_root, cxx):
    # A Python laid out unlike posix_prefix's template: the compile started with the guess is
    # followed by one with sysconfig's directory, and only that one's library is published.
    out = run_py(f"""
        import stubcache
        from stubcache.build import buildinputs
        buildinputs.python_include_early = lambda: "/nonexistent/include/python3"
        lib = stubcache.StubCache().load(stubcache.StubSpec("pyheader", {PY_HEADER_SRC!r}))
        print(lib.major())
    """).stdout.split()
    assert out == ["3"]
    assert cxx.compiles() == 2
    assert run_py(f"""
        import stubcache
        print(stubcache.StubCache().load(stubcache.StubSpec("pyheader", {PY_HEADER_SRC!r})).major())
    """).stdout.split() == ["3"]
    assert cxx.compiles() == 2


SPECULATE = """
import logging, os, sys, stubcache
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("%(message)s"))
logging.getLogger("stubcache").addHandler(handler)
logging.getLogger("stubcache").setLevel(logging.DEBUG)
lib = stubcache.StubCache().load(stubcache.StubSpec("early", 'extern "C" int early(void) { return 41; }'))
print(lib.early() + 1)
"""


def _staging(root: Path) -> list[str]:
    d = root / "v1" / "staging"
    return sorted(os.listdir(d)) if d.is_dir() else []


def test_a_fresh_hosts_build_starts_compiling_while_the_toolchain_is_probed(cache_root, cxx):
    # A fresh host (no probe memo of this user's: conftest): the compile starts once the probe
    # knows the command, and the miss's build takes it over: one compile, published as usual.
    proc = run_py(SPECULATE)
    assert proc.stdout.split() == ["42"]
    assert "compiling (direct build, started while the toolchain was probed)" in proc.stderr, proc.stderr
    assert cxx.compiles() == 1
    assert _staging(cache_root) == []
    # The probe's answers are kept: the next process in a new stub compiles after the lookup.
    again = run_py(SPECULATE.replace("41", "40"))
    assert again.stdout.split() == ["41"] and "compiling (direct build)" in again.stderr, again.stderr
    assert cxx.compiles() == 2


# The sleep's argument names this test process's sleeper: CI runs two test sessions side by side
# (the clang set's and another Python's), each with this test.
PROBER_SLEEP = f"37.{os.getpid() % 10000:04d}1"


def test_a_compile_started_during_the_probe_is_killed_whole_when_the_lookup_hits(cache_root, cxx, tmp_path):
    # The prober (its compile started: a CXX that sleeps first) is stopped after its probe; a
    # process that gives up waiting for the probe's memo lock (after 2 s) probes alone, builds
    # and publishes. The prober then finds the entry: its compile is killed with every process it
    # started (a plain kill leaves the sleep holding the pipe: no return within the timeout), and
    # its directory removed.
    mark = tmp_path / "started"
    prober = spawn_py(SPECULATE, env={"STUBCACHE_FAULT": "probed:stop", "STUBCACHE_TEST_CXX_SLEEP": PROBER_SLEEP,
                                      "STUBCACHE_TEST_CXX_MARK": str(mark)})
    try:
        wait_until(lambda: mark.exists() and _stopped(prober.pid), "the prober to stop after its probe", proc=prober)
        other = run_py(SPECULATE, env={"STUBCACHE_LOCK_TIMEOUT": "2"})
        assert other.stdout.split() == ["42"]
        assert "compiling (direct build" in other.stderr, other.stderr
        os.kill(prober.pid, signal.SIGCONT)
        out, err = prober.communicate(timeout=30)
        assert prober.returncode == 0 and out.split() == ["42"], err
        assert ": compiling (" not in err and "not in the cache" not in err, err
    finally:
        if prober.poll() is None:
            os.kill(prober.pid, signal.SIGCONT)
            prober.kill()
            prober.wait()
    assert _staging(cache_root) == []
    sleepers = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", PROBER_SLEEP.encode()]:
                sleepers.append(pid)
        except OSError:
            pass
    assert sleepers == []


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_probe_in_a_root_with_entries_starts_no_compile_before_the_lookup(cache_root, cxx, tmp_path):
    # A probe that runs again where entries are (the environment or the toolchain changed, or its
    # memos are gone) is as likely to end in a hit: no compile starts before the lookup.
    run_py(SPECULATE)
    assert cxx.compiles() == 1
    shutil.rmtree(tmp_path / "state")
    shutil.rmtree(cache_root / "v1" / "state")
    proc = run_py(SPECULATE)
    assert proc.stdout.split() == ["42"] and "probed the compiler" in proc.stderr, proc.stderr
    assert cxx.compiles() == 1
    assert _staging(cache_root) == []


def test_processes_that_waited_for_the_probe_wait_for_its_early_compile(cache_root, cxx, tmp_path):
    # The prober is stopped just after its probe (its compile started, the probe's memo lock
    # held); processes started meanwhile wait for that lock, then find the key's build lock
    # taken and the entry published: one compile in all, not one beside the early one.
    prober = spawn_py(SPECULATE, env={"STUBCACHE_FAULT": "probed:stop"})
    others: list[subprocess.Popen] = []
    try:
        wait_until(lambda: _stopped(prober.pid), "the prober to stop after its probe", proc=prober)
        others += [spawn_py(SPECULATE) for _ in range(3)]
        state = str(cache_root / "v1" / "state")
        for p in others:
            wait_until(lambda: any(f.startswith(state) and f.endswith(".json.lock") for f in open_files(p.pid)),
                       "a process to wait for the probe's memo lock", proc=p)
        os.kill(prober.pid, signal.SIGCONT)
        for p in [prober, *others]:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0 and out.split() == ["42"], err
    finally:
        for p in [prober, *others]:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    assert cxx.compiles() == 1


def test_manifest_records_the_build(cache_root):
    entry = StubCache().get_or_build(StubSpec("manif", value_src(3)))
    m = entry.manifest
    assert m.key == entry.key and m.build_method == "direct"
    assert m.preimage["spec"]["cpp_sources"] == [value_src(3)]
    torch_version = m.preimage["fingerprint"]["torch"]["version"]
    assert torch_version.startswith("2.") if HAS_TORCH else torch_version is None
    assert "$ " in m.build_log and m.size == os.path.getsize(entry.path)
    assert sorted(os.listdir(os.path.dirname(entry.path))) == sorted(["manifest.json", m.library])
    assert os.stat(cache_root).st_mode & 0o777 == 0o700


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
    ready = StubCache().get_or_build(StubSpec("fast", value_src(1)))  # published, not in `cache`'s memo
    cache = StubCache()
    mark = tmp_path / "compiling"
    monkeypatch.setenv("STUBCACHE_TEST_CXX_SLEEP", "5")
    monkeypatch.setenv("STUBCACHE_TEST_CXX_MARK", str(mark))
    slow = threading.Thread(target=lambda: cache.get_or_build(StubSpec("slow", value_src(2))))
    slow.start()
    while not mark.exists():
        slow.join(0.01)
    assert cache.get_or_build(StubSpec("fast", value_src(1))).key == ready.key
    assert cache.load_entry(ready).value() == 1
    assert slow.is_alive()  # the hit and the load finished while the slow build was running
    slow.join()


BUILD_LOCK_CHILD = """
import json, sys, stubcache
lib = stubcache.StubCache().load(stubcache.StubSpec("lockpath", sys.argv[1]))
print(json.dumps({"value": lib.value(), "filelock": "filelock" in sys.modules}))
"""


def test_a_free_build_lock_is_taken_without_filelock_a_held_one_is_waited_for_through_it(cache_root, cxx):
    """A lone miss takes the per-key build lock with one raw flock (filelock's import is a large
    part of a cold build's own cost); a miss that finds it held by another process waits for it
    through filelock and builds once the holder lets go (the same kernel lock either way)."""
    proc = subprocess.run([sys.executable, "-c", BUILD_LOCK_CHILD, value_src(41)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"value": 41, "filelock": False}
    # A second key, its build lock held by a real process until the test lets go.
    spec = StubSpec("lockpath", value_src(42))
    cache = StubCache()
    lock = cache.store.lock_path(cache.key(spec))
    cache.store.ensure()
    holder = spawn_py("""
        import fcntl, os, sys, time
        fd = os.open(os.environ["LOCK"], os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)  # until the test kills it
    """, env={"LOCK": str(lock)})
    assert holder.stdout.readline().strip() == "held"
    waiter = subprocess.Popen([sys.executable, "-c", BUILD_LOCK_CHILD, value_src(42)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    real = os.path.realpath(lock)
    wait_until(lambda: real in open_files(waiter.pid), "the waiter opening the held build lock", proc=waiter)
    assert cxx.compiles() == 1  # the first key's; the second waits
    holder.kill()
    out, err = waiter.communicate(timeout=300)
    assert waiter.returncode == 0, err
    assert json.loads(out) == {"value": 42, "filelock": True}
    assert cxx.compiles() == 2
