"""Every setting validated in one place (issue 20 items 1, 2, 6, 8, 9): real CLI processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REMOTE = "redis://127.0.0.1:1/0"  # a well-formed URL nothing listens on: the remote settings below are checked first
BAD = [("STUBCACHE_LOCK_TIMEOUT", "abc"), ("STUBCACHE_LOCK_TIMEOUT", "-1"), ("STUBCACHE_MAX_SIZE", "lots"),
       ("STUBCACHE_MAX_SIZE", "10"), ("STUBCACHE_REQUIRE_HIT", "maybe"), ("STUBCACHE_REMOTE_INSECURE", "perhaps"),
       ("STUBCACHE_REMOTE", "ftp://host/0"), ("STUBCACHE_REMOTE", "redis://127.0.0.1:notaport/0"),
       ("STUBCACHE_REMOTE_MODE", "sometimes"), ("STUBCACHE_REMOTE_TIMEOUT", "abc"), ("STUBCACHE_REMOTE_TIMEOUT", "0"),
       ("STUBCACHE_REMOTE_LEASE", "-3"), ("STUBCACHE_REMOTE_SECRET", "short")]
# every command, and the options that read a setting
COMMANDS = [["ls"], ["ls", "--remote"], ["stats"], ["stats", "--format", "prometheus"], ["stats", "--reset"],
            ["prune", "-n"], ["prune", "--remote", "--max-age", "1d", "-n"], ["verify"], ["verify", "--rebuild"],
            ["clear", "-n"], ["rm", "abcd", "-n"], ["config"], ["config", "set", "max_size", "1G"], ["explain", "x"],
            ["warm", "x.json"], ["init"], ["dir"], ["run", "--env"], ["run", "--", "true"]]


def _env_for(name, value):
    """The malformed setting, with a well-formed STUBCACHE_REMOTE where it is a remote one."""
    remote = {"STUBCACHE_REMOTE": REMOTE} if name.startswith("STUBCACHE_REMOTE_") else {}
    return {**remote, name: value}


def cli(args, tmp_path, **env):
    e = {**os.environ, "PYTHONPATH": ROOT, "STUBCACHE_DIR": str(tmp_path / "root"), **env}
    return subprocess.run([sys.executable, "-m", "stubcache", *args], env=e, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("name,value", BAD)
def test_bad_setting_is_one_line_exit_2_in_every_command(tmp_path, name, value):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:  # each ends at the start-up check: cheap processes
        procs = list(pool.map(lambda args: cli(args, tmp_path, **_env_for(name, value)), COMMANDS))
    for args, proc in zip(COMMANDS, procs):
        assert "Traceback" not in proc.stderr + proc.stdout, (args, proc.stderr)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and name in lines[0], (args, proc.stderr)
        assert repr(value) in lines[0] or name == "STUBCACHE_REMOTE_SECRET", (args, proc.stderr)  # never echo a secret
        assert proc.stdout == "", (args, proc.stdout)


@pytest.mark.parametrize("name,value", BAD)
def test_doctor_reports_every_malformed_setting(tmp_path, name, value):
    proc = cli(["doctor"], tmp_path, **_env_for(name, value))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "[error]" in proc.stdout and name in proc.stdout, proc.stdout


def test_doctor_reports_several_malformed_settings_at_once(tmp_path):
    proc = cli(["doctor"], tmp_path, STUBCACHE_LOCK_TIMEOUT="abc", STUBCACHE_MAX_SIZE="lots")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "STUBCACHE_LOCK_TIMEOUT='abc'" in proc.stdout and "STUBCACHE_MAX_SIZE='lots'" in proc.stdout


# what a person can type on the command line: a one-line error and exit 2, never a traceback
BAD_ARGS = [["prune", "--max-size", "lots"], ["prune", "--max-size", "-5G"], ["prune", "--older-than", "14"],
            ["prune", "--quarantine-age", "soon"], ["prune", "--remote", "--max-age", "old", "--remote-url", REMOTE],
            ["prune", "--max-age", "1d"], ["ls", "--filter", "size>lots"], ["ls", "--filter", "colour=red"],
            ["ls", "--remote", "--remote-url", "ftp://x"], ["ls", "--remote", "--remote-url", REMOTE,
                                                           "--remote-timeout", "abc"],
            ["verify", "--rebuild", "--sample", "0"], ["verify", "abcd"], ["verify", "--rebuild", "zz"],
            ["explain", "zz"], ["explain", "abcd"], ["explain", "a.json", "b.json", "c.json"], ["rm", "../etc"],
            ["rm"], ["rm", "0123"], ["warm", "nosuch.json"], ["warm", "nosuch_module_xyz:spec"],
            ["config", "set", "nope", "1"], ["config", "set", "max_size", "lots"],
            ["config", "set", "toolchain_max_age", "14"], ["init", "--group", "x"], ["init", "--shared"],
            ["stats", "--reset", "--format", "prometheus"], ["run"], ["doctor", "--remote-url", "ftp://x"]]


def test_malformed_arguments_are_one_line_exit_2(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cli(["init"], tmp_path)
    with ThreadPoolExecutor(4) as pool:
        procs = list(pool.map(lambda args: cli(args, tmp_path), BAD_ARGS))
    for args, proc in zip(BAD_ARGS, procs):
        assert "Traceback" not in proc.stderr + proc.stdout, (args, proc.stderr)
        if args[0] == "doctor":  # doctor reports a bad remote URL as one of its checks
            assert proc.returncode == 1 and "[error] remote" in proc.stdout, (args, proc.stdout)
            continue
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)


def test_library_refuses_bad_lock_timeout_when_made(tmp_path):
    code = ("import stubcache\ntry:\n    stubcache.StubCache(%r)\nexcept stubcache.StubCacheError as e:\n"
            "    print(type(e).__name__, e)\n") % str(tmp_path / "r")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT,
                          STUBCACHE_LOCK_TIMEOUT="abc"), capture_output=True, text=True, timeout=60)
    assert proc.stdout.startswith("SettingsError STUBCACHE_LOCK_TIMEOUT='abc'"), proc.stdout + proc.stderr


def test_lock_timeout_accepts_seconds_and_units(tmp_path):
    from stubcache.edge.settings import lock_timeout

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


@pytest.mark.parametrize("name,value", [("max_size", "lots"), ("max_size", -5), ("toolchain_max_age", "14"),
                                        ("toolchain_max_age", [1])])
def test_malformed_root_config_setting_is_reported_never_a_traceback(tmp_path, name, value):
    """A value written into ``stubcache-root.json`` by hand: every command carries on with the
    default (saying so where it reads it), and doctor reports it as an error."""
    import json

    assert cli(["init"], tmp_path).returncode == 0
    cfg = tmp_path / "root" / "stubcache-root.json"
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), **{name: value})))
    for args in (["ls"], ["stats", "--format", "prometheus"], ["prune", "-n"], ["config"], ["clear", "-n"]):
        proc = cli(args, tmp_path)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (args, proc.stderr)
    doctor = cli(["doctor"], tmp_path)
    assert doctor.returncode == 1 and f"[error] root config: {name} in" in doctor.stdout, doctor.stdout


def test_one_module_owns_every_variable_and_the_docs_show_its_table():
    """stubcache/edge/settings.py names every STUBCACHE_* variable the package reads; --help and
    docs/cli.md's table are rendered from its rows; the compact hit path's list of variables that
    send a hit to the full path is its list."""
    import re
    from pathlib import Path

    from stubcache.edge import settings
    from stubcache import hit

    repo = Path(__file__).resolve().parent.parent
    read = set()
    for f in (repo / "stubcache").rglob("*.py"):
        read |= set(re.findall(r"STUBCACHE_[A-Z][A-Z_]*[A-Z]", f.read_text(encoding="utf-8")))
    variables = {v.name for v in settings.VARIABLES}
    assert read - {"STUBCACHE_REMOTE_"} == variables
    shown = {n for row in settings.ROWS for n in row.names}
    assert variables - shown == {settings.FAULT} and shown - variables == {"CXX"}  # FAULT: the crash tests'
    full = {v.name.encode() for v in settings.VARIABLES if v.full_path}
    assert set(hit.FULL_PATH_SETTINGS) | {n for n in full if n.startswith(hit.FULL_PATH_PREFIX)} == full
    assert {v.name for v in settings.VARIABLES if v.name.startswith(settings.REMOTE)} <= {n.decode() for n in full}
    doc = repo / "docs" / "cli.md"
    text = doc.read_text()
    start = text.index("| variable | effect |")
    end = text.index("\n\n", start)
    if os.environ.get("STUBCACHE_WRITE_DOCS") == "1":
        doc.write_text(text[:start] + settings.doc_table() + text[end:])
    else:
        assert text[start:end] == settings.doc_table(), "regenerate: STUBCACHE_WRITE_DOCS=1 python -m pytest " \
            "tests/test_settings.py -k docs_show"
