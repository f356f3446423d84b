"""The CLI's output pinned byte for byte: ``ls``, ``stats`` and a few other commands in every
format, against a synthetic root at a frozen clock.

The expected files under ``tests/golden/cli/`` were written by the CLI as it was before
``stubcache/cli.py`` became a package, so a change in how a command renders its output fails
here. After an intended output change, rewrite them with ``STUBCACHE_WRITE_GOLDEN=1`` and review
the diff like any other change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stubcache.storage.store import Store
from _synthetic import fake_entry  # benchmarks/_synthetic.py, on sys.path by conftest

from .conftest import run_py

GOLDEN = Path(__file__).resolve().parent / "golden" / "cli"
NOW = 1_750_000_000.0
DAY = 86400.0

CASES: dict[str, list[str]] = {
    "ls.table": ["ls"],
    "ls.verbose": ["ls", "-v", "--sort", "size"],
    "ls.quiet": ["ls", "-q", "--sort", "name", "--reverse"],
    "ls.no-probe": ["ls", "--no-probe", "--filter", "size>20K"],
    "ls.json": ["ls", "--format", "json"],
    "ls.csv": ["ls", "--format", "csv"],
    "ls.bad-filter": ["ls", "--filter", "colour=red"],
    "stats.table": ["stats"],
    "stats.json": ["stats", "--format", "json"],
    "stats.prometheus": ["stats", "--format", "prometheus"],
    "prune.dry-run": ["prune", "--dry-run", "--older-than", "30d"],
    "prune.dry-run.json": ["prune", "--dry-run", "--older-than", "30d", "--format", "json"],
    "verify.dry-run": ["verify", "--dry-run", "-v"],
    "verify.dry-run.json": ["verify", "--dry-run", "--format", "json"],
    "explain.key": ["explain", "{key_a}"],
    "explain.key.json": ["explain", "{key_a}", "--format", "json"],
    "explain.two": ["explain", "{key_a}", "{key_b}"],
    "config": ["config"],
    "config.json": ["config", "--format", "json"],
    "dir": ["dir"],
    "dir.json": ["dir", "--format", "json"],
}

CHILD = """
import io, json, sys, time
time.time = lambda: {now!r}  # the clock every age and "ago" is computed from
from stubcache.cli import main
out = {{}}
for name, argv in {cases!r}.items():
    so, se = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = so, se
    try:
        rc = main(["--cache-dir", {root!r}, *argv])
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    out[name] = {{"rc": rc, "stdout": so.getvalue(), "stderr": se.getvalue()}}
print(json.dumps(out))
"""

EVENTS = [
    {"t": NOW - 5 * DAY, "ev": "miss", "key": "{key_a}"},
    {"t": NOW - 5 * DAY + 1, "ev": "build", "key": "{key_a}", "s": 1.25},
    {"t": NOW - 4 * DAY, "ev": "hit", "key": "{key_a}"},
    {"t": NOW - 3 * DAY, "ev": "hit", "key": "{key_a}"},
    {"t": NOW - 3 * DAY, "ev": "hit", "key": "{key_b}"},
    {"t": NOW - 2 * DAY, "ev": "wait", "key": "{key_b}", "s": 0.5},
    {"t": NOW - 2 * DAY, "ev": "fail", "key": "ffff"},
    {"t": NOW - 2 * DAY, "ev": "quarantine", "key": "eeee"},
    {"t": NOW - 2 * DAY, "ev": "lock_timeout", "key": "dddd", "s": 600.0},
    {"t": NOW - 2 * DAY, "ev": "private_build", "key": "dddd", "s": 2.0},
    {"t": NOW - DAY, "ev": "remote_hit", "key": "{key_b}", "s": 0.125, "bytes": 65536},
    {"t": NOW - DAY, "ev": "remote_miss", "key": "cccc"},
    {"t": NOW - DAY, "ev": "upload", "key": "{key_a}", "bytes": 16384},
    {"t": NOW - DAY, "ev": "lease_wait", "key": "cccc", "s": 3.5, "outcome": "takeover"},
    {"t": NOW - 3600, "ev": "remote_error", "key": "cccc"},
]


def _fixture(root: Path) -> dict[str, str]:
    """Three entries (one with an unreadable manifest), one finished event file, one quarantined item."""
    store = Store(str(root))
    store.ensure()
    keys = {
        "key_a": fake_entry(store, "alloc", 16 * 1024, created=NOW - 40.5 * DAY, last_used=NOW - 10.2 * DAY),
        "key_b": fake_entry(store, "launcher", 64 * 1024, created=NOW - 3 * 3600 - 300, last_used=NOW - 90),
        "key_c": fake_entry(store, "shim", 1 << 20, created=NOW - 100 * DAY, last_used=NOW - 45 * DAY),
    }
    broken = fake_entry(store, "broken", 4096, created=NOW - 2 * DAY, last_used=NOW - 2 * DAY)
    manifest = Path(store.entry_dir(broken)) / "manifest.json"
    os.chmod(manifest.parent, 0o700)
    manifest.unlink()
    os.chmod(manifest.parent, 0o555)
    os.utime(manifest.parent, (NOW - 2 * DAY, NOW - 2 * DAY))  # its "created" without a manifest
    events = Path(store.path("events"))
    events.mkdir(exist_ok=True)
    lines = [json.dumps({k: (v.format(**keys) if isinstance(v, str) else v) for k, v in e.items()},
                        separators=(",", ":")) for e in EVENTS]
    (events / "golden-1-000000000000.jsonl").write_text("\n".join(lines) + "\n{torn\n")
    quarantine = Path(store.path("quarantine"))
    quarantine.mkdir(exist_ok=True)
    (quarantine / "0123abcd.x").mkdir()
    return keys


def _run_all(root: Path, keys: dict[str, str]) -> dict[str, dict]:
    cases = {name: [a.format(**keys) for a in argv] for name, argv in CASES.items()}
    env = {"TZ": "UTC", "COLUMNS": "100"}
    code = CHILD.format(now=NOW, cases=cases, root=str(root))
    out = json.loads(run_py("import time; time.tzset()\n" + code, env=env).stdout)
    for res in out.values():
        for stream in ("stdout", "stderr"):
            res[stream] = res[stream].replace(str(root), "<ROOT>")
    return out


def _render(res: dict) -> str:
    return f"exit {res['rc']}\n--- stdout\n{res['stdout']}--- stderr\n{res['stderr']}"


def test_output_matches_golden(tmp_path, monkeypatch):
    for name in list(os.environ):
        if name.startswith(("STUBCACHE_REMOTE", "STUBCACHE_MAX_SIZE")):
            monkeypatch.delenv(name)
    root = tmp_path / "root"
    keys = _fixture(root)
    results = _run_all(root, keys)
    if os.environ.get("STUBCACHE_WRITE_GOLDEN") == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, res in results.items():
            (GOLDEN / f"{name}.txt").write_text(_render(res))
        pytest.skip("golden files rewritten")
    mismatched = [name for name, res in results.items()
                  if _render(res) != (GOLDEN / f"{name}.txt").read_text()]
    for name in mismatched:
        print(f"=== {name}: got\n{_render(results[name])}")
    assert not mismatched, f"output drifted from tests/golden/cli/: {mismatched}"


def test_help_epilog_matches_golden():
    """``stubcache --help``: the environment variables and exit codes, verbatim (the option list
    above them is argparse's own formatting, which changes between Python versions)."""
    proc = run_py("import sys; from stubcache.cli import main; main(['--help'])", check=False)
    epilog = proc.stdout[proc.stdout.index("environment:"):]
    path = GOLDEN / "help.epilog.txt"
    if os.environ.get("STUBCACHE_WRITE_GOLDEN") == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(epilog)
        pytest.skip("golden file rewritten")
    assert epilog == path.read_text()
