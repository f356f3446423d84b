"""The GPU test harness itself, on a machine without a GPU: every GPU test in its own process
(tests/gpu/conftest.py), and scripts/run_gpu_tests.sh from a copied tree without platformdirs.

The GPU tests themselves only run on a GPU host (``bash scripts/run_gpu_tests.sh``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

_TESTS = """
import os, signal
import pytest

def _note(name):
    with open(os.environ["KVA_PIDS"], "a") as fh:
        fh.write(f"{name} {os.getpid()}\\n")

def test_1_crashes():
    _note("crash")
    os.kill(os.getpid(), signal.SIGSEGV)  # what an illegal address does to the rest of a process

def test_2_runs_after_the_crash():
    _note("after")

def test_3_skips():
    pytest.skip("not on this host")

def test_4_fails():
    assert 1 == 2, "really fails"

def test_5_hangs():
    import time
    print("hung here", flush=True)
    time.sleep(60)
"""


def test_each_gpu_test_runs_in_its_own_process(tmp_path):
    d = tmp_path / "gpu"
    d.mkdir()
    shutil.copy(REPO / "tests" / "gpu" / "conftest.py", d / "conftest.py")
    (d / "test_iso.py").write_text(textwrap.dedent(_TESTS))
    pids = tmp_path / "pids"
    env = {k: v for k, v in os.environ.items() if k != "KVARENA_GPU_ISOLATED"}
    env.update(KVA_PIDS=str(pids), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", KVARENA_GPU_TEST_TIMEOUT="8")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(d)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert re.search(r"_ test_1_crashes _+\nkilled by signal 11 in its own process", out), out
    assert re.search(r"_ test_4_fails _+\nexit 1 in its own process.*really fails", out, re.S), out
    assert re.search(r"PASSED .*test_2_runs_after_the_crash", out), out
    assert re.search(r"SKIPPED \[1\] .*not on this host", out), out
    assert re.search(r"_ test_5_hangs _+\n\S+ did not finish in 8 s in its own process:\n(.*\n)*Timeout.*\n"
                     r"(.*\n)*.*line \d+ in test_5_hangs\n", out), out  # the stack where it hung
    assert "3 failed, 1 passed, 1 skipped" in out
    noted = dict(line.split() for line in pids.read_text().splitlines())
    assert set(noted) == {"crash", "after"} and noted["crash"] != noted["after"]
    assert proc.returncode == 1


def _copy_tree(dst: Path) -> None:
    for name in ("kvarena", "stubcache", "tests", "scripts"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")


@pytest.mark.torch  # the script checks that torch imports before it runs anything
def test_gpu_script_from_a_copied_tree_without_platformdirs(tmp_path):
    tree = tmp_path / "tree"
    _copy_tree(tree)
    gpu_tests = tree / "tests" / "gpu" / "test_kvarena_cuda.py"  # torch's warnings name C++ scopes
    gpu_tests.write_text(gpu_tests.read_text() + "\nimport warnings\nwarnings.warn('Triggered internally at "
                         "c10::cuda::device_count')\n")
    hide = tmp_path / "hide" / "platformdirs"  # the GPU host has no platformdirs
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ImportError('no platformdirs on this host')\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STUBCACHE_", "KVARENA_"))}
    env.update(PYTHONPATH=str(hide.parent), TMPDIR=str(scratch), PYTHON=sys.executable,
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # platformdirs' own pytest plugin is installed here

    proc = subprocess.run(["bash", "scripts/run_gpu_tests.sh"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "absent   platformdirs" in proc.stdout
    assert "ok       import stubcache, kvarena" in proc.stdout
    assert re.search(r"^ok +allocator stub +built via direct .*platformdirs imported: False", proc.stdout, re.M)
    assert re.search(r"^MISSING  |^torch sees no CUDA GPU", proc.stdout, re.M), proc.stdout

    env["KVARENA_ALLOW_SKIP"] = "1"
    proc = subprocess.run(["bash", "scripts/run_gpu_tests.sh", "-k", "demo_on_cuda or slot_reuse"], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = [ln for ln in out.splitlines() if re.match(r"(PASS|FAIL|SKIP|TIMEOUT) ", ln)]
    assert len(lines) == 2, out
    assert all(re.match(r"SKIP +tests/gpu/test_kvarena_cuda\.py::test_\w+ +[\d.]+s +needs a CUDA GPU", ln)
               for ln in lines), out
    assert "== 2 GPU tests: 0 passed, 0 failed, 2 skipped" in out
    assert list(scratch.iterdir()) == []  # its temporary directories are gone
    assert not (tree / ".pytest_cache").exists()
    assert not list(tree.rglob("__pycache__"))

    proc = subprocess.run(["bash", "scripts/run_gpu_tests.sh", "--bogus"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument" in proc.stderr
