"""Scenario 3: warm hit inside a process, first and repeated calls.

Each mode runs in its own fresh process (after its imports; stubcache's from the checkout's
wheel in a scratch venv, see ``_wheel.py``): stubcache's API
(``StubCache.get_or_build`` + ``load_entry``), stubcache's ``load_inline`` drop-in (a new spec per
call, like code that calls ``load_inline`` where it needs the stub), and torch's ``load_inline``
on a warm build directory.
"""

from __future__ import annotations

import json

from _common import STUB_NAME, Ctx, fmt_time, row, run_json, spec_kwargs, target
from _wheel import child_env_for
from s1_cold_build import STUBCACHE_CHILD, TORCH_CHILD

CHILD = r"""
import json, sys, time
mode, src_file, name, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
src = open(src_file).read()
pc = time.perf_counter
out = {}
if mode in ("api", "api_ctypes"):
    import stubcache
    if mode == "api_ctypes":
        import ctypes  # any torch process has it imported already
    spec = stubcache.StubSpec(name, src, **json.loads(sys.argv[5]))
    cache = stubcache.StubCache()
    t0 = pc(); entry = cache.get_or_build(spec); cache.load_entry(entry); out["first"] = pc() - t0
    t0 = pc()
    for _ in range(n): cache.get_or_build(spec)
    out["repeat_get_or_build"] = (pc() - t0) / n
    t0 = pc()
    for _ in range(n): cache.load(spec)
    out["repeat_load"] = (pc() - t0) / n
    t0 = pc()
    for _ in range(n): cache.load(stubcache.StubSpec(name, src, **json.loads(sys.argv[5])))
    out["repeat_load_new_spec"] = (pc() - t0) / n
elif mode == "dropin":
    import stubcache
    t0 = pc(); stubcache.load_inline(name, src, is_python_module=False, no_implicit_headers=True)
    out["first"] = pc() - t0
    t0 = pc()
    for _ in range(n): stubcache.load_inline(name, src, is_python_module=False, no_implicit_headers=True)
    out["repeat"] = (pc() - t0) / n
else:
    import torch.utils.cpp_extension as ce
    kw = dict(build_directory=sys.argv[5], is_python_module=False, no_implicit_headers=True)
    t0 = pc(); ce.load_inline(name, src, **kw); out["first"] = pc() - t0
    t0 = pc()
    for _ in range(n): ce.load_inline(name, src, **kw)
    out["repeat"] = (pc() - t0) / n
print(json.dumps(out))
"""


def run(ctx: Ctx) -> dict:
    reps = ctx.reps(3, 7)
    reps_torch = ctx.reps(1, 3)
    kw = json.dumps(spec_kwargs())
    inst = ctx.installed()  # stubcache's children run the wheel, as users install it (torch's: this Python)
    wheel = dict(python=inst.python, cwd=inst.cwd)
    root = ctx.fresh_dir("s3-root")
    run_json(STUBCACHE_CHILD, [ctx.source_file, root, STUB_NAME, kw], env=child_env_for(inst), **wheel)
    tdir = ctx.fresh_dir("s3-torch")
    run_json(TORCH_CHILD, [ctx.source_file, tdir, STUB_NAME, "1"])
    env = child_env_for(inst, STUBCACHE_DIR=str(root), STUBCACHE_REQUIRE_HIT="1")
    keys = {"api_ctypes": ["first"], "api": ["first", "repeat_get_or_build", "repeat_load", "repeat_load_new_spec"],
            "dropin": ["first", "repeat"], "torch": ["first", "repeat"]}
    data: dict[str, dict[str, list]] = {m: {k: [] for k in ks} for m, ks in keys.items()}
    for i in range(reps):
        d = run_json(CHILD, ["api", ctx.source_file, STUB_NAME, 2000, kw], env=env, **wheel)
        for k in keys["api"]:
            data["api"][k].append(d[k])
        d = run_json(CHILD, ["api_ctypes", ctx.source_file, STUB_NAME, 1, kw], env=env, **wheel)
        data["api_ctypes"]["first"].append(d["first"])
        d = run_json(CHILD, ["dropin", ctx.source_file, STUB_NAME, 500], env=env, **wheel)
        for k in keys["dropin"]:
            data["dropin"][k].append(d[k])
        if i < reps_torch:
            d = run_json(CHILD, ["torch", ctx.source_file, STUB_NAME, 20, tdir])
            for k in keys["torch"]:
                data["torch"][k].append(d[k])
    rows = [
        row("first call", "stubcache get_or_build + load_entry", data["api"]["first"]),
        row("first call", "stubcache get_or_build + load_entry, ctypes already imported", data["api_ctypes"]["first"]),
        row("first call", "stubcache.load_inline drop-in", data["dropin"]["first"]),
        row("first call", "torch load_inline (warm dir, torch imported)", data["torch"]["first"]),
        row("repeated call", "stubcache get_or_build (same spec object)", data["api"]["repeat_get_or_build"]),
        row("repeated call", "stubcache load (get_or_build + CDLL)", data["api"]["repeat_load"]),
        row("repeated call", "stubcache load, new StubSpec each call", data["api"]["repeat_load_new_spec"]),
        row("repeated call", "stubcache.load_inline drop-in", data["dropin"]["repeat"]),
        row("repeated call", "torch load_inline (warm dir)", data["torch"]["repeat"]),
    ]
    first = rows[0]["median"]
    first_ct = rows[1]["median"]
    rep = rows[4]["median"]
    rep_load = rows[5]["median"]
    dropin = rows[7]["median"]
    targets = [
        target("in-process hit, first call ≤ 1 ms", f"{fmt_time(first)} ({fmt_time(first_ct)} with ctypes already "
               "imported)", "≤ 1 ms", first <= 1e-3,
               "get_or_build + load_entry in a fresh process after `import stubcache`"),
        target("in-process hit, repeated ≤ 20 µs", f"{fmt_time(rep)} (get_or_build), {fmt_time(rep_load)} (load), "
               f"{fmt_time(dropin)} (load_inline drop-in)", "≤ 20 µs", rep <= 20e-6 and rep_load <= 20e-6,
               f"get_or_build {'meets' if rep <= 20e-6 else 'misses'} it, load (get_or_build + CDLL) "
               f"{'meets' if rep_load <= 20e-6 else 'misses'} it; the drop-in (new spec per call) "
               f"{'meets' if dropin <= 20e-6 else 'misses'} it and is reported, not judged"),
    ]
    torch_rep = rows[8]["median"]
    notes = [f"stubcache's children: {inst.note}.",
             f"torch's warm load_inline repeated call costs {fmt_time(torch_rep)} ({torch_rep / rep:.0f}× stubcache's "
             "repeated get_or_build): each call re-hashes the sources, takes torch's file baton in the build "
             "directory and reloads the library."]
    return {"id": 3, "title": "Warm hit inside a process", "rows": rows, "targets": targets, "notes": notes}
