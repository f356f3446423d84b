"""``stubcache ls --remote`` and ``stubcache prune --remote --max-age AGE``: the remote store's
blobs (docs/remote.md)."""

from __future__ import annotations

import argparse
import time

from ..remote.backend import RemoteUnavailable
from .common import confirm
from .exits import EXIT_OK, EXIT_PROBLEMS, Failed, UsageError
from .output import View, iso, note, short_compiler, show, table

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Iterator

    from ..remote.backend import RemoteBackend
    from ..remote.config import RemoteConfig

def _backend(args: argparse.Namespace) -> tuple[RemoteConfig, RemoteBackend]:
    from ..edge.settings import REMOTE
    from ..remote.config import RemoteConfigError, config_from_env
    from ..remote.tier import make_backend

    try:
        config = config_from_env(url=args.remote_url, timeout=args.remote_timeout, for_admin=True)
    except RemoteConfigError as exc:
        raise UsageError(str(exc)) from None
    if config is None:
        raise UsageError(f"no remote store: set {REMOTE} or pass --remote-url URL")
    return config, make_backend(config)


def _unavailable(config: RemoteConfig, exc: RemoteUnavailable) -> Failed:
    return Failed(f"remote store {config.display_url} unavailable: {exc}")


def cmd_ls_remote(args: argparse.Namespace) -> int:
    from ..admin.remote import list_entries
    from ..edge.units import human_age, human_size

    if args.filter:
        raise UsageError("--filter applies to local entries; with --remote use --name and --sort")
    config, backend = _backend(args)
    try:
        entries = list_entries(backend)
    except RemoteUnavailable as exc:
        raise _unavailable(config, exc) from None
    finally:
        backend.close()
    if args.name:
        import fnmatch

        entries = [e for e in entries if fnmatch.fnmatchcase(e.name, args.name)]
    order = {"key": lambda e: e.key, "name": lambda e: (e.name, e.key), "size": lambda e: (e.size, e.key),
             "created": lambda e: (e.created, e.key), "used": lambda e: (e.created, e.key)}
    entries.sort(key=order[args.sort], reverse=args.reverse)
    now = time.time()

    def text() -> Iterator[str]:
        rows = [[e.key if args.verbose else e.key[:12], e.name, human_size(e.size), e.torch or "-",
                 short_compiler(e.compiler), (human_age(now - e.created) + " ago") if e.created else "-",
                 "yes" if e.signed else "no", e.error or ""] for e in entries]
        if rows:
            yield table(["SPEC KEY", "NAME", "SIZE", "TORCH", "COMPILER", "CREATED", "SIGNED", "ERROR"], rows, right=(2,))
        if not args.quiet:
            yield (f"{len(entries)} blob{'' if len(entries) == 1 else 's'}, "
                   f"{human_size(sum(e.size for e in entries))} ({config.display_url})")

    show(args, View(
        json=lambda: [dict(e.to_json(), created_iso=iso(e.created)) for e in entries],
        # values as the remote store holds them (unlike local `ls`, not escaped)
        csv=(list(entries[0].to_json()) if entries else ["key"], (e.to_json() for e in entries)), csv_escape=False,
        text=text))
    return EXIT_OK


def cmd_prune_remote(args: argparse.Namespace) -> int:
    from ..admin.remote import execute_prune, list_entries, plan_prune
    from ..edge.units import human_size, parse_duration

    if not args.remote:
        raise UsageError("--max-age applies to the remote store: add --remote")
    if args.max_age is None:
        raise UsageError("prune --remote needs --max-age AGE (e.g. 30d); the remote store's size is "
                         "bounded by Redis itself (maxmemory + allkeys-lru, see docs/remote.md)")
    try:
        max_age = parse_duration(args.max_age)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    config, backend = _backend(args)
    try:
        plan = plan_prune(list_entries(backend), max_age, time.time())
        freed = sum(i.entry.size for i in plan)

        def view(executed: bool) -> View:
            def text() -> Iterator[str]:
                rows = [[i.entry.key[:12], i.entry.name, human_size(i.entry.size), i.reason]
                        + ([i.outcome or "-"] if executed else []) for i in plan]
                if rows and not args.quiet:
                    yield table(["SPEC KEY", "NAME", "SIZE", "REASON"] + (["OUTCOME"] if executed else []),
                                rows, right=(2,))

            return View(json=lambda: {"remote": config.display_url, "dry_run": args.dry_run,
                                      "items": [i.to_json() for i in plan]}, text=text)

        if args.dry_run or not plan:
            show(args, view(False))
            note(args, f"would remove {len(plan)} blob(s), {human_size(freed)} (dry run: nothing changed)"
                 if args.dry_run else "nothing to remove")
            return EXIT_OK
        if not args.yes:
            show(args, view(False))
            confirm(f"Remove {len(plan)} blob(s), {human_size(freed)}, from {config.display_url}?", args)
        execute_prune(backend, plan)
        show(args, view(True))
        failed = [i for i in plan if (i.outcome or "").startswith("failed")]
        note(args, f"removed {len(plan) - len(failed)} blob(s) from {config.display_url}")
        return EXIT_PROBLEMS if failed else EXIT_OK
    except RemoteUnavailable as exc:
        raise _unavailable(config, exc) from None
    finally:
        backend.close()
