"""What the post-build load check (stubcache.build.loadcheck) adds to a build.

Runs the check on a freshly built lean stub N times, in this process, beside one bare
``c++ -shared -fPIC`` build of the same source, and reports both and their ratio.
``--torch`` imports torch first (a spawn from a torch process costs more).

    python benchmarks/loadcheck_cost.py [--torch] [N]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--torch"]
    if "--torch" in sys.argv:
        import torch  # noqa: F401
    n = int(args[0]) if args else 20
    from stubcache.build import loadcheck

    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "s.cpp"), os.path.join(d, "s.so")
        with open(src, "w") as fh:
            fh.write('extern "C" int value(void) { return 1; }\n')
        builds, checks = [], []
        for _ in range(n):
            t = time.perf_counter()
            subprocess.run(["c++", "-shared", "-fPIC", src, "-o", lib], check=True)
            builds.append(time.perf_counter() - t)
            t = time.perf_counter()
            loadcheck.check_loads(lib, "s")
            checks.append(time.perf_counter() - t)
    b, c = statistics.median(builds), statistics.median(checks)
    print(f"bare build {b * 1e3:.1f} ms, load check {c * 1e3:.1f} ms (medians of {n}): "
          f"the check adds {c / b:.1%} to a lean direct build")


if __name__ == "__main__":
    main()
