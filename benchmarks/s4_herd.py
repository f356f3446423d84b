"""Scenario 4: a herd of N processes started at once, all needing the same (cold) stub.

Compiler invocations (counted by a CXX wrapper) and wall time from the release of the herd until
the last process has the library loaded, for stubcache, one private build directory per process
(SGLang's pattern), and one shared torch build directory. Every approach runs in engine
processes (the launcher imports ``torch.utils.cpp_extension`` before the fork), as target 3
states them; a torch-free stubcache herd is a diagnostic. A "mixed" herd (same stub name, two
source variants alternating, like two engine versions on one host) counts processes that loaded
a library built from the other variant.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from _common import BENCH, PY, STUB_NAME, Ctx, child_env, fmt_time, ratio, row, spec_kwargs, target, variant_source

APPROACHES = {
    "stubcache": "stubcache",
    "private": "private dir per process (SGLang)",
    "shared": "shared torch build dir",
}
# Diagnostics (not in the figure, torch-free processes): where a stubcache herd's extra time goes.
DIAG = {
    "torchfree": "stubcache, torch-free processes (diagnostic)",
    "existing": "stubcache, torch-free, root already exists (diagnostic)",
    "preloaded": "stubcache, torch-free, root exists + filelock/builder imported before fork (diagnostic)",
}
LAZY_IMPORTS = ["filelock", "stubcache.build.builder", "stubcache.storage.locking", "subprocess", "sysconfig", "ctypes"]
WARMUP = ("import sys, stubcache; stubcache.StubCache(sys.argv[1]).get_or_build("
          "stubcache.StubSpec('bench_warmup', 'extern \"C\" int bench_warmup(void) { return 1; }'))")


def launch(ctx: Ctx, cfg: dict, tag: str) -> list[dict]:
    path = ctx.work / f"{tag}.json"
    path.write_text(json.dumps(cfg))
    env = child_env(CXX=str(ctx.cxx.path))
    proc = subprocess.run([PY, str(BENCH / "_herd.py"), str(path)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"herd launcher failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def new_run(ctx: Ctx, mode: str, n: int, variants: list[int] | None = None, **extra) -> dict:
    run = {"n": n, "log": str(ctx.fresh_dir("log") / "cxx.log"), **extra}
    if variants:
        run["variants"] = variants
    if mode == "stubcache":
        run["root"] = str(ctx.fresh_dir("herd-root"))
    elif mode == "private":
        run["base"] = str(ctx.fresh_dir("herd-private"))
    else:
        run["dir"] = str(ctx.fresh_dir("herd-shared"))
    return run


def existing_root(ctx: Ctx) -> str:
    """A cache root that already holds another stub (compiler probed, sub-directories made)."""
    root = ctx.fresh_dir("herd-root")
    subprocess.run([PY, "-c", WARMUP, str(root)], check=True,
                   env=child_env(CXX=str(ctx.cxx.path), BENCH_CXX_LOG=str(ctx.work / "warmup.log")))
    return str(root)


def run(ctx: Ctx) -> dict:
    ns = [1, 2, 4] if ctx.quick else [1, 2, 4, 8, 16]
    mixed_ns = [4] if ctx.quick else [4, 16]
    reps = ctx.reps(1, 5)
    sources = {"0": variant_source(0), "1": variant_source(1)}
    base_cfg = {"name": STUB_NAME, "sources": sources, "kw": spec_kwargs()}
    data: dict[tuple[str, str], list[dict]] = {}
    for rep in range(reps):
        for mode in APPROACHES:
            runs = [new_run(ctx, mode, n) for n in ns]
            if mode != "private":
                runs += [new_run(ctx, mode, n, [i % 2 for i in range(n)], mixed=True) for n in mixed_ns]
            ctx.log(f"s4: herd {mode}, repetition {rep + 1}/{reps}, N={[r['n'] for r in runs]}")
            results = launch(ctx, dict(base_cfg, mode=mode, runs=runs, engine=True), f"herd-{mode}-{rep}")
            for r, res in zip(runs, results):
                case = f"mixed N={r['n']}" if r.get("mixed") else f"N={r['n']}"
                data.setdefault((case, mode), []).append(res)
        for diag, preload in (("existing", []), ("preloaded", LAZY_IMPORTS)):
            runs = [dict(new_run(ctx, "stubcache", n), root=existing_root(ctx)) for n in (1, ns[-1])]
            results = launch(ctx, dict(base_cfg, mode="stubcache", runs=runs, preload=preload), f"herd-{diag}-{rep}")
            for r, res in zip(runs, results):
                data.setdefault((f"N={r['n']}", diag), []).append(res)
        runs = [new_run(ctx, "stubcache", n) for n in (1, ns[-1])]
        results = launch(ctx, dict(base_cfg, mode="stubcache", runs=runs), f"herd-torchfree-{rep}")
        for r, res in zip(runs, results):
            data.setdefault((f"N={r['n']}", "torchfree"), []).append(res)
    phases = {key: _phases(results) for key, results in data.items() if key[1] in ("stubcache", "torchfree")}
    rows = []
    labels = {**APPROACHES, **DIAG}
    order = list(labels.values())
    for (case, mode), results in data.items():
        rows.append(row(case, labels[mode], [r["all_loaded"] for r in results],
                        compiles=[r["compiles"] for r in results], wrong=[r["wrong"] for r in results],
                        errors=sum(len(r["errors"]) for r in results),
                        error_sample=next((r["errors"][0] for r in results if r["errors"]), None),
                        n=results[0]["n"]))
    rows.sort(key=lambda r: (r["case"].startswith("mixed"), r["extra"]["n"], order.index(r["approach"])))
    top = ns[-1]

    def get(case: str, mode: str) -> dict:
        return next(r for r in rows if r["case"] == case and r["approach"] == labels[mode])

    big = get(f"N={top}", "stubcache")
    one = get("N=1", "stubcache")
    r = ratio(big["median"], one["median"])
    compiles = big["extra"]["compiles"]
    targets = [
        target(f"herd of {top}: exactly 1 compile", f"{compiles} compiles per repetition", "1",
               all(c == 1 for c in compiles) and big["extra"]["errors"] == 0,
               "" if top == 16 else f"--quick runs N ≤ {top}; the target is stated for 16"),
        target(f"herd of {top} engine starts cold on one key: all loaded within 1.3× one cold build",
               f"{r:.2f}× ({fmt_time(big['median'])} vs {fmt_time(one['median'])} for a herd of 1)", "≤ 1.3×",
               r is not None and r <= 1.3,
               "" if top == 16 else f"--quick runs N ≤ {top}; the target is stated for 16", headline="3"),
    ]
    priv = get(f"N={top}", "private")
    shared = get(f"N={top}", "shared")
    notes = [
        f"N={top}: stubcache {fmt_time(big['median'])} with {compiles[0]} compile(s); private directories "
        f"{fmt_time(priv['median'])} with {priv['extra']['compiles'][0]} compiles "
        f"({ratio(priv['median'], big['median']):.1f}× stubcache); shared torch directory "
        f"{fmt_time(shared['median'])} with {shared['extra']['compiles'][0]} compile(s).",
    ]
    tf1, tf = get("N=1", "torchfree"), get(f"N={top}", "torchfree")
    ex1, ex = get("N=1", "existing"), get(f"N={top}", "existing")
    pl1, pl = get("N=1", "preloaded"), get(f"N={top}", "preloaded")
    notes.append(f"Diagnostics, torch-free processes (the launcher imported only stubcache before the fork), "
                 f"N={top} vs N=1: fresh root {ratio(tf['median'], tf1['median']):.2f}× "
                 f"({fmt_time(tf['median'])} vs {fmt_time(tf1['median'])}); root already existing "
                 f"{ratio(ex['median'], ex1['median']):.2f}× ({fmt_time(ex['median'])}); root existing and "
                 f"filelock/builder imported before the fork {ratio(pl['median'], pl1['median']):.2f}× "
                 f"({fmt_time(pl['median'])}), against the fresh-root herd of 1 "
                 f"{ratio(pl['median'], tf1['median']):.2f}×.")
    for diag in ("stubcache", "torchfree"):
        ph = phases.get((f"N={top}", diag))
        if ph:
            notes.append(f"Where the N={top} herd's time goes ({labels[diag]}; medians over repetitions): "
                         f"the last child got the CPU {fmt_time(ph['last_start'])} after the release; the "
                         f"builder had its library at {fmt_time(ph['builder_done'])}; the last waiter at "
                         f"{fmt_time(ph['all_loaded'])}; a waiter's own CPU time {fmt_time(ph['waiter_cpu'])} "
                         f"(the N=1 build: {fmt_time((phases.get(('N=1', diag)) or {}).get('builder_done'))}).")
    for n in mixed_ns:
        sh = get(f"mixed N={n}", "shared")
        sc = get(f"mixed N={n}", "stubcache")
        notes.append(f"mixed sources, N={n}: the shared torch directory gave {sum(sh['extra']['wrong'])} of "
                     f"{n * len(sh['samples'])} processes the other variant's library; stubcache "
                     f"{sum(sc['extra']['wrong'])} (with {sc['extra']['compiles']} compiles: one per variant).")
    errs = [r for r in rows if r["extra"]["errors"]]
    for r_ in errs:
        notes.append(f"{r_['case']} / {r_['approach']}: {r_['extra']['errors']} process(es) failed, e.g. "
                     f"{r_['extra']['error_sample']}")
    return {"id": 4, "title": "Herd: N processes starting at once", "rows": rows, "targets": targets,
            "notes": notes}


def _phases(results: list[dict]) -> dict | None:
    """Medians over repetitions of a herd's phases (see _herd.py), or None if one is missing."""
    import statistics

    keys = ("last_start", "builder_done", "all_loaded")
    if not results or any(r.get(k) is None for r in results for k in keys):
        return None
    out = {k: statistics.median(r[k] for r in results) for k in keys}
    cpu = [c for r in results for c in r.get("cpu") or []]
    out["waiter_cpu"] = statistics.median(cpu) if cpu else None
    return out


def plot(result: dict, path: Path) -> bool:
    """Wall time to all-loaded against N, one line per approach (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for label in APPROACHES.values():
        pts = sorted((r["extra"]["n"], r["median"], r["min"], r["max"]) for r in result["rows"]
                     if r["approach"] == label and not r["case"].startswith("mixed"))
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8, 16])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("processes started at once (N)")
    ax.set_ylabel("seconds until all have the stub loaded")
    ax.set_title("Herd of processes needing the arena stub (median, min-max)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
