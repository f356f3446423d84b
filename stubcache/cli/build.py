"""Commands that get stubs built: ``warm`` builds them now, ``run`` starts a program whose
torch JIT builds go through the cache."""

from __future__ import annotations

import argparse
import os
import time

from .common import root as _root
from .exits import EXIT_NOT_RUN, EXIT_OK, EXIT_PROBLEMS, NotRun, UsageError
from .output import View, out, problem, show, table

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any


def cmd_warm(args: argparse.Namespace) -> int:
    from ..edge.errors import StubCacheError
    from ..admin.specref import SpecRefError, load_specs

    specs = []
    for ref in args.refs:
        try:
            specs += [(ref, s) for s in load_specs(ref)]
        except SpecRefError as exc:
            raise UsageError(str(exc)) from None
    os.environ.pop("STUBCACHE_REQUIRE_HIT", None)  # warming is how a require-hit cache gets filled
    from ..hit.front import StubCache

    cache = StubCache(_root(args))
    from ..edge.progress import Bar

    results: list[dict[str, Any]] = []
    bar = Bar("warming")
    for ref, spec in specs:
        bar(len(results), len(specs))
        t0 = time.perf_counter()
        try:
            found = cache.lookup(spec)
            entry = found if found is not None else cache.get_or_build(spec)
            if found is not None:
                status = "cached"
            elif not entry.published:
                status = "not stored"
            else:  # new here: downloaded from the fleet tier, or compiled on this host
                status = "fetched" if entry.fetched else "built"
            results.append({"ref": ref, "name": spec.name, "key": entry.key, "status": status,
                            "seconds": round(time.perf_counter() - t0, 3), "path": entry.path})
            if not entry.published:
                problem(args, f"{spec.name}: built, but could not be stored in the cache at {cache.root} (it was "
                              "built privately; see the warning above and `stubcache doctor`)")
        except StubCacheError as exc:
            results.append({"ref": ref, "name": spec.name, "key": None, "status": "failed",
                            "seconds": round(time.perf_counter() - t0, 3), "error": str(exc)})
            problem(args, f"{spec.name}: {exc}")
    bar.__exit__()
    failed = [r for r in results if r["status"] in ("failed", "not stored")]
    show(args, View(json={"root": cache.root, "results": results, "failed": len(failed)},
                    text=lambda: [] if args.quiet else [table(
                        ["NAME", "ENTRY KEY", "STATUS", "TIME"],
                        [[r["name"], (r["key"] or "-")[:12], r["status"], f"{r['seconds']:.2f}s"] for r in results])]))
    return EXIT_PROBLEMS if failed else EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    import shlex

    from ..admin.run import exec_command, run_environment

    if args.cache_dir:
        os.environ["STUBCACHE_DIR"] = os.path.abspath(args.cache_dir)
    if args.env:
        env = run_environment()
        if args.cache_dir:  # `run -- CMD` passes it: the service file needs it too
            env = {"STUBCACHE_DIR": os.environ["STUBCACHE_DIR"], **env}
        for k, v in env.items():
            out(f"export {k}={shlex.quote(v)}")
        return EXIT_OK
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("run needs a command: stubcache run -- python serve.py ...")
    try:
        exec_command(cmd)
    except OSError as exc:
        raise NotRun(f"cannot run {cmd[0]!r}: {exc.strerror or exc}") from None
    return EXIT_NOT_RUN  # not reached: exec replaced this process
