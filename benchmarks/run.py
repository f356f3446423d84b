"""Run the stubcache benchmarks: every scenario against its alternatives, in one run.

    python benchmarks/run.py [--quick] [--out DIR] [--only 1,4] [--keep-work] [--doc]

Writes ``DIR/results.json`` (every sample), ``DIR/results.md`` (tables, targets, notes),
``DIR/headline.md`` (the issue's targets in one table; ``--doc`` also puts them into the table at
the top of docs/performance.md, replacing the rows of the scenarios it ran, and its record into
docs/performance-targets.json) and, with
matplotlib installed (``pip install -e '.[bench]'``), ``DIR/herd.png`` (scenario 4). Default
``DIR`` is ``benchmarks/results/latest``. ``--quick`` is the CI smoke test: fewer repetitions,
smaller herds and stores, and no ~40 s torch-header build. Nothing here asserts a speed; targets
are reported as met or missed. The fresh-process scenarios (2, 3, 7) run stubcache installed from
this checkout's wheel in a scratch venv, as users install it (``_wheel.py``; a fallback to the
checkout is reported as such).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from _common import Ctx, fmt_time, fmt_value  # noqa: E402

SCENARIOS = {
    1: "s1_cold_build",
    2: "s2_fresh_hit",
    3: "s3_inproc_hit",
    4: "s4_herd",
    5: "s5_many_arenas",
    6: "s6_cache_mgmt",
    7: "s7_hit_breakdown",
    8: "s8_fleet",
    9: "s9_tracked_inputs",
    10: "s10_startup_cap",
    11: "s11_engine_start",
}


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"<{exc}>"


def git_state() -> str:
    """The checkout's commit, ``+modified`` if a tracked file differs from it: each scenario
    builds its wheel from the working tree, so a run says what it measured."""
    head = _sh(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"])
    changed = _sh(["git", "-C", str(HERE.parent), "status", "--porcelain", "--untracked-files=no"])
    return f"{head}+modified" if changed else head


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg: str) -> str | None:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": _sh(["nproc"]),
        "lscpu": "\n".join(_sh(["lscpu"]).splitlines()[:12]),
        "memory": next((ln for ln in _sh(["free", "-g"]).splitlines() if ln.startswith("Mem")), ""),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": ver("torch"),
        "compiler": _sh([shutil.which("c++") or "c++", "--version"]).splitlines()[0],
        "ninja": _sh(["ninja", "--version"]),
        "filelock": ver("filelock"),
        "git_commit": git_state(),
        "loadavg_start": os.getloadavg(),
    }


def render(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# stubcache benchmark results",
        "",
        f"- command: `{results['command']}`",
        f"- mode: {'quick (CI smoke test)' if results['quick'] else 'full'}; run took {results['seconds']:.0f} s",
        f"- date: {m['date']}; git {m['git_commit']}",
        f"- machine: {m['nproc']} CPUs (`nproc`), Python {m['python']}, torch {m['torch']}, {m['compiler']}, "
        f"ninja {m['ninja']}, kernel {m['kernel']}; load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_start'])}",
        "",
        "Times are medians over repetitions, spread is min–max (n = repetitions). Ratios compare "
        "approaches measured in this same run.",
        "",
        "## Targets",
        "",
        "| scenario | target | measured | goal | status |",
        "|---|---|---|---|---|",
    ]
    for sc in results["scenarios"]:
        for t in sc.get("targets", []):
            status = {True: "**met**", False: "**missed**", None: "not measured"}[t["met"]]
            note = f" ({t['note']})" if t.get("note") else ""
            lines.append(f"| {sc['id']} | {t['target']} | {t['measured']} | {t['goal']} | {status}{note} |")
    for sc in results["scenarios"]:
        lines += ["", f"## {sc['id']}. {sc.get('title', '')}", ""]
        if sc.get("error"):
            lines += ["```", sc["error"].strip()[-3000:], "```"]
            continue
        extra_keys = []
        for r in sc["rows"]:
            for k in r["extra"]:
                if k not in extra_keys and k not in ("error_sample", "n"):
                    extra_keys.append(k)
        lines.append("| case | approach | median | spread (min–max) | n |" + "".join(f" {k} |" for k in extra_keys))
        lines.append("|---|---|---|---|---|" + "---|" * len(extra_keys))
        for r in sc["rows"]:
            spread = f"{fmt_value(r['min'], r['unit'])} – {fmt_value(r['max'], r['unit'])}"
            cells = []
            for k in extra_keys:
                v = r["extra"].get(k)
                if v is None:
                    cells.append("")
                elif k == "size":
                    cells.append(f"{v / 1024:.0f} KiB")
                elif isinstance(v, float):
                    cells.append(fmt_time(v))
                elif isinstance(v, list):
                    cells.append(",".join(str(x) for x in v))
                else:
                    cells.append(str(v))
            lines.append(f"| {r['case']} | {r['approach']} | {fmt_value(r['median'], r['unit'])} | {spread} | "
                         f"{r['n']} |" + "".join(f" {c} |" for c in cells))
        if sc.get("figure"):
            lines += ["", f"![{sc['title']}]({sc['figure']})"]
        if sc.get("notes"):
            lines.append("")
            lines += [f"- {n}" for n in sc["notes"]]
    return "\n".join(lines) + "\n"


DOC = HERE.parent / "docs" / "performance.md"
DOC_TARGETS = HERE.parent / "docs" / "performance-targets.json"  # what the doc's table was rendered from
BEGIN = ("<!-- targets: generated by `python benchmarks/run.py --doc` (or `--doc-from RESULTS_JSON`) from "
         "docs/performance-targets.json; do not edit -->")
END = "<!-- targets: end -->"


def headline(results: dict) -> list[dict]:
    """The headline targets of a run (those with a ``headline`` tag), each with the run it was
    measured in (command, commit, date, load average)."""
    m = results["machine"]
    run = {"command": results["command"], "git_commit": m["git_commit"], "date": m["date"],
           "loadavg_start": [round(float(x), 2) for x in m["loadavg_start"]], "nproc": m["nproc"]}
    return sorted(({**t, "scenario": sc["id"], "run": run} for sc in results["scenarios"]
                   for t in sc.get("targets", []) if t.get("headline")), key=lambda t: t["headline"])


def merge_headline(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with every row of a scenario that ``new`` measured replaced by ``new``'s rows."""
    measured = {t["scenario"] for t in new}
    return sorted([t for t in old if t["scenario"] not in measured] + new, key=lambda t: t["headline"])


def render_headline(rows: list[dict]) -> str:
    """The table that opens docs/performance.md: one row per headline target, each with the run
    it comes from; runs are listed under it."""
    runs: list[dict] = []
    for t in rows:
        if t["run"] not in runs:
            runs.append(t["run"])
    lines = ["| # | target | status | measured | scenario, run |", "|---|---|---|---|---|"]
    for t in rows:
        status = {True: "**met**", False: "**missed**", None: "not measured"}[t["met"]]
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(f"| {t['headline']} | {t['target']} | {status}{note} | {t['measured']} | "
                     f"{t['scenario']}, run {runs.index(t['run']) + 1} |")
    lines.append("")
    for i, r in enumerate(runs, 1):
        load = ", ".join(f"{x:.2f}" for x in r["loadavg_start"])
        lines.append(f"Run {i}: `{r['command']}` at git {r['git_commit']}, {r['date']}, {r['nproc']} CPUs, "
                     f"load average at the start {load}.")
    lines.append("Ratios are measured side by side within one run; times are medians.")
    return "\n".join(lines)


def doc_block(text: str) -> str | None:
    """The generated block of docs/performance.md (between the markers), or None."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_doc(results: dict, doc: Path = DOC, record: Path = DOC_TARGETS) -> None:
    """Put this run's headline targets into ``doc``'s opening table (between the markers),
    replacing the rows of the scenarios it ran, and the table's record beside it."""
    text = doc.read_text()
    if doc_block(text) is None:
        raise SystemExit(f"{doc} has no generated block ({BEGIN!r} ... {END!r})")
    old = json.loads(record.read_text()) if record.exists() else []
    rows = merge_headline(old, headline(results))
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(f"{head}{BEGIN}\n{render_headline(rows)}\n{END}{tail}")
    record.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke test: fewer repetitions, no torch-header build")
    ap.add_argument("--out", default=str(HERE / "results" / "latest"), help="output directory")
    ap.add_argument("--only", default="", help="comma-separated scenario numbers (default: all)")
    ap.add_argument("--keep-work", action="store_true", help="keep the scratch directory (cache roots, logs)")
    ap.add_argument("--doc", action="store_true",
                    help="also write this run's headline targets into docs/performance.md (its opening table)")
    ap.add_argument("--doc-from", metavar="RESULTS_JSON", type=Path,
                    help="write the headline targets of a finished run's results.json into docs/performance.md; "
                         "runs nothing")
    args = ap.parse_args(argv)
    if args.doc_from:
        write_doc(json.loads(args.doc_from.read_text()))
        print(f"updated {DOC} and {DOC_TARGETS} from {args.doc_from}")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    only = [int(x) for x in args.only.split(",") if x.strip()] or list(SCENARIOS)
    ctx = Ctx(out, quick=args.quick)
    ctx.log(f"scratch {ctx.work}; results -> {out}")
    results = {"command": "python benchmarks/run.py" + (" --quick" if args.quick else "")
               + (f" --only {args.only}" if args.only else "") + (" --doc" if args.doc else ""),
               "quick": args.quick, "machine": machine(), "scenarios": []}
    t_start = time.perf_counter()
    failed = []
    try:
        for sid in only:
            mod = importlib.import_module(SCENARIOS[sid])
            ctx.log(f"scenario {sid}: {mod.__doc__.strip().splitlines()[0]}")
            t0 = time.perf_counter()
            try:
                res = mod.run(ctx)
            except Exception:
                failed.append(sid)
                res = {"id": sid, "title": SCENARIOS[sid], "rows": [], "targets": [], "error": traceback.format_exc()}
                print(res["error"], file=sys.stderr)
            res["seconds"] = time.perf_counter() - t0
            if hasattr(mod, "plot") and res.get("rows"):
                png = out / "herd.png"
                if mod.plot(res, png):
                    res["figure"] = png.name
                else:
                    res.setdefault("notes", []).append("matplotlib not installed: no figure "
                                                       "(pip install -e '.[bench]')")
            results["scenarios"].append(res)
            ctx.log(f"scenario {sid} done in {res['seconds']:.1f} s")
    finally:
        if not args.keep_work:
            ctx.cleanup()
    results["seconds"] = time.perf_counter() - t_start
    end = git_state()
    if end != results["machine"]["git_commit"]:  # edited or committed while it ran
        results["machine"]["git_commit"] += f" (tree changed during the run, {end} at its end)"
    (out / "results.json").write_text(json.dumps(results, indent=1))
    md = render(results)
    (out / "results.md").write_text(md)
    (out / "headline.md").write_text(render_headline(headline(results)) + "\n")
    if args.doc:
        write_doc(results)
    print(md)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    if failed:
        print(f"scenario(s) {failed} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
