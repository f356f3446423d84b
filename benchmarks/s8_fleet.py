"""Scenario 8: a fleet of H hosts x P processes starting cold at once, with and without the
remote tier (a real redis-server on loopback), and a remote hit on a cold host against a local
build of the same stub.

Hosts are separate cache roots; every process is a fresh interpreter that imports what an
engine has imported (stubcache; torch for the torch-header extension) and then waits for one
common start time. Compiles are counted fleet-wide by the CXX wrapper; wall time runs from the
start time until the last process has its library loaded. ``--quick`` runs the header-free
arena stub only, on a smaller fleet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from _common import (PY, REPO, STUB_NAME, Ctx, CxxWrapper, child_env, fmt_time, ratio, row, spec_kwargs, target,
                     variant_source)

SECRET = "bench-fleet-secret-0123456789abcdef"
TORCH_SRC = ("torch::Tensor add_const(torch::Tensor x) { return x + %d; }\n")

CHILD = r"""
import json, os, sys, time
kind = os.environ["BENCH_KIND"]
if kind == "torch":
    import torch  # an engine has torch loaded already
import stubcache
if os.environ.get("BENCH_REDIS_FIRST"):
    import redis  # diagnostic: the remote hit without the client's import
start = float(os.environ.get("START_AT", "0"))
while time.time() < start:
    time.sleep(0.0005)
t0 = time.perf_counter()
if kind == "arena":
    cache = stubcache.StubCache()
    lib = cache.load(stubcache.StubSpec(os.environ["BENCH_NAME"], os.environ["BENCH_SRC"],
                                        **json.loads(os.environ["BENCH_KW"])))
    value = int(lib.bench_variant())
else:
    mod = stubcache.load_inline(os.environ["BENCH_NAME"], os.environ["BENCH_SRC"], functions=["add_const"])
    value = int(mod.add_const(torch.zeros(1)).item())
print(json.dumps({"done": time.time(), "seconds": time.perf_counter() - t0, "value": value,
                  "redis": "redis" in sys.modules}))
"""


def _stub(kind: str, variant: int) -> tuple[str, str]:
    if kind == "arena":
        return STUB_NAME, variant_source(variant)
    return "bench_torch_ext", TORCH_SRC % variant


def _env(ctx: Ctx, kind: str, variant: int, root, log, remote: str | None, **extra) -> dict:
    name, src = _stub(kind, variant)
    env = child_env(CXX=str(ctx.cxx.path), BENCH_CXX_LOG=str(log), STUBCACHE_DIR=str(root), BENCH_KIND=kind,
                    BENCH_NAME=name, BENCH_SRC=src, BENCH_KW=json.dumps(spec_kwargs()), **extra)
    if remote:
        env.update(STUBCACHE_REMOTE=remote, STUBCACHE_REMOTE_SECRET=SECRET)
    return env


def _run_all(envs: list[dict], start_at: float | None, timeout: float = 1800) -> list[dict]:
    procs = []
    for env in envs:
        if start_at is not None:
            env = dict(env, START_AT=repr(start_at))
        procs.append(subprocess.Popen([PY, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"fleet child failed ({p.returncode}):\n{stderr[-4000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def fleet_start(ctx: Ctx, server, kind: str, hosts: int, procs: int, remote: bool, variant: int) -> tuple[float, int]:
    """Wall seconds until every process of a cold fleet has loaded, and compiles fleet-wide."""
    log = ctx.work / f"s8-cxx-{variant}-{int(remote)}.log"
    roots = [ctx.fresh_dir("s8-host") for _ in range(hosts)]
    envs = [_env(ctx, kind, variant, roots[h], log, server.url if remote else None)
            for h in range(hosts) for _ in range(procs)]
    start = time.time() + 1.0 + 0.25 * len(envs) + (3.0 if kind == "torch" else 0.0)  # all imported by then
    results = _run_all(envs, start)
    if any(r["value"] != variant for r in results):
        raise RuntimeError(f"a process loaded the wrong library: {[r['value'] for r in results]}")
    return max(r["done"] for r in results) - start, CxxWrapper.count(log)


def single(ctx: Ctx, kind: str, variant: int, remote: str | None, redis_first: bool = False) -> dict:
    """One get-and-load on a cold host (fresh root): its in-process ``seconds``, and whether the
    process imported the redis client (``redis``); ``redis_first``: with the client imported
    before the clock starts."""
    log = ctx.work / f"s8-single-{variant}.log"
    extra = {"BENCH_REDIS_FIRST": "1"} if redis_first else {}
    [r] = _run_all([_env(ctx, kind, variant, ctx.fresh_dir("s8-cold"), log, remote, **extra)], None)
    return r


def run(ctx: Ctx) -> dict:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # tests/redis_server.py starts the throwaway server
    try:
        from tests.redis_server import RedisServer, available
    except ImportError:  # benchmarks/ run from an installed tree without tests/
        available = lambda: False  # noqa: E731
    if not available():
        return {"id": 8, "title": "Fleet cold start with the remote tier (Redis)", "rows": [],
                "targets": [target("compiles fleet-wide = 1", "not measured", "1", None,
                                   "redis-server or the redis client not installed")],
                "notes": ["apt-get install redis-server && pip install -e '.[remote]' to run this scenario"]}
    hosts, procs = (2, 2) if ctx.quick else (3, 4)
    reps = ctx.reps(1, 3)
    kinds = ["arena"] if ctx.quick else ["arena", "torch"]
    rows, targets, notes = [], [], []
    with_client: dict[str, tuple[int, int]] = {}  # remote hits that imported the redis client, of all
    variant = 100
    with RedisServer("--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru") as server:
        compiles: dict[tuple, list[int]] = {}
        for kind in kinds:
            label = "arena stub (header-free)" if kind == "arena" else "torch-header extension"
            n = reps if kind == "arena" else 1
            walls: dict[bool, list[float]] = {False: [], True: []}
            for i in range(n):
                for remote in (True, False):
                    variant += 1  # a new key every time: every run is cold for the whole fleet
                    if kind == "torch":
                        ctx.log(f"s8: {hosts}x{procs} fleet, torch-header extension, "
                                f"{'with' if remote else 'without'} the remote tier (~40 s per compile)")
                    w, c = fleet_start(ctx, server, kind, hosts, procs, remote, variant)
                    walls[remote].append(w)
                    compiles.setdefault((kind, remote), []).append(c)
            for remote in (False, True):
                rows.append(row(f"fleet {hosts}x{procs} cold, {label}",
                                "stubcache + remote tier" if remote else "stubcache, local only",
                                walls[remote], compiles=compiles[(kind, remote)]))
            worst = max(compiles[(kind, True)])
            targets.append(target(f"compiles fleet-wide = 1 ({label})",
                                  f"{worst} (local only: {max(compiles[(kind, False)])})", "1", worst == 1))
        # remote hit on a cold host against a local build of the same stub
        for kind in kinds:
            label = "arena stub (header-free)" if kind == "arena" else "torch-header extension"
            variant += 1
            n_hit, n_build = (ctx.reps(3, 5), ctx.reps(3, 5)) if kind == "arena" else (5, 1)
            if kind == "torch":
                ctx.log("s8: torch-header extension, one local build (~40 s) against remote hits")
            builds = [single(ctx, kind, variant, None)["seconds"] for _ in range(n_build)]
            single(ctx, kind, variant, server.url)  # a builder host uploads it
            hit_runs = [single(ctx, kind, variant, server.url) for _ in range(n_hit)]
            hits = [h["seconds"] for h in hit_runs]
            with_client[label] = (sum(bool(h["redis"]) for h in hit_runs), len(hit_runs))
            rows.append(row(f"cold host, {label}", "local build (no remote)", builds))
            rows.append(row(f"cold host, {label}", "remote hit (download, verify, publish, load)", hits))
            b, h = rows[-2]["median"], rows[-1]["median"]
            if kind == "arena":  # where a remote hit goes: all but the client's import
                rest = [single(ctx, kind, variant, server.url, redis_first=True)["seconds"] for _ in range(n_hit)]
                rows.append(row(f"cold host, {label} (part)", "remote hit, the redis client imported before the clock",
                                rest))
            r = ratio(b, h)
            if kind == "torch":
                targets.append(target("remote hit of the torch-header extension ≥ 50× faster than building it",
                                      f"{r:.0f}× ({fmt_time(h)} vs {fmt_time(b)})", "≥ 50×", r is not None and r >= 50))
            else:
                rh = ratio(h, b)
                targets.append(target("fleet: remote hit of a header-free stub on a cold host ≤ 0.5× building it locally",
                                      f"{rh:.2f}× ({fmt_time(h)} vs {fmt_time(b)})", "≤ 0.5×",
                                      rh is not None and rh <= 0.5, headline="4"))
        if ctx.quick:
            targets.append(target("remote hit of the torch-header extension ≥ 50× faster than building it",
                                  "not measured", "≥ 50×", None, "skipped in --quick (a ~40 s torch-header build)"))
    notes.append(f"redis-server on loopback, maxmemory 256mb allkeys-lru; hosts are separate cache roots on one "
                 f"{os.cpu_count()}-CPU machine, so the local-only fleet's compiles compete for the same cores "
                 "(on real hosts they run in parallel: compare compiles, and wall time only with that in mind).")
    notes.append("a remote hit on a redis:// URL fetches through stubcache's own protocol reader "
                 "(stubcache.remote.resp) and does not import the redis client; remote hits that imported it: " +
                 ", ".join(f"{k} {n} of {m}" for k, (n, m) in with_client.items()) +
                 ". The (part) row imports the client before the clock anyway (it also brings socket, json "
                 "and the other modules a fetch uses): what is left of the difference is those.")
    return {"id": 8, "title": "Fleet cold start with the remote tier (Redis)", "rows": rows, "targets": targets,
            "notes": notes}
