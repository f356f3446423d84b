"""A fresh host's link inputs hashed while the compiler runs (stubcache.build.prefetch), in real
processes with the real compiler and linker: the head start's hashes are the files' own and
tracking takes them; a host with a hash memo starts none; a head start still linking when the
compile ends, or when it fails, is stopped with every process it started."""

from __future__ import annotations

import hashlib
import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import run_py

BUILD = """
import logging, stubcache
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("%%(message)s"))
logging.getLogger("stubcache").addHandler(handler)
logging.getLogger("stubcache").setLevel(logging.DEBUG)
lib = stubcache.StubCache().load(stubcache.StubSpec("prefetched", 'extern "C" int v(void) { return %s; }'))
print(lib.v())
"""
HEAD_START = "link inputs while compiling"  # the head start's DEBUG line: "hashed N link inputs while ..."


def _hash_memo(tmp_path: Path) -> dict:
    for f in sorted((tmp_path / "state" / "stubcache" / "probes").glob("*.json")):
        data = json.loads(f.read_text())
        if data.get("memo_key") == "tracked input hashes v1":
            return data["value"]["files"]
    return {}


def _manifest(root: Path) -> dict:
    (m,) = (root / "v1" / "entries").glob("*/manifest.json")
    return json.loads(m.read_text())


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def test_a_fresh_hosts_link_inputs_are_hashed_while_the_compiler_runs(cache_root, cxx, tmp_path):
    # conftest gives each test a fresh user state: no hash memo. The compile sleeps first, so the
    # head start ends before it; tracking then finds every large link input in the memo.
    proc = run_py(BUILD % "7", env={"STUBCACHE_TEST_CXX_SLEEP": "3"})
    assert proc.stdout.split() == ["7"]
    lines = proc.stderr.splitlines()
    head = [i for i, ln in enumerate(lines) if HEAD_START in ln]
    compiled = [i for i, ln in enumerate(lines) if "compiled in" in ln]
    assert head and compiled and head[0] < compiled[0], proc.stderr
    memo = _hash_memo(tmp_path)
    headers = _manifest(cache_root)["headers"]
    # The C library and libstdc++ at least (each >= 64 KiB), each a file this link read.
    assert len(memo) >= 2 and set(memo) <= set(headers), (memo, headers)
    for path, (sig, digest) in memo.items():
        st = os.stat(path)
        assert sig == [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        assert digest == _sha256(path) == headers[path]
    assert not any(p.endswith("prefetch-link.so") for p in headers)


def test_a_host_with_a_hash_memo_starts_no_head_start(cache_root, cxx, tmp_path):
    assert HEAD_START in run_py(BUILD % "1", env={"STUBCACHE_TEST_CXX_SLEEP": "3"}).stderr
    proc = run_py(BUILD % "2", env={"STUBCACHE_DIR": str(tmp_path / "another-root")})
    assert proc.stdout.split() == ["2"]
    assert "compiled in" in proc.stderr and HEAD_START not in proc.stderr, proc.stderr


# The sleep's argument names this test process's sleepers: CI runs two test sessions side by side.
SLEEP = f"43.{os.getpid() % 10000:04d}1"
EMPTY_LINKS = {
    # the empty link starts a sleep that holds its output pipe and waits for it: only the head
    # start's whole session killed lets it go
    "slow": f"sleep {SLEEP} & wait",
    # it leaves the sleep behind in its session, holding the pipe, and links
    "leaves a program": f"sleep {SLEEP} &",
    # its trace names a file with a NUL byte in its name (no traceback, no failed build)
    "odd trace": "printf '/etc/pass\\000wd\\n'",
}


def _empty_link(tmp_path, monkeypatch, cxx, first: str) -> None:
    """A CXX (in front of the compile-counting one) whose empty link, the head start, runs the
    shell command ``first`` first."""
    script = tmp_path / "cxx-empty-link.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case " $* " in
          *prefetch-link.so*) {first} ;;
        esac
        exec "{cxx.path}" "$@"
        """))
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))


@pytest.fixture
def slow_empty_link(tmp_path, monkeypatch, cxx):
    _empty_link(tmp_path, monkeypatch, cxx, EMPTY_LINKS["slow"])


def _sleepers() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", SLEEP.encode()]:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # killed, not yet reaped by a container's init
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("compile_ends", ["built", "failed"])
def test_a_head_start_still_linking_when_the_compile_ends_is_stopped_whole(cache_root, slow_empty_link, tmp_path,
                                                                           compile_ends):
    t0 = time.monotonic()
    body = "7" if compile_ends == "built" else "7 +"  # a syntax error: the build fails
    proc = run_py(BUILD % body, check=False, timeout=40)
    assert time.monotonic() - t0 < 40
    if compile_ends == "built":
        assert proc.returncode == 0 and proc.stdout.split() == ["7"], proc.stderr
        headers = _manifest(cache_root)["headers"]
        assert headers and all(d == _sha256(p) for p, d in headers.items())  # tracking hashed them itself
    else:
        assert proc.returncode != 0 and "BuildError" in proc.stderr, proc.stderr
        assert not (cache_root / "v1" / "entries").is_dir() or not os.listdir(cache_root / "v1" / "entries")
    assert HEAD_START not in proc.stderr
    assert _sleepers() == []
    staging = cache_root / "v1" / "staging"
    assert not staging.is_dir() or os.listdir(staging) == []


def test_a_program_the_empty_link_leaves_holding_its_output_does_not_hold_up_the_build(cache_root, cxx, tmp_path,
                                                                                      monkeypatch):
    # A CXX whose empty link leaves a program of its own session behind (setsid: no kill of the
    # head start's session reaches it) holding the trace's pipe: the build waits for the head
    # start's thread a bounded time, then goes on without it and hashes the inputs itself.
    pidfile = tmp_path / "holder.pid"
    _empty_link(tmp_path, monkeypatch, cxx, f"""setsid sh -c 'echo $$ > "{pidfile}"; exec sleep 47.25' &""")
    try:
        t0 = time.monotonic()
        proc = run_py(BUILD % "7", env={"STUBCACHE_TEST_CXX_SLEEP": "2"}, timeout=40)
        assert proc.stdout.split() == ["7"] and time.monotonic() - t0 < 30, proc.stderr
        assert HEAD_START not in proc.stderr
        headers = _manifest(cache_root)["headers"]
        assert headers and all(d == _sha256(p) for p, d in headers.items())
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), 9)
            except (ProcessLookupError, ValueError):
                pass


@pytest.mark.parametrize("what", ["leaves a program", "odd trace"])
def test_an_empty_link_that_misbehaves_neither_fails_nor_outlives_the_build(cache_root, cxx, tmp_path, monkeypatch,
                                                                             what):
    _empty_link(tmp_path, monkeypatch, cxx, EMPTY_LINKS[what])
    t0 = time.monotonic()
    proc = run_py(BUILD % "7", env={"STUBCACHE_TEST_CXX_SLEEP": "2"}, timeout=40)
    assert proc.stdout.split() == ["7"] and time.monotonic() - t0 < 30, proc.stderr
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr
    assert _sleepers() == []  # one left in the head start's session is killed with it
    headers = _manifest(cache_root)["headers"]
    assert headers and all(d == _sha256(p) for p, d in headers.items())


def test_no_head_start_where_the_hash_memo_cannot_be_kept(cache_root, cxx, tmp_path):
    # A memo directory that is not trusted (writable by the group) keeps nothing: a head start
    # there would run again for every build and last for none.
    run_py(BUILD % "1", env={"STUBCACHE_TEST_CXX_SLEEP": "2"})
    probes = tmp_path / "state" / "stubcache" / "probes"
    for f in probes.glob("*.json"):
        f.unlink()
    probes.chmod(0o770)
    proc = run_py(BUILD % "2", env={"STUBCACHE_DIR": str(tmp_path / "another-root"), "STUBCACHE_TEST_CXX_SLEEP": "2"})
    assert proc.stdout.split() == ["2"]
    assert "compiled in" in proc.stderr and HEAD_START not in proc.stderr, proc.stderr
