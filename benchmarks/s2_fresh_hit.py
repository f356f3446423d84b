"""Scenario 2: warm hit in a fresh process (wall time of a whole ``python -c``).

The stubcache children and their floor run the checkout installed as a wheel in a scratch venv
(``_wheel.py``), as users install it; the same hit in the editable set-up is reported beside it.

stubcache (``import stubcache`` + spec + get_or_build + dlopen, no torch import; run with
``STUBCACHE_REQUIRE_HIT=1`` so a miss would fail) and kvarena's ``load_stub()`` against torch's
``load_inline`` on a warm build directory and the floor ``python -c 'import ctypes; ctypes.CDLL(path)'``.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import time

from _common import PY, STUB_NAME, Ctx, child_env, fmt_time, ratio, row, run_json, spec_kwargs, target, wall
from _wheel import child_env_for
from s1_cold_build import STUBCACHE_CHILD, TORCH_CHILD

# The spec's options are written into the code (not parsed from JSON): the child imports only
# what a user's hit does.
SC_HIT = ("import sys, stubcache; spec = stubcache.StubSpec(sys.argv[2], open(sys.argv[1]).read(), "
          f"**{spec_kwargs()!r}); stubcache.StubCache().load(spec)")
KVARENA_HIT = "import kvarena.stub; kvarena.stub.load_stub()"
FLOOR = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
LOOKUP = ("import json, stubcache, sys; c = stubcache.StubCache(sys.argv[1]); "
          "print(json.dumps(c.lookup(stubcache.StubSpec(sys.argv[3], open(sys.argv[2]).read(), "
          "**json.loads(sys.argv[4]))).path))")
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
    reps = ctx.reps(10, 20)  # interleaved, cheap (~30 ms each): enough to see through a noisy machine
    reps_torch = ctx.reps(2, 5)
    kw = json.dumps(spec_kwargs())
    inst = ctx.installed()  # the fresh-process children run the wheel, as users install it
    root = ctx.fresh_dir("s2-root")
    # Built by the venv's own Python: its fingerprint (no torch there) is the one its hits compute.
    entry = run_json(STUBCACHE_CHILD, [ctx.source_file, root, STUB_NAME, kw], env=child_env_for(inst),
                     python=inst.python, cwd=inst.cwd)
    run_json("import kvarena.stub, json; kvarena.stub.load_stub(); print(json.dumps(1))",
             env=child_env_for(inst, STUBCACHE_DIR=str(root)), python=inst.python, cwd=inst.cwd)
    lib = run_json(LOOKUP, [root, ctx.source_file, STUB_NAME, kw], env=child_env_for(inst), python=inst.python,
                   cwd=inst.cwd)
    # The same hit from this Python with the checkout on PYTHONPATH (the editable set-up the
    # figures before issue 13 came from), for reference: its own root, its own fingerprint.
    ed_root = ctx.fresh_dir("s2-root-editable")
    run_json(STUBCACHE_CHILD, [ctx.source_file, ed_root, STUB_NAME, kw])
    ed_lib = run_json(LOOKUP, [ed_root, ctx.source_file, STUB_NAME, kw])
    tdir = ctx.fresh_dir("s2-torch")
    run_json(TORCH_CHILD, [ctx.source_file, tdir, STUB_NAME, "1"])
    hit_env = child_env_for(inst, STUBCACHE_DIR=str(root), STUBCACHE_REQUIRE_HIT="1")
    plain_env = child_env_for(inst)
    ed_env = child_env(STUBCACHE_DIR=str(ed_root), STUBCACHE_REQUIRE_HIT="1")
    vpy = inst.python
    where = inst.label
    # (command, env, cwd): the wheel's children run outside the checkout (`python -c` puts the
    # working directory first on sys.path, which would import the checkout instead of the wheel)
    cmds = {
        f"python -c pass (interpreter alone; {where})": ([vpy, "-c", "pass"], plain_env),
        f"floor: python + ctypes.CDLL(path) ({where})": ([vpy, "-c", FLOOR, lib], plain_env),
        f"import stubcache alone ({where})": ([vpy, "-c", "import stubcache"], hit_env),
        f"stubcache: import + get_or_build + dlopen ({where})": ([vpy, "-c", SC_HIT, ctx.source_file, STUB_NAME],
                                                                 hit_env),
        f"kvarena.stub.load_stub() (stubcache client; {where})": ([vpy, "-c", KVARENA_HIT], hit_env),
        "floor: python + ctypes.CDLL(path) (editable set-up)": ([PY, "-c", FLOOR, ed_lib], None),
        "stubcache: import + get_or_build + dlopen (editable set-up)": (
            [PY, "-c", SC_HIT, ctx.source_file, STUB_NAME], ed_env),
    }
    samples: dict[str, list[float]] = {k: [] for k in cmds}
    cpu: dict[str, list[float]] = {k: [] for k in cmds}  # user + system time of the child
    torch_wall: list[float] = []
    torch_call: list[float] = []
    torch_import: list[float] = []
    for i in range(reps + 1):
        for label, (cmd, env) in cmds.items():
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            dt = wall([str(c) for c in cmd], env=env, cwd=inst.cwd if cmd[0] == vpy else None)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            if i:  # the first round warms the page cache and writes any missing bytecode
                samples[label].append(dt)
                cpu[label].append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
        if 0 < i <= reps_torch:
            t0 = time.perf_counter()
            out = subprocess.run([PY, "-c", TORCH_WARM, str(ctx.source_file), STUB_NAME, str(tdir)], env=child_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=True).stdout
            torch_wall.append(time.perf_counter() - t0)
            d = json.loads(out.strip().splitlines()[-1])
            torch_call.append(d["load_inline"])
            torch_import.append(d["import"])
    rows = [row("fresh-process hit", k, v) for k, v in samples.items()]
    rows += [row("fresh-process hit, CPU time (user + system)", k, v) for k, v in cpu.items() if "editable" not in k]
    rows.append(row("fresh-process hit", "torch load_inline, warm build dir (whole process)", torch_wall))
    rows.append(row("fresh-process hit (in-process part)", "torch: import torch.utils.cpp_extension", torch_import))
    rows.append(row("fresh-process hit (in-process part)", "torch: load_inline call after import", torch_call))
    med = {r["approach"]: r["median"] for r in rows if "CPU" not in r["case"]}
    cpu_floor = statistics.median(cpu[f"floor: python + ctypes.CDLL(path) ({where})"])
    cpu_sc = statistics.median(cpu[f"stubcache: import + get_or_build + dlopen ({where})"])
    floor = med[f"floor: python + ctypes.CDLL(path) ({where})"]
    sc = med[f"stubcache: import + get_or_build + dlopen ({where})"]
    imp = med[f"import stubcache alone ({where})"]
    py = med[f"python -c pass (interpreter alone; {where})"]
    ed_floor = med["floor: python + ctypes.CDLL(path) (editable set-up)"]
    ed_sc = med["stubcache: import + get_or_build + dlopen (editable set-up)"]
    tw = med["torch load_inline, warm build dir (whole process)"]
    r = ratio(sc, floor)
    note = "" if inst.wheel else "measured in the FALLBACK set-up, not a wheel install"
    targets = [
        target(f"warm hit in a fresh process ≤ 1.5× python+dlopen floor ({where})",
               f"{r:.2f}× ({fmt_time(sc)} vs {fmt_time(floor)})", "≤ 1.5×", r is not None and r <= 1.5, note),
        target(f"torch-free process: a fresh `python -c` hit ≤ 2× the python+dlopen floor ({where})",
               f"{r:.2f}× ({fmt_time(sc)} vs {fmt_time(floor)})", "≤ 2×", r is not None and r <= 2, note,
               headline="5"),
    ]
    notes = [
        f"Fresh-process children: {inst.note}.",
        f"In CPU time (user + system of the child, which a loaded machine disturbs less than wall "
        f"time): hit {fmt_time(cpu_sc)} vs floor {fmt_time(cpu_floor)}, {ratio(cpu_sc, cpu_floor):.2f}×.",
        f"Above the bare interpreter ({fmt_time(py)}): floor +{fmt_time(floor - py)}, `import stubcache` "
        f"+{fmt_time(imp - py)}, stubcache hit +{fmt_time(sc - py)}; torch's warm load_inline process is "
        f"{ratio(tw, sc):.0f}× the stubcache one (mostly `import torch`).",
        f"Editable set-up (this Python, checkout on PYTHONPATH, its site-packages and their start-up "
        f"files): floor {fmt_time(ed_floor)}, hit {fmt_time(ed_sc)}, {ratio(ed_sc, ed_floor):.2f}× — the "
        "figure the benchmarks reported before issue 13.",
        f"The stubcache entry was built once (key {entry['key'][:12]}, {entry['method']} path); every hit child "
        "ran with STUBCACHE_REQUIRE_HIT=1.",
    ]
    return {"id": 2, "title": "Warm hit in a fresh process", "rows": rows, "targets": targets, "notes": notes}
