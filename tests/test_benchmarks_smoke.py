"""Smoke tests of the benchmark harness: statistics, rendering, and a tiny real herd.

No wall-clock thresholds: these check that the harness measures what it says (compile counts,
wrong-library detection), not how fast anything is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import run as bench_run  # noqa: E402
import s4_herd  # noqa: E402


def test_stats_median_and_quartiles():
    s = _common.stats([3.0, 1.0, 2.0, 4.0])
    assert s["n"] == 4 and s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0
    assert s["p25"] == pytest.approx(1.75) and s["p75"] == pytest.approx(3.25)
    assert _common.stats([])["median"] is None


def test_render_marks_targets():
    results = {
        "command": "python benchmarks/run.py --quick", "quick": True, "seconds": 1.0,
        "machine": {"date": "d", "git_commit": "c", "nproc": "2", "python": "3", "torch": "t",
                    "compiler": "c++", "ninja": "1", "kernel": "k", "loadavg_start": (0.0, 0.0, 0.0)},
        "scenarios": [{"id": 1, "title": "T", "notes": ["a note"],
                       "rows": [_common.row("case", "approach", [0.5, 0.25], size=1024)],
                       "targets": [_common.target("t1", "1×", "≤ 2×", True),
                                   _common.target("t2", "3×", "≤ 2×", False),
                                   _common.target("t3", "-", "x", None, "skipped")]}],
    }
    md = bench_run.render(results)
    assert "**met**" in md and "**missed**" in md and "not measured (skipped)" in md
    assert "| case | approach | 375.0 ms | 250.0 ms – 500.0 ms | 2 | 1 KiB |" in md


def test_herd_counts_one_compile_and_detects_variants(tmp_path):
    ctx = _common.Ctx(tmp_path / "out", quick=True, work=tmp_path / "work", verbose=False)
    cfg = {"name": "bench_smoke_stub", "kw": _common.spec_kwargs(), "mode": "stubcache",
           "sources": {"0": _common.variant_source(0), "1": _common.variant_source(1)},
           "runs": [s4_herd.new_run(ctx, "stubcache", 3),
                    s4_herd.new_run(ctx, "stubcache", 2, [0, 1], mixed=True)]}
    same, mixed = s4_herd.launch(ctx, cfg, "smoke")
    assert same["errors"] == [] and same["reported"] == 3
    assert same["compiles"] == 1 and same["wrong"] == 0
    assert mixed["errors"] == [] and mixed["compiles"] == 2 and mixed["wrong"] == 0


def test_wheel_env_runs_the_checkout_as_installed_without_torch(tmp_path):
    """The fresh-process scenarios' venv: this checkout's wheel, no editable finder, no torch,
    and a header-free stub builds and hits there."""
    import subprocess

    import _wheel

    inst = _wheel.make_wheel_env(tmp_path / "w")  # raises if it cannot be made
    assert inst.wheel and inst.python.startswith(str(tmp_path))
    root = tmp_path / "root"
    code = ("import sys, stubcache; lib = stubcache.StubCache(sys.argv[1]).load(stubcache.StubSpec("
            "'wheel_smoke', 'extern \"C\" int f(void) { return 7; }')); "
            "print(lib.f(), stubcache.__file__, 'torch' in sys.modules)")
    for require_hit in ("", "1"):
        proc = subprocess.run([inst.python, "-c", code, str(root)], cwd=inst.cwd, capture_output=True, text=True,
                              env=_wheel.clean_env({"STUBCACHE_REQUIRE_HIT": require_hit}), timeout=120)
        assert proc.returncode == 0, proc.stderr
        value, where, torch_loaded = proc.stdout.split()
        assert value == "7" and where.startswith(str(tmp_path / "w" / "venv")) and torch_loaded == "False"


def test_performance_doc_opens_with_the_generated_table():
    """docs/performance.md's opening table is what ``run.py --doc`` rendered from the record
    beside it (docs/performance-targets.json), not typed by hand."""
    import json

    text = bench_run.DOC.read_text()
    block = bench_run.doc_block(text)
    assert block is not None, "docs/performance.md lost its generated block"
    assert text.index(bench_run.BEGIN) < text.index("## How to run")  # the doc opens with it
    rows = json.loads(bench_run.DOC_TARGETS.read_text())
    assert block == bench_run.render_headline(rows)
    assert [t["headline"] for t in rows] == sorted(t["headline"] for t in rows)


def _results(commit: str, sid: int, targets: list) -> dict:
    return {"command": "python benchmarks/run.py --doc", "scenarios": [{"id": sid, "targets": targets}],
            "machine": {"date": "d", "git_commit": commit, "nproc": "2", "loadavg_start": (1.0, 2.0, 3.0)}}


def test_headline_table_from_runs(tmp_path):
    doc, record = tmp_path / "performance.md", tmp_path / "targets.json"
    doc.write_text(f"# P\n\n{bench_run.BEGIN}\nold\n{bench_run.END}\n\n## How to run\n")
    bench_run.write_doc(_results("abc1234", 11, [_common.target("b", "2×", "≥ 5×", False, headline="1b"),
                                                 _common.target("a", "6×", "≥ 5×", True, headline="1a"),
                                                 _common.target("not headline", "1", "1", True)]), doc, record)
    bench_run.write_doc(_results("def5678", 4, [_common.target("herd", "1.2×", "≤ 1.3×", True, headline="3")]),
                        doc, record)
    bench_run.write_doc(_results("0a0a0a0", 11, [_common.target("b", "5.5×", "≥ 5×", True, headline="1b")]),
                        doc, record)  # replaces every row of scenario 11
    block = bench_run.doc_block(doc.read_text())
    assert "old" not in block and "abc1234" not in block
    assert block.splitlines()[2:4] == ["| 1b | b | **met** | 5.5× | 11, run 1 |", "| 3 | herd | **met** | 1.2× | 4, run 2 |"]
    assert "Run 1: `python benchmarks/run.py --doc` at git 0a0a0a0" in block and "git def5678" in block
    assert doc.read_text().endswith("## How to run\n")
