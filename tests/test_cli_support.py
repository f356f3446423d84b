"""Helpers shared by the CLI, prune and stats tests (not a test module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def stub_source(value: int) -> str:
    """A lean header-free stub (direct build path, ~0.1 s) whose ``stub_value()`` returns value."""
    return f'extern "C" int stub_value(void) {{ return {value}; }}\n'


def run_cli(root: Path, *args: str, env: dict | None = None, stdin: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m stubcache --cache-dir ROOT ARGS...`` in a fresh process."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "stubcache", "--cache-dir", str(root), *args],
                          env=full_env, capture_output=True, text=True, timeout=timeout,
                          input=stdin if stdin is not None else "")


def cli_json(root: Path, *args: str, env: dict | None = None, ok=(0,)):
    proc = run_cli(root, *args, "--format", "json", env=env)
    assert proc.returncode in ok, (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


BUILD_SNIPPET = """
    import sys
    from stubcache import StubCache, StubSpec
    c = StubCache(sys.argv[1] if len(sys.argv) > 1 else None)
    for value in {values!r}:
        spec = StubSpec("stub%d" % value, 'extern "C" int stub_value(void) {{ return %d; }}\\n' % value)
        lib = c.load(spec)
        assert lib.stub_value() == value
        print(c.get_or_build(spec).key)
"""


def build_real(values, run_py) -> list[str]:
    """Build (and load) real direct stubs in a child process; returns their keys."""
    proc = run_py(textwrap.dedent(BUILD_SNIPPET.format(values=list(values))))
    return proc.stdout.split()


def tree_snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root with its type, size, mode and mtime."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size if not os.path.isdir(p) else 0,
                                             st.st_mtime_ns)
    return out
