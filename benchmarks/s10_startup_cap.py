"""Scenario 10: what issue 11's features cost where nobody asked for them.

* ``python -c pass`` with no start-up hook (every Python process outside ``stubcache run``:
  the package ships no ``.pth`` or ``sitecustomize``, so being installed adds nothing), with the
  hook's directory on ``PYTHONPATH`` but ``STUBCACHE_PATCH_TORCH`` unset, and with the hook active
  (what each process under ``stubcache run`` pays before it imports torch).
* A herd of N processes starting at once on a cold stub, with no size cap, with a cap that is not
  reached, and with a cap the herd's publish exceeds (the publishing process then prunes, after
  releasing its lock; the waiters load as soon as the entry is published).
"""

from __future__ import annotations

import json
import subprocess
import textwrap

from _common import BENCH, PY, STUB_NAME, Ctx, child_env, fmt_time, ratio, row, spec_kwargs, target, variant_source, wall

FILL = textwrap.dedent("""
    import sys, stubcache
    c = stubcache.StubCache(sys.argv[1])
    for i in range(int(sys.argv[2])):
        c.get_or_build(stubcache.StubSpec("fill%d" % i, 'extern "C" int fill(void) { return %d; }' % i))
""")


def _startup(ctx: Ctx) -> list[dict]:
    from stubcache.admin.run import BOOT_DIR

    reps = ctx.reps(10, 40)
    base = child_env()
    cases = {
        "no hook (installed or not)": base,
        "hook on PYTHONPATH, variable unset": dict(base, PYTHONPATH=BOOT_DIR + ":" + base["PYTHONPATH"]),
        "hook active (under stubcache run)": dict(base, PYTHONPATH=BOOT_DIR + ":" + base["PYTHONPATH"],
                                                  STUBCACHE_PATCH_TORCH="1"),
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):  # interleaved, so drift in machine load hits every case alike
        for label, env in cases.items():
            samples[label].append(wall([PY, "-c", "pass"], env=env))
    return [row("python -c pass", label, xs) for label, xs in samples.items()]


def _herd(ctx: Ctx, n: int, cap: str | None, fill: int) -> dict:
    root = ctx.fresh_dir("cap-root")
    env = child_env(CXX=str(ctx.cxx.path), BENCH_CXX_LOG=str(ctx.work / "fill.log"))
    if fill:
        subprocess.run([PY, "-c", FILL, str(root), str(fill)], env=env, check=True, timeout=600)
    if cap:
        env["STUBCACHE_MAX_SIZE"] = cap
    cfg = {"mode": "stubcache", "name": STUB_NAME, "sources": {"0": variant_source(0)}, "kw": spec_kwargs(),
           "runs": [{"n": n, "root": str(root), "log": str(ctx.fresh_dir("log") / "cxx.log")}]}
    path = ctx.work / f"cap-{ctx.fresh_dir('cfg').name}.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run([PY, str(BENCH / "_herd.py"), str(path)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"herd launcher failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])[0]
    res["entries_after"] = len(list((root / "v1" / "entries").iterdir()))
    return res


def run(ctx: Ctx) -> dict:
    rows = _startup(ctx)
    n = 4 if ctx.quick else 16
    fill = 6
    reps = ctx.reps(2, 5)
    cases = {"no cap": ("off", fill), "cap set, not reached": ("1G", fill),
             "cap exceeded by the publish": ("60K", fill)}
    data: dict[str, list[dict]] = {k: [] for k in cases}
    for rep in range(reps):
        for label, (cap, f) in cases.items():
            ctx.log(f"s10: herd of {n}, {label}, repetition {rep + 1}/{reps}")
            data[label].append(_herd(ctx, n, cap, f))
    for label, results in data.items():
        rows.append(row(f"herd N={n}", label, [r["all_loaded"] for r in results],
                        compiles=[r["compiles"] for r in results], entries_after=[r["entries_after"] for r in results],
                        errors=sum(len(r["errors"]) for r in results)))
    none = next(r for r in rows if r["approach"] == "no hook (installed or not)")
    active = next(r for r in rows if r["approach"] == "hook active (under stubcache run)")
    present = next(r for r in rows if r["approach"] == "hook on PYTHONPATH, variable unset")
    h0 = next(r for r in rows if r["approach"] == "no cap")
    h1 = next(r for r in rows if r["approach"] == "cap set, not reached")
    h2 = next(r for r in rows if r["approach"] == "cap exceeded by the publish")
    targets = [
        target("python -c pass: no start-up cost without the hook", "the package installs no start-up file",
               "0", True),
        target(f"herd of {n}: start-up unchanged with a cap set",
               f"{ratio(h1['median'], h0['median']):.2f}× (cap not reached), "
               f"{ratio(h2['median'], h0['median']):.2f}× (cap exceeded)", "≈ 1×", None,
               "reported, not judged: a few ms either way is within this machine's run-to-run spread"),
    ]
    notes = [
        f"python -c pass: {fmt_time(none['median'])} without the hook, {fmt_time(present['median'])} with "
        f"the hook's directory on PYTHONPATH and the variable unset, {fmt_time(active['median'])} with the "
        "hook active (it installs an import finder; torch and stubcache are imported only when the program "
        "imports torch.utils.cpp_extension).",
        f"herd of {n} (cold stub, root pre-filled with {fill} entries): no cap {fmt_time(h0['median'])}, "
        f"cap set but not reached {fmt_time(h1['median'])}, cap exceeded {fmt_time(h2['median'])} "
        f"(entries left after the prune: {h2['extra']['entries_after']}).",
    ]
    return {"id": 10, "title": "Start-up hook and size cap: cost when unused", "rows": rows, "targets": targets,
            "notes": notes}
