"""Shared helpers of the benchmark scenarios: context, statistics, compile counting, children.

Every scenario module exposes ``run(ctx) -> dict`` returning::

    {"id": int, "title": str, "rows": [row, ...], "targets": [target, ...], "notes": [str, ...]}

where a row is made by :func:`row` and a target by :func:`target`. ``run.py`` renders them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
PY = sys.executable
STUB_NAME = "kvarena_alloc_stub"


class Ctx:
    """What every scenario gets: mode, repetition counts, a scratch directory, a logger."""

    def __init__(self, out: Path, quick: bool, work: Path | None = None, verbose: bool = True) -> None:
        self.out = out
        self.quick = quick
        self.work = work or Path(tempfile.mkdtemp(prefix="stubcache-bench-"))
        self.verbose = verbose
        self._n = 0
        self._wheel = None
        self._engine = None
        self.work.mkdir(parents=True, exist_ok=True)
        self.cxx = CxxWrapper(self.work / "cxx")
        self.source_file = self.work / "arena_stub.cpp"
        self.source_file.write_text(arena_source())

    def reps(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    def fresh_dir(self, prefix: str) -> Path:
        """A new, empty private directory (a fresh cache root or build directory)."""
        self._n += 1
        d = self.work / f"{prefix}-{self._n:04d}"
        d.mkdir(mode=0o700)
        return d

    def installed(self):
        """The checkout as users install it (a wheel in a scratch venv; see ``_wheel.py``), made
        once per run for the fresh-process scenarios; the fallback says so in its ``note``."""
        if self._wheel is None:
            from _wheel import wheel_env

            self.log("building this checkout's wheel into a scratch venv")
            self._wheel = wheel_env(self.work / "wheel-install")
            self.log(self._wheel.note)
        return self._wheel

    def installed_engine(self):
        """An engine's environment: the checkout's wheel in a scratch venv that also sees this
        Python's site-packages (torch), made once per run (``_wheel.py``, ``torch=True``)."""
        if self._engine is None:
            from _wheel import wheel_env

            self.log("building this checkout's wheel into a scratch venv with torch")
            self._engine = wheel_env(self.work / "wheel-engine", torch=True)
            self.log(self._engine.note)
        return self._engine

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def cleanup(self) -> None:
        from stubcache.storage.store import Store

        Store.rmtree(str(self.work))


def arena_source() -> str:
    """The arena stub's source (kvarena's allocator stub) plus a one-line variant marker.

    The marker lets herds check that each process loaded the library it asked for; variant 0 is
    what every benchmark uses unless it tests mixed sources.
    """
    return variant_source(0)


def variant_source(variant: int) -> str:
    from kvarena.stub import stub_source

    return stub_source() + f'extern "C" int bench_variant(void) {{ return {int(variant)}; }}\n'


def spec_kwargs() -> dict:
    """The StubSpec arguments of ``kvarena.stub.allocator_spec()`` (minus the source)."""
    return dict(is_python_module=False, no_implicit_headers=True, with_cuda=False)


def child_env(**extra: str) -> dict:
    """Environment for child processes: this checkout first on the path, no stray stubcache knobs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # PYTHONDONTWRITEBYTECODE: users run with bytecode caches (pip writes them at install); where a
    # machine sets it, every child would compile the checkout's modules from source (~80 ms).
    for k in ("STUBCACHE_DIR", "STUBCACHE_REQUIRE_HIT", "STUBCACHE_LOCK_TIMEOUT", "TORCH_EXTENSIONS_DIR",
              "PYTHONDONTWRITEBYTECODE"):
        env.pop(k, None)
    for k in [k for k in env if k.startswith("STUBCACHE_REMOTE")]:
        env.pop(k)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_py(code: str, args: Sequence[str] = (), env: dict | None = None, timeout: float = 600,
           python: str = PY, cwd: str | Path | None = None, prefix: Sequence[str] = ()) -> str:
    """Run a Python snippet in a fresh process (started through the command ``prefix``, if any);
    return its stdout (raise with stderr on failure)."""
    proc = subprocess.run([*prefix, python, "-c", textwrap.dedent(code), *map(str, args)], env=env or child_env(), cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def run_json(code: str, args: Sequence[str] = (), env: dict | None = None, timeout: float = 600,
             python: str = PY, cwd: str | Path | None = None, prefix: Sequence[str] = ()) -> Any:
    """Run a snippet that prints one JSON document as its last stdout line."""
    out = run_py(code, args, env, timeout, python, cwd, prefix)
    return json.loads(out.strip().splitlines()[-1])


def wall(cmd: Sequence[str], env: dict | None = None, timeout: float = 600, cwd: str | Path | None = None) -> float:
    """Wall seconds of one process from start to exit (stdout/stderr discarded; must exit 0)."""
    t0 = time.perf_counter()
    proc = subprocess.run(list(cmd), env=env or child_env(), cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=timeout)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:3]}... failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return dt


class CxxWrapper:
    """A ``CXX`` that logs each compile (an invocation naming a source file), then runs ``c++``.

    The log file is ``$BENCH_CXX_LOG`` if set (so one launcher can count per herd), else
    ``<dir>/cxx.log``. Invocations without a source (``--version``, link steps) and
    preprocessor-only ones (``-E``: the search probe) are not counted.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "cxx-wrapper.sh"
        self.default_log = directory / "cxx.log"
        real = shutil.which("c++") or "c++"
        self.path.write_text(textwrap.dedent(f"""\
            #!/bin/sh
            case " $* " in
              *" -E "*) ;;
              *.cpp\\ *|*.cc\\ *|*.cu\\ *|*.c\\ *)
                echo "$$ $*" >> "${{BENCH_CXX_LOG:-{self.default_log}}}" ;;
            esac
            exec "{real}" "$@"
            """))
        self.path.chmod(0o755)

    @staticmethod
    def count(log: Path) -> int:
        try:
            return sum(1 for ln in Path(log).read_text().splitlines() if ln.strip())
        except FileNotFoundError:
            return 0


# --- statistics ---------------------------------------------------------------------------------


def stats(samples: Iterable[float]) -> dict:
    xs = sorted(float(x) for x in samples)
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "p25": None, "p75": None}

    def q(p: float) -> float:
        if len(xs) == 1:
            return xs[0]
        k = (len(xs) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"n": len(xs), "median": statistics.median(xs), "min": xs[0], "max": xs[-1],
            "p25": q(0.25), "p75": q(0.75)}


def row(case: str, approach: str, samples: Iterable[float], unit: str = "s", **extra: Any) -> dict:
    """One measured line: ``samples`` in ``unit`` ("s" seconds, "count", "bytes", "us")."""
    samples = [float(x) for x in samples]
    return {"case": case, "approach": approach, "unit": unit, "samples": samples, **stats(samples),
            "extra": extra}


def target(name: str, measured: str, goal: str, met: bool | None, note: str = "", headline: str | None = None) -> dict:
    """A target from the issue: ``met`` is True/False, or None when not measured in this run.
    ``headline`` ("1a", "2", ...) puts it in the table that opens docs/performance.md, in that
    order (see ``run.py --doc``)."""
    t = {"target": name, "measured": measured, "goal": goal, "met": met, "note": note}
    if headline:
        t["headline"] = headline
    return t


def find(rows: list[dict], case: str | None = None, approach: str | None = None) -> dict | None:
    for r in rows:
        if (case is None or r["case"] == case) and (approach is None or r["approach"] == approach):
            return r
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0:
        return "-" + fmt_time(-seconds)
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return fmt_time(value)
    if unit == "bytes":
        return f"{value / 1024:.0f} KiB"
    if unit == "count":
        return f"{value:g}"
    return f"{value:g} {unit}"
