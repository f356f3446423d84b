"""Every GPU test runs in its own process.

One illegal address poisons the CUDA context for the rest of the process, so a test that runs
after a broken one in the same process can fail (or pass) for the wrong reason. When a GPU
test is about to run, this hook runs it again, alone, in a fresh ``python -m pytest``, and
reports that run's outcome. ``scripts/run_gpu_tests.sh`` already starts one process per test
and sets ``KVARENA_GPU_ISOLATED=1`` so that nothing is run twice.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ISOLATED = "KVARENA_GPU_ISOLATED"
TIMEOUT = float(os.environ.get("KVARENA_GPU_TEST_TIMEOUT", "300"))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    if os.environ.get(ISOLATED) == "1":
        return None  # we are the isolated child: run the test here
    basetemp = tempfile.mkdtemp(prefix="kvarena-gpu-")
    env = dict(os.environ, **{ISOLATED: "1"})
    # a test still running shortly before the timeout prints every thread's stack: a hang says where
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--basetemp={basetemp}/t",
           "-o", f"faulthandler_timeout={max(TIMEOUT - 5, 1):.0f}", pyfuncitem.nodeid]
    hung = None
    try:
        proc = subprocess.run(cmd, cwd=str(pyfuncitem.config.rootpath), env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:  # its output comes as bytes, whatever text= said
        hung = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                       for x in (exc.stdout, exc.stderr))
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)
    if hung is not None:
        pytest.fail(f"{pyfuncitem.nodeid} did not finish in {TIMEOUT:.0f} s in its own process:\n{hung[-8000:]}",
                    pytrace=False)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0 and re.search(r"\b1 passed\b", out):
        return True
    if proc.returncode == 0 and re.search(r"\b1 skipped\b", out):
        m = re.search(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", out)
        pytest.skip(m.group(1) if m else "skipped in its own process")
    why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    pytest.fail(f"{why} in its own process ({pyfuncitem.nodeid}):\n{out[-8000:]}", pytrace=False)
