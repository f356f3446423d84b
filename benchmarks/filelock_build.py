"""What taking the build lock through ``filelock`` costs a cold build (issue 21 item 10; the
decision in docs/cache.md, "Locks and atomic writes"). Not a scenario of ``run.py``: a one-off
measurement, kept to be rerun.

    python benchmarks/filelock_build.py [RUNS] [--torch]

Each run is a fresh process that builds a new header-free stub (a unique source: a miss) in an
existing root whose toolchain memos are warm, timed from just before ``StubCache().load`` to its
return. Two variants, interleaved so the machine's load hits both alike: **as shipped** (the miss
imports filelock for the build lock) and **filelock preloaded** (imported before the clock
starts: the same build without filelock's import, i.e. what raw ``flock`` cost). ``--torch``
imports torch and ``torch.utils.cpp_extension`` first, as an engine does (torch 2.14's
cpp_extension already imports filelock; 2.13's does not). Prints medians and the ratio; asserts
nothing.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = textwrap.dedent("""
    import os, resource, sys, time
    if os.environ["BENCH_TORCH"] == "1":
        import torch, torch.utils.cpp_extension
    if os.environ["BENCH_PRELOAD"] == "1":
        import filelock
    preloaded = "filelock" in sys.modules
    def cpu():
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime
    c0 = cpu()
    t0 = time.perf_counter()
    import stubcache
    n = int(os.environ["BENCH_N"])
    lib = stubcache.StubCache().load(stubcache.StubSpec(f"flb{n}", f'extern "C" int v(void) {{ return {n}; }}'))
    t1 = time.perf_counter()
    c1 = cpu()
    assert lib.v() == n
    print(f"{(t1 - t0) * 1e3:.3f} {(c1 - c0) * 1e3:.3f} {int(preloaded)}")
""")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    runs = int(args[0]) if args else 15
    torch = "--torch" in sys.argv
    with tempfile.TemporaryDirectory(prefix="stubcache-flb-") as root:
        env = dict(os.environ, STUBCACHE_DIR=root, PYTHONPATH=REPO, BENCH_TORCH="1" if torch else "0")
        env.pop("STUBCACHE_REQUIRE_HIT", None)

        def one(n: int, preload: bool) -> tuple[float, float, bool]:
            out = subprocess.run([sys.executable, "-c", CHILD], env=dict(env, BENCH_N=str(n),
                                 BENCH_PRELOAD="1" if preload else "0"),
                                 capture_output=True, text=True, check=True).stdout.split()
            return float(out[0]), float(out[1]), out[2] == "1"

        one(0, False)  # warm the root's toolchain memos: every timed run is a miss in an existing root
        wall: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        already = False
        load0 = os.getloadavg()[0]
        for i in range(runs):
            for preload in (False, True):
                ms, cpu_ms, had = one(1 + 2 * i + preload, preload)
                wall[preload].append(ms)
                cpu[preload].append(cpu_ms)
                already |= had and not preload
    where = "after import torch + torch.utils.cpp_extension" if torch else "bare python"
    print(f"cold build of a header-free stub in an existing root, {where}, medians of {runs} "
          f"(load average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end):")
    for label, data in (("wall", wall), ("CPU (process + compiler children)", cpu)):
        shipped, pre = statistics.median(data[False]), statistics.median(data[True])
        print(f"  {label}: as shipped (the miss imports filelock) {shipped:.1f} ms, "
              f"filelock preloaded (raw flock's cost) {pre:.1f} ms, ratio {shipped / pre:.3f}x")
    if already:
        print("  note: filelock was already imported before the build (torch imported it)")


if __name__ == "__main__":
    main()
