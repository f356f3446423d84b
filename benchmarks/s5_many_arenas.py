"""Scenario 5: P processes x A arenas each, on a cold host.

stubcache + kvarena (every arena of every process uses one cached stub; ``KvArena(1 MiB, "cpu")``)
against one build per arena (a one-slot stub built with ``load_inline(no_implicit_headers=True)``
into its own ``<pid>_<n>`` directory, as SGLang does today). Total compiler invocations, wall time
until every process has all its arenas, and the sum of per-process start-up seconds.
"""

from __future__ import annotations

from _common import STUB_NAME, Ctx, fmt_time, ratio, row, target
from s4_herd import launch


def run(ctx: Ctx) -> dict:
    from kvarena.stub import stub_source

    configs = [(2, 2)] if ctx.quick else [(2, 4), (4, 4)]
    reps = ctx.reps(1, 2)
    data: dict[tuple, list] = {}
    for rep in range(reps):
        for p, a in configs:
            for mode in ("kvarena", "per_arena"):
                run_ = {"n": p, "arenas": a, "log": str(ctx.fresh_dir("log") / "cxx.log")}
                if mode == "kvarena":
                    run_["root"] = str(ctx.fresh_dir("s5-root"))
                else:
                    run_["base"] = str(ctx.fresh_dir("s5-tmp"))
                ctx.log(f"s5: {mode}, P={p} x A={a}, repetition {rep + 1}/{reps}")
                cfg = {"mode": mode, "name": STUB_NAME, "one_slot_source": stub_source(1), "runs": [run_]}
                data.setdefault((p, a, mode), []).extend(launch(ctx, cfg, f"s5-{mode}-{p}-{a}-{rep}"))
    rows = []
    labels = {"kvarena": "stubcache + kvarena (one stub)", "per_arena": "one build per arena (SGLang pattern)"}
    for (p, a, mode), results in data.items():
        rows.append(row(f"P={p} x A={a}", labels[mode], [r["all_loaded"] for r in results],
                        compiles=[r["compiles"] for r in results],
                        process_seconds=[round(sum(r["per_process"]), 4) for r in results],
                        errors=sum(len(r["errors"]) for r in results),
                        error_sample=next((r["errors"][0] for r in results if r["errors"]), None)))
    ok = [r for r in rows if r["approach"] == labels["kvarena"]]
    compiles = [c for r in ok for c in r["extra"]["compiles"]]
    targets = [target("P×A arenas: exactly 1 compile on a cold host",
                      ", ".join(f"{r['case']}: {r['extra']['compiles']}" for r in ok), "1",
                      all(c == 1 for c in compiles) and all(r["extra"]["errors"] == 0 for r in ok))]
    notes = []
    for p, a in configs:
        k = next(r for r in rows if r["case"] == f"P={p} x A={a}" and r["approach"] == labels["kvarena"])
        s = next(r for r in rows if r["case"] == f"P={p} x A={a}" and r["approach"] == labels["per_arena"])
        notes.append(f"P={p} x A={a}: stubcache + kvarena {fmt_time(k['median'])} wall, {k['extra']['compiles'][0]} "
                     f"compile; one build per arena {fmt_time(s['median'])} wall, {s['extra']['compiles'][0]} compiles "
                     f"({ratio(s['median'], k['median']):.1f}× slower).")
    notes.append("The per-arena alternative builds a one-slot stub (smaller than kvarena's 64-slot stub), "
                 "which favours it.")
    for r in rows:
        if r["extra"]["errors"]:
            notes.append(f"{r['case']} / {r['approach']}: {r['extra']['errors']} failure(s): {r['extra']['error_sample']}")
    return {"id": 5, "title": "Many arenas: P processes × A arenas", "rows": rows, "targets": targets, "notes": notes}
