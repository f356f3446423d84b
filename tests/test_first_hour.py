"""A new user's first hour (issue 20 items 8 and 9): what the README and the demo show ends in a
clear line, never a traceback, and leaves nothing behind; real processes throughout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import stubcache

from .conftest import run_on_pty

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT, **extra}


def _published_root(tmp_path) -> str:
    root = str(tmp_path / "root")
    cache = stubcache.StubCache(root)
    for i in range(3):
        cache.get_or_build(stubcache.StubSpec(f"first_hour_{i}", f'extern "C" int f{i}(void) {{ return {i}; }}'))
    return root


@pytest.mark.parametrize("unbuffered", ["1", ""])
@pytest.mark.parametrize("args", [["ls", "-v"], ["ls", "--format", "csv"], ["stats"], ["--help"], ["ls", "--help"]])
def test_a_reader_that_went_away_ends_the_command_quietly(tmp_path, cache_root, args, unbuffered):
    """``stubcache ls -v | head -1``: the reader closes the pipe before the command writes. The
    command ends without a message (141, as a shell reports SIGPIPE), not with 'Broken pipe'.
    With stdout buffered, as users run it (no ``PYTHONUNBUFFERED``, which CI sets), the output
    is still in the buffer when the command returns: its EPIPE must not wait for the exit-time
    flush, which printed "Exception ignored ... BrokenPipeError" and exited 120."""
    root = _published_root(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write gets EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "stubcache", "--cache-dir", root, *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env={**_env(), "PYTHONUNBUFFERED": unbuffered},
                              timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == "", proc.stderr
    # (argparse's --help swallows a write's error itself: unbuffered, the help ends with 0)
    assert proc.returncode == 141 or (proc.returncode == 0 and "--help" in args and unbuffered)


@pytest.mark.torch  # the demo imports torch for its tensor
@pytest.mark.parametrize("args,message", [
    (["--reserve-mib", "1"], "exceeds the reservation"),
    (["--tokens", "0"], "argument --tokens: '0' must be at least 1"),
    (["--reserve-mib", "lots"], "argument --reserve-mib: 'lots' is not a whole number"),
])
def test_kvarena_demo_bad_sizes_are_one_clear_error(tmp_path, cache_root, args, message):
    proc = subprocess.run([sys.executable, "-m", "kvarena.demo", "--device", "cpu", *args], capture_output=True,
                          text=True, env=_env(), timeout=300)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == 2, out
    assert message in out, out


def test_quickstart_leaves_no_scratch_root_behind(tmp_path, monkeypatch):
    """Without STUBCACHE_DIR the quickstart uses a scratch root and removes it at exit."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in _env(TMPDIR=str(tmp)).items() if k != "STUBCACHE_DIR"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py")], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cold:" in proc.stdout and "warm:" in proc.stdout and "(removed at exit)" in proc.stdout
    assert list(tmp.iterdir()) == []


VERIFY_REBUILD = """
import sys
from stubcache.cli import main
sys.exit(main(["verify", "--rebuild"]))
"""


def test_verify_rebuild_shows_progress_on_a_terminal_only(tmp_path, cache_root, cxx, monkeypatch):
    """A rebuild that lasts past the status line's 2 s mark says which entry it rebuilds, on a
    terminal; into a pipe the output is only the report."""
    stubcache.StubCache().get_or_build(stubcache.StubSpec("slow_verify", 'extern "C" int f(void) { return 1; }'))
    monkeypatch.setenv("STUBCACHE_TEST_CXX_SLEEP", "3.5")
    text = run_on_pty(VERIFY_REBUILD, _env())
    assert "verify --rebuild: rebuilding" in text and "(1 of 1)" in text, text
    piped = subprocess.run([sys.executable, "-c", VERIFY_REBUILD], capture_output=True, text=True, env=_env(),
                           timeout=120)
    assert piped.returncode == 0, piped.stdout + piped.stderr
    assert "rebuilding" not in piped.stdout + piped.stderr
