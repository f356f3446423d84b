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
