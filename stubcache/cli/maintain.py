"""Commands that check or change a root: ``prune``, ``clear``, ``verify``, ``doctor``, ``init``,
``config``. ``prune --dry-run`` never imports torch; removals are a printed plan, then its
execution (stubcache.admin.prune)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Iterator

from .common import confirm, match_key
from .common import root as _root
from .common import store as _store
from .exits import EXIT_OK, EXIT_PROBLEMS, Failed, UsageError
from .output import View, err, is_text, note, out, show, table

if TYPE_CHECKING:
    from ..admin.audit import AuditResult
    from ..admin.prune import PrunePlan, PrunePolicy
    from ..admin.sizecap import CapSetting
    from ..storage.store import Store

# --- prune / clear ---------------------------------------------------------------------------


def _plan_rows(plan: PrunePlan, executed: bool) -> tuple[list[str], list[list[Any]]]:
    from ..edge.units import human_size

    headers = ["ACTION", "KIND", "NAME", "ENTRY KEY", "SIZE", "REASON"]
    if executed:
        headers.append("OUTCOME")
    rows = []
    for i in plan.items:
        row = [i.action, i.kind, i.name if i.kind == "entry" else i.name[:40], (i.key or "-")[:12],
               human_size(i.size), i.reason]
        if executed:
            row.append(i.outcome or "-")
        rows.append(row)
    return headers, rows


def _plan_view(plan: PrunePlan, args: argparse.Namespace, executed: bool, dry_run: bool) -> View:
    def text() -> Iterator[str]:
        from ..edge.units import human_size

        headers, rows = _plan_rows(plan, executed)
        if rows and not (args.quiet and not executed):
            yield table(headers, rows, right=(4,))
        s = plan.summary()
        if args.quiet:
            return
        if not executed and not dry_run and not s['planned_removals']:
            yield f"nothing to remove; {s['skipped']} skipped"
        elif not executed:
            yield (f"{'would remove' if dry_run else 'plan: remove'} {s['planned_removals']} item(s), "
                   f"freeing {human_size(s['planned_bytes'])}; {s['skipped']} skipped"
                   + (" (dry run: nothing changed)" if dry_run else ""))
        else:
            yield (f"removed {s['removed']} item(s), freed {human_size(s['bytes_freed'])}; "
                   f"{s['skipped'] + s['in_use_at_removal']} kept because in use or live")
        if plan.max_size is not None and not plan.target_reached:
            err(f"entries still total {human_size(plan.entry_size_after)} > --max-size "
                f"{human_size(plan.max_size)}: the rest is in use by live processes")

    return View(json=lambda: dict(plan.to_json(), dry_run=dry_run), text=text)


def _run_plan(args: argparse.Namespace, policy: PrunePolicy) -> int:
    from ..admin.prune import current_fingerprint, plan_prune
    from ..admin.scan import scan_cache

    store = _store(args)
    if not os.path.isdir(store.base):
        show(args, View(json={"summary": {"planned_removals": 0, "removed": 0}, "items": [], "dry_run": args.dry_run},
                        text=lambda: [] if args.quiet else [f"nothing to do: no cache at {store.root}"]))
        return EXIT_OK
    scan = scan_cache(store)
    fp = None
    if policy.toolchain_mismatch:
        fp = current_fingerprint(store, need_cuda=any("cuda" in e.fingerprint for e in scan.entries))
    plan = plan_prune(scan, policy, fp)
    executed = _confirm_and_execute(args, store, plan)
    if executed or not args.dry_run:
        _compact_events(args, store, policy)
    failed = [i for i in plan.items if i.outcome and i.outcome.startswith("failed")]
    return EXIT_PROBLEMS if failed else EXIT_OK


def _confirm_and_execute(args: argparse.Namespace, store: Store, plan: PrunePlan) -> bool:
    """Show the plan (a dry run, or nothing to remove: that is all), ask unless ``--yes``, carry
    it out and show the outcome. Returns whether it was carried out."""
    from ..admin.prune import execute_plan

    if args.dry_run or not plan.removals:
        show(args, _plan_view(plan, args, executed=False, dry_run=args.dry_run))
        return False
    if not args.yes:
        if is_text(args):  # the plan to confirm; JSON prints only the outcome
            show(args, _plan_view(plan, args, executed=False, dry_run=False))
        from ..edge.units import human_size

        confirm(f"Remove {len(plan.removals)} item(s), {human_size(plan.bytes_to_free)}?", args)
    from ..edge.progress import Bar

    with Bar("removing") as bar:
        execute_plan(store, plan, progress=bar)
    show(args, _plan_view(plan, args, executed=True, dry_run=False))
    return True


def _compact_events(args: argparse.Namespace, store: Store, policy: PrunePolicy) -> None:
    """Part of removing leftovers: one archive instead of an event file per finished process."""
    if not policy.leftovers or not os.path.isdir(store.path("events")):
        return
    from ..admin.stats import compact_events

    merged = compact_events(store.path("events"), store.lock_path("events-compact"), store.mode(0o600, 0o660))
    if merged:
        note(args, f"merged the event files of {merged} finished processes into one archive")


def cmd_prune(args: argparse.Namespace) -> int:
    if args.remote or args.max_age is not None:
        from .remote import cmd_prune_remote

        return cmd_prune_remote(args)
    from ..admin.prune import PrunePolicy
    from ..edge.units import parse_duration, parse_size

    try:
        policy = PrunePolicy(
            max_size=parse_size(args.max_size) if args.max_size is not None else None,
            older_than=parse_duration(args.older_than) if args.older_than is not None else None,
            toolchain_mismatch=args.toolchain_mismatch,
            leftovers=not args.no_leftovers,
            quarantine_age=parse_duration(args.quarantine_age),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return _run_plan(args, policy)


def cmd_clear(args: argparse.Namespace) -> int:
    from ..admin.prune import PrunePolicy

    rc = _run_plan(args, PrunePolicy(everything=True, leftovers=True))
    if rc == EXIT_OK and args.stats and not args.dry_run:
        from .inspect import reset_view

        view = reset_view(_store(args), args)  # the same reset as `stats --reset`
        if view is not None and view.text is not None:
            for line in view.text():
                note(args, line)
    return rc


def cmd_rm(args: argparse.Namespace) -> int:
    """``rm KEY…|--name GLOB``: remove the named entries, with prune's safety (never one in use).
    Exit 2 for a KEY that names nothing or is ambiguous, 1 if a named entry was not removed
    (in use, being published, or a removal failed)."""
    import fnmatch
    import time

    from ..admin.prune import plan_removal
    from ..admin.scan import CacheScan, scan_entries

    if not args.keys and args.name is None:
        raise UsageError("rm needs one or more KEYs (spec keys or entry keys, or unique prefixes) or --name GLOB")
    store = _store(args)
    entries = scan_entries(store) if os.path.isdir(store.base) else []
    asked: dict[str, str] = {}
    for ref in args.keys:
        m = match_key(ref, entries, store.root)
        for k in m.entries:
            asked.setdefault(k, f"asked: {m.kind} {m.key[:12]}")
    if args.name is not None:
        named = [e.key for e in entries if fnmatch.fnmatchcase(e.name, args.name)]
        if not named:
            note(args, f"no entry's name matches {args.name!r}")
        for k in named:
            asked.setdefault(k, f"asked: name matches {args.name!r}")
    plan = plan_removal(CacheScan(store.root, time.time(), entries, []), asked)
    executed = _confirm_and_execute(args, store, plan)
    if not executed:
        return EXIT_PROBLEMS if plan.skipped and not args.dry_run else EXIT_OK
    kept = [i for i in plan.items if i.outcome not in ("removed", "gone")]
    return EXIT_PROBLEMS if kept else EXIT_OK


# --- verify ----------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from ..admin.verify import verify_store

    if args.rebuild:
        return _verify_rebuild(args)
    if args.keys or args.sample is not None:
        raise UsageError("KEY arguments and --sample go with --rebuild")
    from ..edge.progress import Bar

    store = _store(args)
    with Bar("verifying") as bar:
        results = verify_store(store, quarantine=not args.dry_run, progress=bar)
    bad = [r for r in results if r.status == "bad"]

    def text() -> Iterator[str]:
        shown = results if args.verbose else bad
        if shown:
            rows = [[r.key[:12] if not args.verbose else r.key, r.name, r.status,
                     r.detail + (" -> quarantined" if r.quarantined_to else "")] for r in shown]
            yield table(["ENTRY KEY", "NAME", "STATUS", "DETAIL"], rows)
        if not args.quiet:
            verb = "found" if args.dry_run else "quarantined"
            yield (f"checked {len(results)} entr{'y' if len(results) == 1 else 'ies'}: "
                   f"{len(results) - len(bad)} ok, {len(bad)} bad" + (f" ({verb})" if bad else ""))

    show(args, View(json=lambda: {"checked": len(results), "bad": len(bad), "dry_run": args.dry_run,
                                  "results": [r.to_json() for r in results]}, text=text))
    return EXIT_PROBLEMS if bad else EXIT_OK


def _verify_rebuild(args: argparse.Namespace) -> int:
    """``verify --rebuild``: rebuild entries privately and compare bytes (see stubcache.admin.audit)."""
    from ..admin.audit import UNCOVERED, rebuild_entry, select_keys

    if args.sample is not None and args.sample < 1:
        raise UsageError("--sample must be at least 1")
    store = _store(args)
    wanted: list[str] = []
    if args.keys:  # spec keys or entry keys, or unique prefixes: the entries they name
        from ..admin.scan import scan_entries

        entries = scan_entries(store, probe_in_use=False)
        for ref in args.keys:
            wanted += [k for k in match_key(ref, entries, store.root).entries if k not in wanted]
    try:
        keys = select_keys(store, wanted, args.sample)
    except KeyError as exc:  # an entry removed since the scan
        raise UsageError(f"no single entry for key {exc.args[0]}") from None
    from ..edge.progress import status

    results: list[AuditResult] = []
    for key in keys:  # one rebuild can take a minute (torch headers): a live line on a terminal
        with status(lambda: f"verify --rebuild: rebuilding {key[:12]} ({len(results) + 1} of {len(keys)})"):
            results.append(rebuild_entry(store, key))
    differs = [r for r in results if r.status == "differs"]

    def text() -> Iterator[str]:
        import json

        rows = [[r.key if args.verbose else r.key[:12], r.name, r.status, r.detail] for r in results
                if args.verbose or r.status != "same"]
        if rows:
            yield table(["ENTRY KEY", "NAME", "STATUS", "DETAIL"], rows)
        for r in differs:
            yield (f"\n{r.key} ({r.name}): {UNCOVERED}: a rebuild now gives sha256 {r.rebuilt_sha256}, the entry "
                   f"holds {r.sha256}. Its pre-image:")
            yield json.dumps(r.preimage, indent=1, sort_keys=True)
        if not args.quiet:
            counts = {s: sum(1 for r in results if r.status == s) for s in ("same", "differs", "skipped", "failed")}
            yield (f"rebuilt {len(results)} entr{'y' if len(results) == 1 else 'ies'}: "
                   + ", ".join(f"{n} {s}" for s, n in counts.items()))

    show(args, View(json=lambda: {"checked": len(results), "differs": len(differs),
                                  "results": [r.to_json() for r in results]}, text=text))
    return EXIT_PROBLEMS if differs else EXIT_OK


# --- doctor, init, config --------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..admin.doctor import fix_permissions, run_checks

    if args.remote_url is not None:  # the remote checks read the environment
        os.environ["STUBCACHE_REMOTE"] = args.remote_url
    if args.remote_timeout is not None:
        os.environ["STUBCACHE_REMOTE_TIMEOUT"] = args.remote_timeout

    root = _root(args)
    if args.fix and os.path.isdir(root):
        for line in fix_permissions(root):
            out(f"fixed: {line}")
    checks = run_checks(root)
    errors = [c for c in checks if c.status == "error"]

    def text() -> Iterator[str]:
        yield f"cache root: {root}"
        for c in checks:
            if args.quiet and c.status == "ok":
                continue
            yield f"[{c.status:^5}] {c.name}: {c.detail}"
            if c.fix and c.status != "ok":
                yield f"        fix: {c.fix}"

    show(args, View(json=lambda: {"root": root, "checks": [c.to_json() for c in checks], "errors": len(errors),
                                  "warnings": sum(1 for c in checks if c.status == "warn")}, text=text))
    return EXIT_PROBLEMS if errors else EXIT_OK


def cmd_init(args: argparse.Namespace) -> int:
    from ..admin.shared import init_root

    root = os.path.abspath(args.dir) if args.dir else _root(args)
    if args.shared and not args.group:
        raise UsageError("--shared needs --group GROUP (the group whose members may publish)")
    if args.group and not args.shared:
        raise UsageError("--group only makes sense with --shared")
    try:
        done = init_root(root, args.group if args.shared else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    show(args, View(json={"root": root, "shared": bool(args.shared), "group": args.group, "actions": done},
                    text=lambda: done))
    return EXIT_OK


def cmd_config(args: argparse.Namespace) -> int:
    from ..edge.errors import TrustError
    from ..admin.sizecap import effective_cap, env_cap, root_cap, root_settings, set_setting
    from ..edge.settings import DEFAULT_TOOLCHAIN_MAX_AGE, MAX_SIZE, NO_CAP, ROOT_SETTINGS
    from ..edge.units import human_age, human_size

    root = _root(args)
    if args.action in ("set", "unset"):
        if args.name not in ROOT_SETTINGS:
            raise UsageError(f"config {args.action} needs a setting name: {', '.join(ROOT_SETTINGS)}")
        if (args.action == "set") != (args.value is not None):
            raise UsageError("usage: stubcache config set NAME VALUE | stubcache config unset NAME")
        if not os.path.isdir(root):
            raise UsageError(f"no cache at {root}; create it first with `stubcache init`")
        try:
            set_setting(root, args.name, args.value)
        except ValueError as exc:
            raise UsageError(f"{args.name}: {exc}") from None
        except (PermissionError, TrustError) as exc:
            raise Failed(str(exc)) from None
    try:
        stored = root_settings(root) if os.path.isdir(root) else {}
        env = env_cap()
    except (ValueError, TrustError) as exc:
        raise Failed(str(exc)) from None
    rootc = root_cap(stored)
    cap = effective_cap(env, rootc)
    age = stored.get("toolchain_max_age", DEFAULT_TOOLCHAIN_MAX_AGE)

    def size(v: int | None) -> str:
        return "-" if v is None else f"{human_size(v)} ({v} bytes)"

    def given(c: CapSetting) -> str:
        return size(c.limit) if not c.given or c.limit is not None else NO_CAP

    def json_value(c: CapSetting) -> int | str | None:
        return c.limit if not c.given or c.limit is not None else NO_CAP

    source = {"default": f"default (no setting; `{NO_CAP}` turns it off)", "off": f"{NO_CAP}: no automatic cap",
              "the smaller of the two": "the smaller of the two below"}.get(cap.source, cap.source)

    def text() -> Iterator[str]:
        yield f"cache root: {root}"
        yield table(["SETTING", "VALUE", "FROM"], [
            ["max_size", size(cap.limit) if cap.limit is not None else NO_CAP, source],
            ["  root config max_size", given(rootc), f"stubcache config set max_size SIZE|{NO_CAP}"],
            [f"  {MAX_SIZE}", given(env), "environment"],
            ["toolchain_max_age", human_age(age), "root config" if "toolchain_max_age" in stored else "default"],
        ])

    show(args, View(json={"root": root, "max_size": cap.limit, "max_size_from": cap.source,
                          "root_max_size": json_value(rootc), "env_max_size": json_value(env),
                          "toolchain_max_age": age}, text=text))
    return EXIT_OK
