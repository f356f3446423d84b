"""A fresh-process hit of two source trees side by side, each installed as a wheel in its own venv.

    python benchmarks/compare_fresh_hit.py BEFORE_TREE [AFTER_TREE] [--runs 20] [--work DIR]

AFTER_TREE defaults to this checkout. For each tree: build its wheel into a scratch venv
(``_wheel.py``), warm a private root with the arena stub, then run interleaved fresh processes —
the floor (``python -c`` + ``ctypes.CDLL`` of that root's library), ``import stubcache`` alone,
and a whole hit (``import stubcache`` + ``StubSpec`` + ``StubCache().load``) — and report medians
of wall time and of CPU time (user + system of the child, which a loaded machine disturbs less),
each as a ratio to that tree's floor; the first in-process hit (``get_or_build`` + ``load_entry``
timed inside a fresh process after the import); repeated calls in one process; and ``python -X
importtime -c 'import stubcache'``'s cumulative figure (median) with the heaviest modules.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from _common import REPO, STUB_NAME, arena_source  # noqa: E402
from _wheel import clean_env, make_wheel_env  # noqa: E402

HIT = ("import sys, stubcache; spec = stubcache.StubSpec(sys.argv[1], open(sys.argv[2]).read(), "
       "is_python_module=False, no_implicit_headers=True, with_cuda=False); stubcache.StubCache().load(spec)")
FLOOR = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
# The first in-process hit: get_or_build + load_entry timed inside a fresh process, after the import.
FIRST = ("import sys, time, stubcache; spec = stubcache.StubSpec(sys.argv[1], open(sys.argv[2]).read(), "
         "is_python_module=False, no_implicit_headers=True, with_cuda=False); c = stubcache.StubCache(); "
         "t0 = time.perf_counter(); e = c.get_or_build(spec); t1 = time.perf_counter(); c.load_entry(e); "
         "t2 = time.perf_counter(); print(t2 - t0, t1 - t0, t2 - t1)")
# Repeated calls in one process (2,000 each): get_or_build of one spec, load of one spec, load of
# a new StubSpec each call.
REPEAT = r"""
import sys, time, stubcache
src = open(sys.argv[2]).read(); kw = dict(is_python_module=False, no_implicit_headers=True, with_cuda=False)
c = stubcache.StubCache(); spec = stubcache.StubSpec(sys.argv[1], src, **kw); c.load(spec)
pc, n, out = time.perf_counter, 2000, []
for fn in (lambda: c.get_or_build(spec), lambda: c.load(spec),
           lambda: c.load(stubcache.StubSpec(sys.argv[1], src, **kw))):
    t = pc()
    for _ in range(n):
        fn()
    out.append((pc() - t) / n)
print(*out)
"""
IMPORT_RE = re.compile(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|\s*(\S+)")


def _child(cmd: list[str], env: dict, cwd: str) -> tuple[float, float, str]:
    """(wall, cpu) seconds of one child process, and its output."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=cwd, check=True, stdout=subprocess.PIPE, text=True).stdout
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), out


def _importtime(py: str, env: dict, cwd: str, runs: int) -> tuple[float, list]:
    totals, top = [], []
    for _ in range(runs):
        err = subprocess.run([py, "-X", "importtime", "-c", "import stubcache"], env=env, cwd=cwd, check=True,
                             stderr=subprocess.PIPE, text=True).stderr
        mods = [(m.group(3), int(m.group(1)), int(m.group(2))) for m in map(IMPORT_RE.match, err.splitlines()) if m]
        totals.append(next(cum for name, _s, cum in mods if name == "stubcache"))
        top = sorted(((n, s) for n, s, _c in mods), key=lambda x: -x[1])[:10]
    return statistics.median(totals) / 1e6, top


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path, nargs="?", default=REPO)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="stubcache-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "stub.cpp"
    src.write_text(arena_source())
    trees = {}
    for tag, tree in (("before", args.before), ("after", args.after)):
        inst = make_wheel_env(work / tag, tree.resolve())
        root = work / tag / "root"
        root.mkdir(mode=0o700)
        env = clean_env({"STUBCACHE_DIR": str(root)})
        subprocess.run([inst.python, "-c", HIT, STUB_NAME, str(src)], env=env, cwd=inst.cwd, check=True)
        lib = glob.glob(str(root / "**" / f"{STUB_NAME}.so"), recursive=True)[0]
        env["STUBCACHE_REQUIRE_HIT"] = "1"
        trees[tag] = (inst, env, {
            "floor": [inst.python, "-c", FLOOR, lib],
            "import stubcache": [inst.python, "-c", "import stubcache"],
            "hit": [inst.python, "-c", HIT, STUB_NAME, str(src)],
        })
        print(f"{tag}: {tree} -> {inst.note}", flush=True)
    samples: dict = {(t, c): ([], []) for t, (_i, _e, cmds) in trees.items() for c in cmds}
    first: dict = {t: [] for t in trees}
    for i in range(args.runs + 2):  # two warm-up rounds, then interleaved
        for tag, (inst, env, cmds) in trees.items():
            for case, cmd in cmds.items():
                wall, cpu, _out = _child(cmd, env, inst.cwd)
                if i >= 2:
                    samples[(tag, case)][0].append(wall)
                    samples[(tag, case)][1].append(cpu)
            out = _child([inst.python, "-c", FIRST, STUB_NAME, str(src)], env, inst.cwd)[2]
            if i >= 2:
                first[tag].append([float(x) for x in out.split()[-3:]])
    print(f"\nload average {os.getloadavg()[0]:.2f}; medians of {args.runs} interleaved runs\n")
    print("| tree | case | wall | ratio to floor | CPU | ratio to floor |\n|---|---|---|---|---|---|")
    for tag, (inst, env, cmds) in trees.items():
        fw = statistics.median(samples[(tag, "floor")][0])
        fc = statistics.median(samples[(tag, "floor")][1])
        for case in cmds:
            w = statistics.median(samples[(tag, case)][0])
            c = statistics.median(samples[(tag, case)][1])
            print(f"| {tag} | {case} | {w * 1e3:.1f} ms | {w / fw:.2f}× | {c * 1e3:.1f} ms | {c / fc:.2f}× |")
    print()
    for tag, xs in first.items():
        print(f"{tag}: first in-process hit after the import, median (min): " + ", ".join(
            f"{name} {statistics.median(col) * 1e3:.3f} ms ({min(col) * 1e3:.3f})"
            for name, col in zip(("get_or_build + load_entry", "get_or_build", "load_entry"), zip(*xs))))
    repeat: dict = {t: [] for t in trees}
    for _ in range(5):
        for tag, (inst, env, _cmds) in trees.items():
            out = _child([inst.python, "-c", REPEAT, STUB_NAME, str(src)], env, inst.cwd)[2]
            repeat[tag].append([float(x) for x in out.split()[-3:]])
    for tag, xs in repeat.items():
        print(f"{tag}: repeated calls, 5 processes × 2,000 calls, median (min): " + ", ".join(
            f"{name} {statistics.median(col) * 1e6:.1f} µs ({min(col) * 1e6:.1f})"
            for name, col in zip(("get_or_build", "load", "load of a new StubSpec"), zip(*xs))))
    print()
    for tag, (inst, env, _cmds) in trees.items():
        total, top = _importtime(inst.python, env, inst.cwd, min(args.runs, 11))
        print(f"{tag}: python -X importtime -c 'import stubcache': {total * 1e3:.1f} ms cumulative (median); "
              "heaviest (self, last run): " + ", ".join(f"{n} {s / 1e3:.2f} ms" for n, s in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
