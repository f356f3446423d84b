"""``stubcache ls --remote`` and ``stubcache prune --remote --max-age AGE``."""

from __future__ import annotations

import argparse
import csv
import io
import sys
import time

from .. import cli
from .backend import RemoteUnavailable


def _backend(args: argparse.Namespace):
    from .config import ENV_URL, RemoteConfigError, config_from_env
    from .tier import make_backend

    try:
        config = config_from_env(url=args.remote_url, timeout=args.remote_timeout, for_admin=True)
    except RemoteConfigError as exc:
        raise cli.UsageError(str(exc)) from None
    if config is None:
        raise cli.UsageError(f"no remote store: set {ENV_URL} or pass --remote-url URL")
    return config, make_backend(config)


def _unavailable(config, exc: RemoteUnavailable) -> int:
    cli._err(f"remote store {config.display_url} unavailable: {exc}")
    return cli.EXIT_PROBLEMS


def cmd_ls_remote(args: argparse.Namespace) -> int:
    from ..units import human_age, human_size
    from .admin import list_entries

    if args.filter:
        raise cli.UsageError("--filter applies to local entries; with --remote use --name and --sort")
    config, backend = _backend(args)
    try:
        entries = list_entries(backend)
    except RemoteUnavailable as exc:
        return _unavailable(config, exc)
    finally:
        backend.close()
    if args.name:
        import fnmatch

        entries = [e for e in entries if fnmatch.fnmatchcase(e.name, args.name)]
    order = {"key": lambda e: e.key, "name": lambda e: (e.name, e.key), "size": lambda e: (e.size, e.key),
             "created": lambda e: (e.created, e.key), "used": lambda e: (e.created, e.key)}
    entries.sort(key=order[args.sort], reverse=args.reverse)
    now = time.time()
    if args.format == "json":
        cli._json([dict(e.to_json(), created_iso=cli._iso(e.created)) for e in entries])
    elif args.format == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(entries[0].to_json()) if entries else ["key"], lineterminator="\n")
        w.writeheader()
        for e in entries:
            w.writerow(e.to_json())
        sys.stdout.write(buf.getvalue())
    else:
        rows = [[e.key if args.verbose else e.key[:12], e.name, human_size(e.size), e.torch or "-",
                 cli._short_compiler(e.compiler), (human_age(now - e.created) + " ago") if e.created else "-",
                 "yes" if e.signed else "no", e.error or ""] for e in entries]
        if rows:
            cli._out(cli._table(["KEY", "NAME", "SIZE", "TORCH", "COMPILER", "CREATED", "SIGNED", "ERROR"],
                                rows, right=(2,)))
        if not args.quiet:
            cli._out(f"{len(entries)} blob{'' if len(entries) == 1 else 's'}, "
                     f"{human_size(sum(e.size for e in entries))} ({config.display_url})")
    return cli.EXIT_OK


def cmd_prune_remote(args: argparse.Namespace) -> int:
    from ..units import human_size, parse_duration
    from .admin import execute_prune, list_entries, plan_prune

    if not args.remote:
        raise cli.UsageError("--max-age applies to the remote store: add --remote")
    if args.max_age is None:
        raise cli.UsageError("prune --remote needs --max-age AGE (e.g. 30d); the remote store's size is "
                             "bounded by Redis itself (maxmemory + allkeys-lru, see docs/remote.md)")
    try:
        max_age = parse_duration(args.max_age)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None
    config, backend = _backend(args)
    try:
        plan = plan_prune(list_entries(backend), max_age, time.time())
        freed = sum(i.entry.size for i in plan)

        def show(executed: bool) -> None:
            if args.format == "json":
                cli._json({"remote": config.display_url, "dry_run": args.dry_run,
                           "items": [i.to_json() for i in plan]})
                return
            rows = [[i.entry.key[:12], i.entry.name, human_size(i.entry.size), i.reason]
                    + ([i.outcome or "-"] if executed else []) for i in plan]
            if rows and not args.quiet:
                cli._out(cli._table(["KEY", "NAME", "SIZE", "REASON"] + (["OUTCOME"] if executed else []),
                                    rows, right=(2,)))

        if args.dry_run or not plan:
            show(False)
            if args.format != "json" and not args.quiet:
                cli._out(f"would remove {len(plan)} blob(s), {human_size(freed)} (dry run: nothing changed)"
                         if args.dry_run else "nothing to remove")
            return cli.EXIT_OK
        if not args.yes:
            show(False)
            if not cli._confirm(f"Remove {len(plan)} blob(s), {human_size(freed)}, from {config.display_url}?", args):
                cli._err("aborted; nothing removed")
                return cli.EXIT_ABORTED
        execute_prune(backend, plan)
        show(True)
        failed = [i for i in plan if (i.outcome or "").startswith("failed")]
        if args.format != "json" and not args.quiet:
            cli._out(f"removed {len(plan) - len(failed)} blob(s) from {config.display_url}")
        return cli.EXIT_PROBLEMS if failed else cli.EXIT_OK
    except RemoteUnavailable as exc:
        return _unavailable(config, exc)
    finally:
        backend.close()
