"""How interactive is the CLI on big caches? Times ``ls``, ``stats``, ``prune --dry-run`` and a
real ``prune`` on synthetic stores of 1,000 and 10,000 entries (valid manifests written by the
``Manifest`` class, filler "libraries"), each as a fresh ``python -m stubcache`` process, so
interpreter start-up and imports are included. Also checks that none of them imported torch.

    python benchmarks/bench_cli.py [--sizes 1000 10000] [--repeat 3] [--out results.json]

Prints a markdown table (median wall seconds) and writes the raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from _synthetic import fake_entry  # noqa: E402
from stubcache.storage.store import Store  # noqa: E402

PROBE = ("import sys, runpy; sys.argv = ['stubcache'] + sys.argv[1:]\n"
         "from stubcache.cli import main\n"
         "rc = main(sys.argv[1:])\n"
         "sys.stderr.write('TORCH_IMPORTED=%d\\n' % ('torch' in sys.modules)); sys.exit(rc)")


def make_store(root: str, n: int) -> float:
    """Publish ``n`` synthetic 16 KiB entries with last-use times spread over 60 days."""
    t0 = time.perf_counter()
    store = Store(root)
    store.ensure()
    now = time.time()
    for i in range(n):
        t = now - 60 * 86400.0 * (i / max(n - 1, 1))
        fake_entry(store, f"stub{i % 97}", 16 * 1024, created=t - 60, last_used=t, salt=str(i))
    return time.perf_counter() - t0


def run(root: str, *args: str) -> tuple[float, bool, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE, "--cache-dir", root, *args],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{args} failed ({proc.returncode}): {proc.stderr}")
    return wall, "TORCH_IMPORTED=1" in proc.stderr, proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_cli.json"))
    args = ap.parse_args()
    baseline = min(run(tempfile.mkdtemp(), "dir")[0] for _ in range(args.repeat))
    results = {"python": platform.python_version(), "cpus": os.cpu_count(), "startup_dir_s": baseline,
               "sizes": {}}
    for n in args.sizes:
        with tempfile.TemporaryDirectory(prefix="bench-cli-", dir=os.environ.get("BENCH_DIR")) as tmp:
            root = os.path.join(tmp, "cache")
            gen = make_store(root, n)
            cases = {
                "ls": ["ls"],
                "ls --format json": ["ls", "--format", "json"],
                "stats": ["stats"],
                "prune --dry-run --max-size (half)": ["prune", "--dry-run", "--max-size", f"{n * 8 * 1024}B"],
                "prune --dry-run --older-than 30d": ["prune", "--dry-run", "--older-than", "30d"],
            }
            row: dict[str, dict] = {}
            for label, argv in cases.items():
                times, torch_seen = [], False
                for _ in range(args.repeat):
                    wall, torch_imported, _ = run(root, *argv)
                    times.append(wall)
                    torch_seen |= torch_imported
                row[label] = {"median_s": statistics.median(times), "runs": times, "torch_imported": torch_seen}
            wall, torch_imported, out = run(root, "prune", "--yes", "--format", "json",
                                            "--max-size", f"{n * 8 * 1024}B")
            removed = json.loads(out)["summary"]["removed"]
            row["prune --yes --max-size (half), real"] = {"median_s": wall, "runs": [wall],
                                                          "torch_imported": torch_imported, "removed": removed}
            results["sizes"][str(n)] = {"generate_s": gen, "cases": row}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
    labels = list(next(iter(results["sizes"].values()))["cases"])
    print(f"python {results['python']}, {results['cpus']} CPUs; `stubcache dir` (start-up only): "
          f"{baseline * 1000:.0f} ms\n")
    print("| command | " + " | ".join(f"{n} entries" for n in results["sizes"]) + " | imports torch |")
    print("|---|" + "---|" * len(results["sizes"]) + "---|")
    for label in labels:
        cells = [f"{results['sizes'][n]['cases'][label]['median_s'] * 1000:.0f} ms" for n in results["sizes"]]
        torch_any = any(results["sizes"][n]["cases"][label]["torch_imported"] for n in results["sizes"])
        print(f"| `{label}` | " + " | ".join(cells) + f" | {'yes' if torch_any else 'no'} |")
    for n, r in results["sizes"].items():
        print(f"\n{n} entries: real prune removed {r['cases']['prune --yes --max-size (half), real']['removed']}; "
              f"generating the store took {r['generate_s']:.1f} s")
    print(f"\nraw numbers: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
