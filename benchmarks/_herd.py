"""Herd launcher: start N real OS processes at once, each getting a stub, and time them.

    python benchmarks/_herd.py CONFIG.json      (prints one JSON document)

The launcher imports what the approach needs (``stubcache``, or ``torch.utils.cpp_extension`` as
an engine would have it imported already), then for each herd forks N children that block on a
pipe; one write releases them together (t0). With ``"engine": true`` the launcher imports
``torch.utils.cpp_extension`` first for any mode (engine processes, as the targets state them).
Each child gets and loads its stub, checks which variant it loaded (``bench_variant()``), and
reports when it was done. Nothing process-wide is computed in the launcher before the fork
(stubcache's fingerprint, torch's versioner are fresh).

Approaches (``mode``):
  stubcache   StubCache(root).load(spec)                    (root fresh per herd)
  private     load_inline into <base>/<pid>_<n>             (the SGLang pattern)
  shared      load_inline into one shared build directory   (torch's JIT cache)
  kvarena     A x KvArena(1 MiB, "cpu") over one StubCache  (scenario 5)
  per_arena   A x load_inline of a one-slot stub, each in its own <base>/<pid>_<a>  (scenario 5)
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time


def _work(cfg: dict, run: dict, variant: int) -> dict:
    mode = cfg["mode"]
    name = cfg["name"]
    src = cfg["sources"][str(variant)] if "sources" in cfg else None
    if mode == "stubcache":
        import stubcache

        cache = stubcache.StubCache(run["root"])
        lib = cache.load(stubcache.StubSpec(name, src, **cfg["kw"]))
        return {"variant": int(lib.bench_variant())}
    if mode in ("private", "shared"):
        import torch.utils.cpp_extension as ce

        if mode == "private":
            d = os.path.join(run["base"], f"{os.getpid()}_0")
            os.makedirs(d)
        else:
            d = run["dir"]
        path = ce.load_inline(name, src, build_directory=d, is_python_module=False, no_implicit_headers=True)
        return {"variant": int(ctypes.CDLL(path).bench_variant())}
    if mode == "kvarena":
        import stubcache
        from kvarena import KvArena

        cache = stubcache.StubCache(run["root"])
        arenas = [KvArena(1 << 20, "cpu", cache=cache) for _ in range(run["arenas"])]
        return {"arenas": len(arenas), "slots": sorted(a.slot for a in arenas)[-1] + 1}
    if mode == "per_arena":
        import torch.utils.cpp_extension as ce

        libs = []
        for a in range(run["arenas"]):
            d = os.path.join(run["base"], f"{os.getpid()}_{a}")
            os.makedirs(d)
            path = ce.load_inline(f"kvarena_arena_{a}", cfg["one_slot_source"], build_directory=d,
                                  is_python_module=False, no_implicit_headers=True)
            libs.append(ctypes.CDLL(path))
        return {"arenas": len(libs)}
    raise ValueError(mode)


def herd(cfg: dict, run: dict) -> dict:
    n = run["n"]
    variants = run.get("variants") or [0] * n
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(go_w)
                os.close(res_r)
                os.environ["BENCH_CXX_LOG"] = run["log"]
                os.read(go_r, 1)
                t_start, cpu = time.time(), time.process_time()
                try:
                    out = _work(cfg, run, variants[i])
                    out["expected"] = variants[i]
                except BaseException as exc:  # report, never hang the herd
                    out = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
                out["t_done"] = time.time()
                # Where a herd's time goes: when this child got the CPU after the release, its
                # own CPU time, and whether it ran the build path (imported the builder).
                out["t_start"], out["cpu"] = t_start, time.process_time() - cpu
                out["built"] = "stubcache.build.builder" in sys.modules
                os.write(res_w, (json.dumps(out) + "\n").encode())
                import threading

                for t in threading.enumerate():  # as interpreter exit would (a size-cap prune)
                    if t is not threading.main_thread() and not t.daemon:
                        t.join()
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(go_r)
    os.close(res_w)
    time.sleep(0.3 + 0.02 * n)  # let every child reach its read()
    t0 = time.time()
    os.write(go_w, b"x" * n)
    os.close(go_w)
    chunks = []
    while True:
        b = os.read(res_r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(res_r)
    for pid in pids:
        os.waitpid(pid, 0)
    results = [json.loads(ln) for ln in b"".join(chunks).decode().splitlines() if ln.strip()]
    done = [r["t_done"] - t0 for r in results]
    builders = [r["t_done"] - t0 for r in results if r.get("built")]
    errors = [r["error"] for r in results if "error" in r]
    wrong = sum(1 for r in results if "variant" in r and r["variant"] != r["expected"])
    compiles = 0
    try:
        with open(run["log"]) as fh:
            compiles = sum(1 for ln in fh if ln.strip())
    except FileNotFoundError:
        pass
    return {"n": n, "all_loaded": max(done) if done else None, "per_process": done, "wrong": wrong,
            "errors": errors, "reported": len(results), "compiles": compiles,
            "last_start": max(r["t_start"] - t0 for r in results) if results else None,
            "builder_done": min(builders) if builders else None,
            "cpu": [r["cpu"] for r in results if not r.get("built")]}


def main() -> None:
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    torch_only = cfg["mode"] in ("private", "shared", "per_arena")
    if torch_only or cfg.get("engine"):
        import torch.utils.cpp_extension  # noqa: F401  (an engine has torch imported already)
    if not torch_only:
        import stubcache  # noqa: F401
        if cfg["mode"] == "kvarena":
            import kvarena  # noqa: F401
    for mod in cfg.get("preload", []):  # diagnostics: pay lazy imports before the fork
        __import__(mod)
    out = [herd(cfg, run) for run in cfg["runs"]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
