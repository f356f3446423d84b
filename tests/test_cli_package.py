"""The CLI package's wiring: the console script's entry point, and that a command imports only
its own group's module (start-up time of read-only commands)."""

from __future__ import annotations

import re

from .conftest import REPO, run_py


def test_console_script_entry_point_is_main():
    text = (REPO / "pyproject.toml").read_text()
    target = re.search(r'^\[project\.scripts\]\s*\nstubcache\s*=\s*"([^"]+)"', text, re.M).group(1)
    assert target == "stubcache.cli:main"
    module, attr = target.split(":")
    out = run_py(f"import {module}, stubcache.cli.dispatch as d; print(getattr({module}, {attr!r}) is d.main)")
    assert out.stdout.strip() == "True"


def test_each_command_imports_only_its_group(tmp_path):
    code = f"""
        import sys
        from stubcache.cli import main
        groups = ("inspect", "maintain", "build", "remote")
        loaded = lambda: sorted(g for g in groups if "stubcache.cli." + g in sys.modules)
        assert loaded() == [], loaded()
        assert main(["--cache-dir", {str(tmp_path)!r}, "dir"]) == 0
        assert loaded() == ["inspect"], loaded()
        assert main(["--cache-dir", {str(tmp_path)!r}, "ls"]) == 0
        assert loaded() == ["inspect"], loaded()
        assert main(["--cache-dir", {str(tmp_path)!r}, "prune", "--dry-run"]) == 0
        assert loaded() == ["inspect", "maintain"], loaded()
        assert "torch" not in sys.modules and "csv" not in sys.modules
        print("ok")
    """
    assert run_py(code).stdout.strip().endswith("ok")


def test_warnings_reach_stderr_as_bare_lines_and_quiet_silences_them(tmp_path):
    """The logger is set up only when something is logged (``stubcache.edge.log``), with the same
    effect as setting it up at start: bare lines on stderr, ``-q`` keeps only errors."""
    import json
    import subprocess
    import sys

    from .test_cli_support import run_cli

    root = tmp_path / "root"
    assert run_cli(root, "init").returncode == 0
    cfg = root / "stubcache-root.json"
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), max_size="lots")))
    proc = run_cli(root, "config")
    assert proc.returncode == 0
    assert proc.stderr == (f"ignoring max_size in the configuration of {root}: bad size 'lots': "
                           "use a number with a K, M, G or T suffix (e.g. 2G); or 'off' for no cap\n")
    quiet = run_cli(root, "config", "-q")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == proc.stdout
    code = ("import sys, stubcache; before = 'logging' in sys.modules; from stubcache.cli import main; "
            "rc = main(['--cache-dir', sys.argv[1], 'dir']); print(rc, before or 'logging' not in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True).stdout
    assert out.split()[-2:] == ["0", "True"]  # a command that logs nothing does not import logging
