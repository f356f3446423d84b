"""Every setting validated in one place (issue 20 items 1, 2, 6, 8, 9): real CLI processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD = [("STUBCACHE_LOCK_TIMEOUT", "abc"), ("STUBCACHE_LOCK_TIMEOUT", "-1"), ("STUBCACHE_MAX_SIZE", "lots"),
       ("STUBCACHE_MAX_SIZE", "10"), ("STUBCACHE_REQUIRE_HIT", "maybe")]
COMMANDS = [["ls"], ["stats"], ["stats", "--format", "prometheus"], ["prune", "-n"], ["verify"], ["clear", "-n"],
            ["config"], ["explain", "x"], ["init"]]


def cli(args, tmp_path, **env):
    e = {**os.environ, "PYTHONPATH": ROOT, "STUBCACHE_DIR": str(tmp_path / "root"), **env}
    return subprocess.run([sys.executable, "-m", "stubcache", *args], env=e, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("name,value", BAD)
def test_bad_setting_is_one_line_exit_2_in_every_command(tmp_path, name, value):
    for args in COMMANDS:
        proc = cli(args, tmp_path, **{name: value})
        assert "Traceback" not in proc.stderr, (args, proc.stderr)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and name in lines[0] and repr(value) in lines[0], (args, proc.stderr)


def test_doctor_reports_every_malformed_setting(tmp_path):
    proc = cli(["doctor"], tmp_path, STUBCACHE_LOCK_TIMEOUT="abc", STUBCACHE_MAX_SIZE="lots")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "STUBCACHE_LOCK_TIMEOUT='abc'" in proc.stdout and "STUBCACHE_MAX_SIZE='lots'" in proc.stdout


def test_library_refuses_bad_lock_timeout_when_made(tmp_path):
    code = ("import stubcache\ntry:\n    stubcache.StubCache(%r)\nexcept stubcache.StubCacheError as e:\n"
            "    print(type(e).__name__, e)\n") % str(tmp_path / "r")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT,
                          STUBCACHE_LOCK_TIMEOUT="abc"), capture_output=True, text=True, timeout=60)
    assert proc.stdout.startswith("SettingsError STUBCACHE_LOCK_TIMEOUT='abc'"), proc.stdout + proc.stderr


def test_lock_timeout_accepts_seconds_and_units(tmp_path):
    from stubcache.settings import lock_timeout

    assert lock_timeout({"STUBCACHE_LOCK_TIMEOUT": "5"}) == 5.0
    assert lock_timeout({"STUBCACHE_LOCK_TIMEOUT": "10m"}) == 600.0
    assert lock_timeout({}) == 600.0


@pytest.mark.parametrize("args", [["prune", "-n", "--older-than", "14"]])
def test_duration_without_unit_refused(tmp_path, args):
    proc = cli(args, tmp_path)
    assert proc.returncode == 2 and "give a unit" in proc.stderr and "Traceback" not in proc.stderr
    cli(["init"], tmp_path)
    proc = cli(["config", "set", "toolchain_max_age", "14"], tmp_path)
    assert proc.returncode != 0 and "give a unit" in proc.stderr


def test_root_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("")
    for args in (["ls"], ["stats"], ["init"]):
        proc = cli(args, tmp_path, STUBCACHE_DIR=str(f))
        assert proc.returncode == 1 and "is a file, not a directory" in proc.stderr, (args, proc.stderr)
    proc = cli(["doctor"], tmp_path, STUBCACHE_DIR=str(f))
    assert proc.returncode == 1 and "is a file, not a directory" in proc.stdout
    assert "stubcache init" not in proc.stdout


def test_broken_pipe_is_quiet(tmp_path):
    e = dict(os.environ, PYTHONPATH=ROOT, STUBCACHE_DIR=str(tmp_path / "root"))
    proc = subprocess.run(f"{sys.executable} -m stubcache --help | head -c 1 >/dev/null; "
                          "echo ${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash", env=e,
                          capture_output=True, text=True, timeout=60)
    assert "Broken pipe" not in proc.stderr and "Traceback" not in proc.stderr


def test_version_and_run_env(tmp_path):
    proc = cli(["--version"], tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("stubcache ")
    proc = cli(["--cache-dir", str(tmp_path / "x"), "run", "--env"], tmp_path)
    assert f"STUBCACHE_DIR={tmp_path / 'x'}" in proc.stdout
