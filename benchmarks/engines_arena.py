"""SGLang's KV-arena start-up pattern, P engine processes x A arenas, measured three ways:

* ``torch``      — plain torch, names suffixed ``{pid}_{n}`` (SGLang as it is);
* ``run-pid``    — the same program unmodified under ``stubcache run``;
* ``run-nopid``  — under ``stubcache run`` with the pid taken out of the suffix (``{n}``), the
  smallest upstream change (docs/engines.md);
* ``kvarena``    — A host ``kvarena.KvArena`` per process instead (one stub for all arenas).

Each is started on a cold host (empty cache, empty build directories) and then restarted (new
pids, same cache). Reported per start: compiles (a ``CXX`` wrapper counts them), and time to
ready — from spawning the P processes to the last one having all A arenas loaded and called
(each process imports torch first: that ~2 s is in every figure). Ratios are against ``torch``.

    python benchmarks/engines_arena.py [--procs 4] [--arenas 3]

Every process uses SGLang's arena shape: a ``build_directory`` per arena under a temp dir,
``is_python_module=False``, the return value ignored, the library dlopened from
``{build_directory}/{name}.so`` and its six suffixed symbols called through ctypes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

ARENA = r'''
import ctypes, os, sys
from torch.utils.cpp_extension import load_inline

SRC = """
#include <stddef.h>
#include <stdint.h>
static uintptr_t base_{s}; static size_t used_{s}; static size_t cap_{s};
extern "C" int arena_init_{s}(uintptr_t b, size_t c) {{ base_{s} = b; cap_{s} = c; used_{s} = 0; return 0; }}
extern "C" void* arena_alloc_{s}(size_t n, int dev, void* stream) {{
  if (used_{s} + n > cap_{s}) return 0; void* p = (void*)(base_{s} + used_{s}); used_{s} += n; return p; }}
extern "C" void arena_free_{s}(void* p, size_t n, int dev, void* stream) {{ }}
extern "C" size_t arena_used_{s}(void) {{ return used_{s}; }}
extern "C" size_t arena_cap_{s}(void) {{ return cap_{s}; }}
extern "C" void arena_reset_{s}(void) {{ used_{s} = 0; }}
"""

with_pid = sys.argv[1] == "pid"
for n in range(int(sys.argv[2])):
    s = f"{os.getpid()}_{n}" if with_pid else f"{n}"
    name = f"sgl_kv_vmm_arena_stub_{s}"
    d = os.path.join(os.environ["ARENA_TMP"], "sgl_kv_vmm_arena", s)
    os.makedirs(d, exist_ok=True)
    load_inline(name=name, cpp_sources=[SRC.format(s=s)], is_python_module=False,
                no_implicit_headers=True, build_directory=d)
    lib = ctypes.CDLL(f"{d}/{name}.so")
    getattr(lib, f"arena_init_{s}")(ctypes.c_size_t(1 << 20), ctypes.c_size_t(1 << 30))
    alloc = getattr(lib, f"arena_alloc_{s}")
    alloc.restype = ctypes.c_void_p
    alloc.argtypes = (ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    assert alloc(4096, 0, None) == (1 << 20)
print("READY", flush=True)
'''

KVARENA = r'''
import sys, torch, kvarena
arenas = [kvarena.KvArena(64 << 20, "cpu") for _ in range(int(sys.argv[2]))]
print("READY", flush=True)
'''

WRAPPER = """#!/bin/sh
case " $* " in *" -E "*) ;; *.cpp*) echo x >> "{log}" ;; esac
exec "{real}" "$@"
"""


def _start(mode: str, procs: int, arenas: int, cache: Path, tmp: Path, cxx: Path, log: Path) -> tuple[int, float]:
    """One start of ``procs`` engine processes; returns (compiles, seconds to the last ready)."""
    if log.exists():
        log.unlink()
    env = dict(os.environ, PYTHONPATH=str(REPO), STUBCACHE_DIR=str(cache), CXX=str(cxx), ARENA_TMP=str(tmp),
               TORCH_EXTENSIONS_DIR=str(tmp / "torch_extensions"))
    env.pop("STUBCACHE_PATCH_TORCH", None)
    head = [sys.executable] if mode in ("torch", "kvarena") else [sys.executable, "-m", "stubcache", "run", "--", sys.executable]
    arg = "nopid" if mode == "run-nopid" else "pid"
    t0 = time.perf_counter()
    code = KVARENA if mode == "kvarena" else ARENA
    ps = [subprocess.Popen([*head, "-c", code, arg, str(arenas)], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for _ in range(procs)]
    for p in ps:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0 or "READY" not in out:
            raise SystemExit(f"{mode}: a process failed ({p.returncode}):\n{err[-3000:]}")
    seconds = time.perf_counter() - t0
    compiles = len(log.read_text().splitlines()) if log.exists() else 0
    return compiles, seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--arenas", type=int, default=3)
    ap.add_argument("--restarts", type=int, default=2, help="restarts measured after the cold start")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="engines_arena_"))
    try:
        cxx = work / "cxx.sh"
        log = work / "cxx.log"
        cxx.write_text(WRAPPER.format(log=log, real=shutil.which("c++") or "c++"))
        cxx.chmod(0o755)
        rows = []
        for mode in ("torch", "run-pid", "run-nopid", "kvarena"):
            cache = work / mode / "cache"
            tmp = work / mode / "tmp"
            tmp.mkdir(parents=True)
            cold = _start(mode, args.procs, args.arenas, cache, tmp, cxx, log)
            warm = [_start(mode, args.procs, args.arenas, cache, tmp, cxx, log) for _ in range(args.restarts)]
            rows.append((mode, cold, warm))
        base_cold = rows[0][1][1]
        base_warm = statistics.median(s for _, s in rows[0][2])
        print(f"P={args.procs} processes x A={args.arenas} arenas; {os.cpu_count()} CPUs; "
              f"command: python benchmarks/engines_arena.py --procs {args.procs} --arenas {args.arenas}")
        print("| mode | cold: compiles | cold: time to ready | restart: compiles | restart: time to ready (median) |")
        print("|---|---|---|---|---|")
        for mode, (cc, cs), warm in rows:
            wc = "/".join(str(c) for c, _ in warm)
            ws = statistics.median(s for _, s in warm)
            print(f"| {mode} | {cc} | {cs:.1f} s ({cs / base_cold:.2f}x) | {wc} | {ws:.1f} s ({ws / base_warm:.2f}x) |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
