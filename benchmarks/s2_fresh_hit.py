"""Scenario 2: warm hit in a fresh process (wall time of a whole ``python -c``).

stubcache (``import stubcache`` + spec + get_or_build + dlopen, no torch import; run with
``STUBCACHE_REQUIRE_HIT=1`` so a miss would fail) and kvarena's ``load_stub()`` against torch's
``load_inline`` on a warm build directory and the floor ``python -c 'import ctypes; ctypes.CDLL(path)'``.
"""

from __future__ import annotations

import json
import subprocess
import time

from _common import (PY, STUB_NAME, Ctx, child_env, find, fmt_time, ratio, row, run_json, spec_kwargs,
                     target, wall)
from s1_cold_build import STUBCACHE_CHILD, TORCH_CHILD

SC_HIT = ("import sys, json, stubcache; spec = stubcache.StubSpec(sys.argv[2], open(sys.argv[1]).read(), "
          "**json.loads(sys.argv[3])); stubcache.StubCache().load(spec)")
KVARENA_HIT = "import kvarena.stub; kvarena.stub.load_stub()"
FLOOR = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
TORCH_WARM = r"""
import sys, time, json
t0 = time.perf_counter()
import torch.utils.cpp_extension as ce
t1 = time.perf_counter()
ce.load_inline(sys.argv[2], open(sys.argv[1]).read(), build_directory=sys.argv[3], is_python_module=False,
               no_implicit_headers=True)
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load_inline": t2 - t1}))
"""


def run(ctx: Ctx) -> dict:
    reps = ctx.reps(5, 20)
    reps_torch = ctx.reps(2, 5)
    root = ctx.fresh_dir("s2-root")
    kw = json.dumps(spec_kwargs())
    entry = run_json(STUBCACHE_CHILD, [ctx.source_file, root, STUB_NAME, kw])
    run_json("import kvarena.stub, json; kvarena.stub.load_stub(); print(json.dumps(1))",
             env=child_env(STUBCACHE_DIR=str(root)))
    lib = run_json("import json, stubcache, sys; c = stubcache.StubCache(sys.argv[1]); "
                   "print(json.dumps(c.lookup(stubcache.StubSpec(sys.argv[3], open(sys.argv[2]).read(), "
                   "**json.loads(sys.argv[4]))).path))", [root, ctx.source_file, STUB_NAME, kw])
    tdir = ctx.fresh_dir("s2-torch")
    run_json(TORCH_CHILD, [ctx.source_file, tdir, STUB_NAME, "1"])
    hit_env = child_env(STUBCACHE_DIR=str(root), STUBCACHE_REQUIRE_HIT="1")
    cmds = {
        "python -c pass (interpreter alone)": ([PY, "-c", "pass"], None),
        "floor: python + ctypes.CDLL(path)": ([PY, "-c", FLOOR, lib], None),
        "stubcache: import + get_or_build + dlopen": ([PY, "-c", SC_HIT, ctx.source_file, STUB_NAME, kw], hit_env),
        "kvarena.stub.load_stub() (stubcache client)": ([PY, "-c", KVARENA_HIT], hit_env),
    }
    samples: dict[str, list[float]] = {k: [] for k in cmds}
    torch_wall: list[float] = []
    torch_call: list[float] = []
    torch_import: list[float] = []
    for i in range(reps):
        for label, (cmd, env) in cmds.items():
            samples[label].append(wall([str(c) for c in cmd], env=env))
        if i < reps_torch:
            t0 = time.perf_counter()
            out = subprocess.run([PY, "-c", TORCH_WARM, str(ctx.source_file), STUB_NAME, str(tdir)], env=child_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=True).stdout
            torch_wall.append(time.perf_counter() - t0)
            d = json.loads(out.strip().splitlines()[-1])
            torch_call.append(d["load_inline"])
            torch_import.append(d["import"])
    rows = [row("fresh-process hit", k, v) for k, v in samples.items()]
    rows.append(row("fresh-process hit", "torch load_inline, warm build dir (whole process)", torch_wall))
    rows.append(row("fresh-process hit (in-process part)", "torch: import torch.utils.cpp_extension", torch_import))
    rows.append(row("fresh-process hit (in-process part)", "torch: load_inline call after import", torch_call))
    floor = find(rows, approach="floor: python + ctypes.CDLL(path)")["median"]
    sc = find(rows, approach="stubcache: import + get_or_build + dlopen")["median"]
    py = find(rows, approach="python -c pass (interpreter alone)")["median"]
    tw = find(rows, approach="torch load_inline, warm build dir (whole process)")["median"]
    r = ratio(sc, floor)
    targets = [target("warm hit in a fresh process ≤ 2× python+dlopen floor",
                      f"{r:.2f}× ({fmt_time(sc)} vs {fmt_time(floor)})", "≤ 2×", r is not None and r <= 2)]
    notes = [
        f"Above the bare interpreter ({fmt_time(py)}): floor +{fmt_time(floor - py)}, stubcache "
        f"+{fmt_time(sc - py)}; torch's warm load_inline process is {ratio(tw, sc):.0f}× the stubcache one "
        "(mostly `import torch`).",
        f"The stubcache entry was built once (key {entry['key'][:12]}, {entry['method']} path); every hit child "
        "ran with STUBCACHE_REQUIRE_HIT=1.",
    ]
    return {"id": 2, "title": "Warm hit in a fresh process", "rows": rows, "targets": targets, "notes": notes}
