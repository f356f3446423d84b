"""Scenario 6: cache management on synthetic stores of 1,000 and 10,000 entries.

Runs the CLI engineer's ``benchmarks/bench_cli.py`` (``ls``, ``stats``, ``prune --dry-run`` and a
real ``prune``, each a fresh ``python -m stubcache``-equivalent process, on stores of valid
synthetic entries) and turns its JSON into rows. Without that script it falls back to timing the
same commands itself.
"""

from __future__ import annotations

import json
import subprocess
import time

from _common import BENCH, PY, Ctx, child_env, fmt_time, row, target, wall

TARGET_CASES = ("ls", "stats", "prune --dry-run --max-size (half)")


def _via_bench_cli(ctx: Ctx, sizes: list[int], reps: int) -> dict:
    out = ctx.work / "bench_cli.json"
    subprocess.run([PY, str(BENCH / "bench_cli.py"), "--sizes", *map(str, sizes), "--repeat", str(reps),
                    "--out", str(out)], env=child_env(BENCH_DIR=str(ctx.work)), check=True,
                   stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads(out.read_text())


def _fallback(ctx: Ctx, sizes: list[int], reps: int) -> dict:
    from _synthetic import fake_store

    res: dict = {"sizes": {}}
    for n in sizes:
        root = ctx.fresh_dir(f"s6-{n}")
        t0 = time.perf_counter()
        fake_store(str(root), n)
        gen = time.perf_counter() - t0
        cases = {"ls": ["ls"], "stats": ["stats"],
                 "prune --dry-run --max-size (half)": ["prune", "--dry-run", "--max-size", f"{n * 8 * 1024}B"]}
        rows = {}
        for label, argv in cases.items():
            runs = [wall([PY, "-m", "stubcache", "--cache-dir", str(root), *argv]) for _ in range(reps)]
            rows[label] = {"runs": runs}
        runs = [wall([PY, "-m", "stubcache", "--cache-dir", str(root), "prune", "--yes", "--max-size", f"{n * 8 * 1024}B"])]
        rows["prune --yes --max-size (half), real"] = {"runs": runs}
        res["sizes"][str(n)] = {"generate_s": gen, "cases": rows}
    return res


def run(ctx: Ctx) -> dict:
    sizes = [1000] if ctx.quick else [1000, 10000]
    reps = ctx.reps(1, 3)
    ctx.log(f"s6: cache management on synthetic stores of {sizes} entries")
    if (BENCH / "bench_cli.py").exists():
        data, how = _via_bench_cli(ctx, sizes, reps), "benchmarks/bench_cli.py"
    else:
        data, how = _fallback(ctx, sizes, reps), "the fallback in s6_cache_mgmt.py"
    rows = []
    for n, d in data["sizes"].items():
        for label, c in d["cases"].items():
            rows.append(row(f"{int(n):,} entries", f"stubcache {label}", c["runs"],
                            torch_imported=c.get("torch_imported"), removed=c.get("removed")))
    big = str(max(sizes))
    tg = []
    for label in TARGET_CASES:
        r = next(r for r in rows if r["case"] == f"{int(big):,} entries" and r["approach"] == f"stubcache {label}")
        tg.append(r)
    worst = max(r["median"] for r in tg)
    targets = [target(f"`ls`/`stats`/`prune --dry-run` on {int(big):,} entries ≤ 1 s each",
                      ", ".join(f"{r['approach'].removeprefix('stubcache ')}: {fmt_time(r['median'])}" for r in tg),
                      "≤ 1 s", worst <= 1.0,
                      "" if big == "10000" else "--quick measures 1,000 entries; the target is stated for 10,000")]
    notes = [f"Measured by {how}; every command is a fresh Python process (start-up and imports included)."]
    if "startup_dir_s" in data:
        notes.append(f"`stubcache dir` (start-up only): {fmt_time(data['startup_dir_s'])}.")
    notes.append("Synthetic stores have no event files, so `stats` here folds entries but few events.")
    for n, d in data["sizes"].items():
        notes.append(f"{int(n):,} entries: generating the store took {d['generate_s']:.1f} s.")
    return {"id": 6, "title": "Cache management", "rows": rows, "targets": targets, "notes": notes}
