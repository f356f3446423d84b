"""No descriptor leaks on the paths that fail: the suite runs with ResourceWarning as an error
(pyproject's filterwarnings), and these check the known cases in a fresh process, where the
warning would otherwise be printed at exit and lost."""

from __future__ import annotations

from .conftest import run_py


def test_a_failed_direct_build_leaks_no_pipe(cache_root):
    """The include search-path probe runs beside the compile; when the compile fails it is
    killed, and its pipe must be closed too (it used to leak: ResourceWarning: unclosed file)."""
    proc = run_py("""
        import gc, stubcache
        for i in range(3):
            try:
                stubcache.StubCache().get_or_build(stubcache.StubSpec(f"broken{i}", "int f( {\\n"))
            except stubcache.BuildError:
                pass
            else:
                raise SystemExit("the build should have failed")
        gc.collect()
        print("done")
        """, env={"PYTHONWARNINGS": "error::ResourceWarning", "PYTHONDEVMODE": "1"}, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("done"), proc.stderr
    assert "ResourceWarning" not in proc.stderr and "unclosed" not in proc.stderr, proc.stderr
