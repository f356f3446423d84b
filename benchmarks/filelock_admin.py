"""Does ``filelock`` earn its place in the admin commands? (The decision in docs/cache.md,
"Locks and atomic writes".) Not a scenario of ``run.py``: a one-off measurement, kept to be rerun.

    PYTHONDONTWRITEBYTECODE= python benchmarks/filelock_admin.py [RUNS]

Builds a root of 20 lean stubs in a temporary directory, then runs, interleaved so that the
machine's load hits every variant alike: ``python -c pass``, ``python -c "import filelock"``,
``stubcache verify`` as shipped (raw ``flock``) and ``stubcache verify`` with filelock imported
first (the least that using filelock there would cost). Reports wall time and CPU time (user +
system of the child, less sensitive to a loaded machine) and ``-X importtime``'s figure for
filelock. Asserts nothing.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 31
    root = tempfile.mkdtemp(prefix="stubcache-bench-filelock-")
    env = dict(os.environ, STUBCACHE_DIR=root, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if env.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set; import times are inflated (set it empty)")
    try:
        subprocess.run([sys.executable, "-c", textwrap.dedent("""
            from stubcache import StubCache, StubSpec
            c = StubCache()
            for v in range(20):
                c.load(StubSpec("m%d" % v, 'extern "C" int f(void) { return %d; }' % v))
            """)], env=env, check=True)

        def cpu() -> float:
            r = resource.getrusage(resource.RUSAGE_CHILDREN)
            return r.ru_utime + r.ru_stime

        def run(cmd: list[str]) -> tuple[float, float, str]:
            c0, t0 = cpu(), time.perf_counter()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall, used = time.perf_counter() - t0, cpu() - c0
            if p.returncode != 0:
                raise SystemExit(f"{cmd} failed: {p.stderr}")
            return wall, used, p.stderr

        py = sys.executable
        verify_with = ("import filelock, runpy, sys; sys.argv = ['stubcache', 'verify']; "
                       "runpy.run_module('stubcache', run_name='__main__', alter_sys=True)")
        cmds = {
            "python -c pass": [py, "-c", "pass"],
            "python -c 'import filelock'": [py, "-c", "import filelock"],
            "stubcache verify (raw flock, as shipped)": [py, "-m", "stubcache", "verify"],
            "stubcache verify + import filelock": [py, "-c", verify_with],
        }
        for cmd in cmds.values():
            for _ in range(2):
                run(cmd)  # warm: bytecode caches written, files in the page cache
        wall: dict[str, list[float]] = {k: [] for k in cmds}
        used: dict[str, list[float]] = {k: [] for k in cmds}
        imp = []
        for _ in range(runs):
            for k, cmd in cmds.items():
                w, u, _ = run(cmd)
                wall[k].append(w)
                used[k].append(u)
            err = run([py, "-X", "importtime", "-c", "import filelock"])[2]
            imp.append(int(re.search(r"\|\s+(\d+) \| filelock$", err, re.M).group(1)) / 1e6)
        ms = lambda v: f"{statistics.median(v) * 1e3:7.1f} ms (min {min(v) * 1e3:.1f})"  # noqa: E731
        print(f"{runs} interleaved runs; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"  {'':42s} {'wall, median':>22s} | {'CPU, median':>22s}")
        for k in cmds:
            print(f"  {k:42s} {ms(wall[k])} | {ms(used[k])}")
        print(f"  {'-X importtime, filelock (cumulative)':42s} {ms(imp)}")
        a, b = (statistics.median(used[k]) for k in list(cmds)[2:])
        print(f"  verify with filelock / as shipped, CPU: {b / a:.2f}x (+{(b - a) * 1e3:.1f} ms)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
