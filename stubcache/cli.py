"""The ``stubcache`` command line (also ``python -m stubcache``).

Commands: ``ls``, ``stats``, ``prune``, ``verify``, ``explain``, ``clear``, ``warm``, ``doctor``,
``dir``. See ``docs/cli.md``. ``ls``, ``stats`` and ``prune --dry-run`` never import torch.

Exit codes:
    0  success
    1  the command ran and found problems (verify: bad entries; doctor: errors; warm: a build
       failed; prune/clear: a removal failed)
    2  usage error (bad option, bad filter, unreadable spec file, unknown key)
    3  not confirmed (answered no, or no terminal and no ``--yes``)
    127 run: the command could not be started
    130 interrupted
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import json
import logging
import os
import re
import sys
import time
from typing import Any, Callable, Sequence

from .errors import StubCacheError

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_ABORTED = 3
EXIT_INTERRUPTED = 130
EXIT_NOT_RUN = 127  # `run`: the command could not be started (as a shell says)


class UsageError(Exception):
    """Bad input from the user: printed without a traceback, exit 2."""


# --- output helpers --------------------------------------------------------------------------


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _err(text: str) -> None:
    sys.stderr.write(f"stubcache: {text}\n")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain text table; columns in ``right`` are right-aligned. Cells are escaped: names and
    values come from files that someone else may have written (no terminal control sequences)."""
    from .fsroot import printable

    cells = [[str(c) for c in headers]] + [[printable(c, 4000) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [(c.rjust(w) if i in right else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _json(obj: Any) -> None:
    _out(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _iso(t: float | None) -> str | None:
    if not t:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def _short_compiler(line: str | None) -> str:
    """``x86_64-linux-gnu-g++-12 (Debian 12.2.0-14) 12.2.0`` -> ``gcc 12.2.0``."""
    if not line:
        return "-"
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)\s*$", line) or re.search(r"version (\d+\.\d+(?:\.\d+)?)", line)
    version = m.group(1) if m else ""
    low = line.lower()
    family = ("clang" if "clang" in low else "gcc" if ("g++" in low or "gcc" in low) else
              "nvcc" if "nvcc" in low else line.split()[0][-16:])
    return f"{family} {version}".strip()


# --- common plumbing -------------------------------------------------------------------------


def _root(args: argparse.Namespace) -> str:
    if getattr(args, "cache_dir", None):
        return os.path.abspath(os.path.expanduser(args.cache_dir))
    from .store import default_root

    return default_root()


def _store(args: argparse.Namespace):
    """The Store of the selected root, told whether the root is shared (so files it creates get
    group modes); a root whose config fails the trust checks is treated as private."""
    from .errors import TrustError
    from .store import Store
    from .trust import load_policy

    store = Store(_root(args))
    try:
        store.shared = load_policy(store.root).shared
    except TrustError:
        store.shared = False
    return store


def _confirm(prompt: str, args: argparse.Namespace) -> bool:
    """True if ``--yes`` was given or the user says yes on a terminal; raises on no terminal."""
    if getattr(args, "yes", False):
        return True
    if not sys.stdin.isatty():
        raise _NotConfirmed("stdin is not a terminal; pass --yes to proceed without confirmation")
    sys.stderr.write(f"{prompt} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    return answer in ("y", "yes")


class _NotConfirmed(Exception):
    pass


# --- ls --------------------------------------------------------------------------------------

_FILTER_RE = re.compile(r"\s*([a-z_]+)\s*(>=|<=|!=|==|=|>|<)\s*(.*?)\s*\Z")
_FILTER_FIELDS = ("size", "accessed", "used", "created", "age", "name", "torch", "method", "in_use", "key")


def parse_filter(text: str) -> Callable[[Any, float], bool]:
    """``size>1M``, ``accessed>30d`` (not used for 30 days), ``created<2h``, ``name=alloc*``,
    ``torch=2.13.0+cpu``, ``method=direct``, ``in_use=yes``, ``key=ab12*``."""
    from .units import parse_duration, parse_size

    m = _FILTER_RE.match(text)
    if not m or m.group(1) not in _FILTER_FIELDS:
        raise UsageError(f"bad filter {text!r}: use FIELD OP VALUE with FIELD one of "
                         f"{', '.join(_FILTER_FIELDS)} and OP one of > < >= <= = !=")
    fld, op, raw = m.groups()
    op = "=" if op == "==" else op
    try:
        if fld == "size":
            value: Any = parse_size(raw)
            get: Callable[[Any, float], Any] = lambda e, now: e.size
        elif fld in ("accessed", "used"):
            value = parse_duration(raw)
            get = lambda e, now: now - e.last_used
        elif fld in ("created", "age"):
            value = parse_duration(raw)
            get = lambda e, now: now - e.created
        elif fld == "in_use":
            value = raw.lower() in ("1", "yes", "true", "y")
            get = lambda e, now: bool(e.in_use)
        else:
            value = raw
            attr = {"method": "build_method"}.get(fld, fld)
            get = lambda e, now: str(getattr(e, attr) or "")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if isinstance(value, str):
        if op not in ("=", "!="):
            raise UsageError(f"filter {text!r}: {fld} only supports = and != (with * wildcards)")
        want = op == "="
        return lambda e, now: fnmatch.fnmatchcase(get(e, now), value) == want
    ops = {">": lambda a, b: a > b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b,
           "<=": lambda a, b: a <= b, "=": lambda a, b: a == b, "!=": lambda a, b: a != b}
    fn = ops[op]
    return lambda e, now: fn(get(e, now), value)


_SORTS = {
    "key": lambda e: e.key, "name": lambda e: (e.name, e.key), "size": lambda e: (e.size, e.key),
    "created": lambda e: (e.created, e.key), "used": lambda e: (e.last_used, e.key),
}


def _ls_rows(entries, now: float, verbose: bool) -> tuple[list[str], list[list[Any]]]:
    from .units import human_age, human_size

    headers = ["KEY", "NAME", "SIZE", "TORCH", "COMPILER", "CREATED", "LAST USED", "IN USE"]
    if verbose:
        headers += ["METHOD", "BUILD"]
    rows = []
    for e in entries:
        row = [e.key if verbose else e.key[:12], e.name, human_size(e.size), e.torch or "-",
               _short_compiler(e.compiler), human_age(now - e.created) + " ago",
               human_age(now - e.last_used) + " ago",
               "yes" if e.in_use else ("no" if e.in_use is not None else "?")]
        if e.error:
            row[3:5] = ["-", f"BROKEN: {e.error}"]
        if verbose:
            row += [e.build_method or "-", f"{e.build_seconds:.2f}s"]
        rows.append(row)
    return headers, rows


def cmd_ls(args: argparse.Namespace) -> int:
    if args.remote:
        from .remote.commands import cmd_ls_remote

        return cmd_ls_remote(args)
    from .scan import scan_entries

    store = _store(args)
    filters = [parse_filter(f) for f in args.filter or []]
    now = time.time()
    entries = scan_entries(store, probe_in_use=not args.no_probe)
    if args.name:
        entries = [e for e in entries if fnmatch.fnmatchcase(e.name, args.name)]
    entries = [e for e in entries if all(f(e, now) for f in filters)]
    entries.sort(key=_SORTS[args.sort], reverse=args.reverse)
    if args.format == "json":
        _json([dict(e.to_json(), created_iso=_iso(e.created), last_used_iso=_iso(e.last_used)) for e in entries])
    elif args.format == "csv":
        buf = io.StringIO()
        fields = ["key", "name", "size", "torch", "compiler", "python", "build_method", "build_seconds",
                  "created", "last_used", "in_use", "path", "error"]
        w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        from .fsroot import printable

        for e in entries:
            w.writerow({k: printable(v, 4000) if isinstance(v, str) else v for k, v in e.to_json().items()})
        sys.stdout.write(buf.getvalue())
    else:
        headers, rows = _ls_rows(entries, now, args.verbose > 0)
        if rows:
            _out(_table(headers, rows, right=(2,)))
        if not args.quiet:
            from .units import human_size

            total = sum(e.size for e in entries)
            in_use = sum(1 for e in entries if e.in_use)
            _out(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {human_size(total)}"
                 + (f", {in_use} in use" if not args.no_probe else "") + f" ({store.root})")
    return EXIT_OK


# --- stats -----------------------------------------------------------------------------------


def _stats_rows(s) -> list[tuple[str, str]]:
    from .units import human_seconds, human_size

    rate = f"{s.hit_rate * 100:.1f}%" if s.hit_rate is not None else "-"
    return [
        ("entries", str(s.entries)),
        ("total size", f"{human_size(s.total_size)} ({s.total_size} bytes)"),
        ("hits", str(s.hits)),
        ("misses", str(s.misses)),
        ("hit rate", rate),
        ("builds", str(s.builds)),
        ("build time", human_seconds(s.build_seconds)),
        ("saved by hits", human_seconds(s.saved_seconds)),
        ("waits for another build", str(s.waits)),
        ("time waiting", human_seconds(s.wait_seconds)),
        ("failed builds", str(s.failed_builds)),
        ("quarantined (events)", str(s.quarantined)),
        ("quarantine items", str(s.quarantine_items)),
        ("lock timeouts", str(s.lock_timeouts)),
        ("private builds", str(s.private_builds)),
        ("processes seen", str(s.processes)),
        ("torn event lines", str(s.bad_lines)),
        ("first event", _iso(s.first_event) or "-"),
        ("last event", _iso(s.last_event) or "-"),
    ] + ([] if not (os.environ.get("STUBCACHE_REMOTE") or any(vars(s.remote).values())) else [
        ("remote hits", str(s.remote.hits)),
        ("remote misses", str(s.remote.misses)),
        ("remote uploads", str(s.remote.uploads)),
        ("remote bytes down / up", f"{human_size(s.remote.bytes_downloaded)} / {human_size(s.remote.bytes_uploaded)}"),
        ("remote rejected blobs", str(s.remote.rejected_blobs)),
        ("fleet lease waits", f"{s.remote.lease_waits} ({human_seconds(s.remote.lease_wait_seconds)}, "
                              f"{s.remote.lease_takeovers} taken over)"),
        ("remote errors", str(s.remote.errors)),
    ])


def cmd_stats(args: argparse.Namespace) -> int:
    from .scan import scan_entries
    from .stats import compute_stats, fold_events

    store = _store(args)
    entries = scan_entries(store, probe_in_use=False)
    totals = fold_events(store.path("events"))
    try:
        with store.at("quarantine") as qfd:
            qitems = len(os.listdir(qfd))
    except OSError:
        qitems = 0
    s = compute_stats(store.root, entries, totals, qitems)
    if args.format == "json":
        _json(s.to_json())
    elif args.format == "prometheus":
        from .prometheus import render
        from .sizecap import configured_max_size

        sys.stdout.write(render(s, configured_max_size(store.root)))
    else:
        _out(_table(["STAT", "VALUE"], _stats_rows(s)))
    return EXIT_OK


# --- prune / clear ---------------------------------------------------------------------------


def _plan_rows(plan, executed: bool) -> tuple[list[str], list[list[Any]]]:
    from .units import human_size

    headers = ["ACTION", "KIND", "NAME", "KEY", "SIZE", "REASON"]
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


def _print_plan(plan, args: argparse.Namespace, executed: bool, dry_run: bool) -> None:
    from .units import human_size

    if args.format == "json":
        _json(dict(plan.to_json(), dry_run=dry_run))
        return
    headers, rows = _plan_rows(plan, executed)
    if rows and not (args.quiet and not executed):
        _out(_table(headers, rows, right=(4,)))
    s = plan.summary()
    if args.quiet:
        return
    if not executed and not dry_run and not s['planned_removals']:
        _out(f"nothing to remove; {s['skipped']} skipped")
    elif not executed:
        _out(f"{'would remove' if dry_run else 'plan: remove'} {s['planned_removals']} item(s), "
             f"freeing {human_size(s['planned_bytes'])}; {s['skipped']} skipped"
             + (" (dry run: nothing changed)" if dry_run else ""))
    else:
        _out(f"removed {s['removed']} item(s), freed {human_size(s['bytes_freed'])}; "
             f"{s['skipped'] + s['in_use_at_removal']} kept because in use or live")
    if plan.max_size is not None and not plan.target_reached:
        _err(f"entries still total {human_size(plan.entry_size_after)} > --max-size "
             f"{human_size(plan.max_size)}: the rest is in use by live processes")


def _run_plan(args: argparse.Namespace, policy) -> int:
    from .prune import current_fingerprint, execute_plan, plan_prune
    from .scan import scan_cache

    store = _store(args)
    if not os.path.isdir(store.base):
        if args.format == "json":
            _json({"summary": {"planned_removals": 0, "removed": 0}, "items": [], "dry_run": args.dry_run})
        elif not args.quiet:
            _out(f"nothing to do: no cache at {store.root}")
        return EXIT_OK
    scan = scan_cache(store)
    fp = None
    if policy.toolchain_mismatch:
        fp = current_fingerprint(store, need_cuda=any("cuda" in e.fingerprint for e in scan.entries))
    plan = plan_prune(scan, policy, fp)
    if args.dry_run or not plan.removals:
        _print_plan(plan, args, executed=False, dry_run=args.dry_run)
        if not args.dry_run:
            _compact_events(args, store, policy)
        return EXIT_OK
    if not args.yes:
        if args.format != "json":
            _print_plan(plan, args, executed=False, dry_run=False)
        from .units import human_size

        if not _confirm(f"Remove {len(plan.removals)} item(s), {human_size(plan.bytes_to_free)}?", args):
            _err("aborted; nothing removed")
            return EXIT_ABORTED
    from .progress import Bar

    with Bar("removing") as bar:
        execute_plan(store, plan, progress=bar)
    _print_plan(plan, args, executed=True, dry_run=False)
    _compact_events(args, store, policy)
    failed = [i for i in plan.items if i.outcome and i.outcome.startswith("failed")]
    return EXIT_PROBLEMS if failed else EXIT_OK


def _compact_events(args: argparse.Namespace, store, policy) -> None:
    """Part of removing leftovers: one archive instead of an event file per finished process."""
    if not policy.leftovers or not os.path.isdir(store.path("events")):
        return
    from .stats import compact_events

    merged = compact_events(store.path("events"), store.lock_path("events-compact"), store.mode(0o600, 0o660))
    if merged and not args.quiet and args.format != "json":
        _out(f"merged the event files of {merged} finished processes into one archive")


def cmd_prune(args: argparse.Namespace) -> int:
    if args.remote or args.max_age is not None:
        from .remote.commands import cmd_prune_remote

        return cmd_prune_remote(args)
    from .prune import PrunePolicy
    from .units import parse_duration, parse_size

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
    from .prune import PrunePolicy

    rc = _run_plan(args, PrunePolicy(everything=True, leftovers=True))
    if rc == EXIT_OK and args.stats and not args.dry_run:
        n = _clear_events(_store(args))
        if not args.quiet and args.format != "json":
            _out(f"stats reset: deleted {n} event file(s) of finished processes "
                 "(live processes keep theirs)")
    return rc


def _clear_events(store) -> int:
    """Delete event files of processes that are gone (a live process keeps appending to its own
    and holds a shared flock on it)."""
    from . import fsroot
    from .stats import file_finished_at

    removed = 0
    try:
        dfd = store.dir("events")
    except OSError:
        return 0
    try:
        for name in os.listdir(dfd):
            if name.endswith(".jsonl") and not file_finished_at(dfd, name):
                continue
            try:
                if fsroot.rmtree_at(dfd, name):
                    removed += 1
            except (OSError, ValueError):
                pass
    finally:
        os.close(dfd)
    return removed


# --- verify ----------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_store

    if args.rebuild:
        return _verify_rebuild(args)
    if args.keys or args.sample is not None:
        raise UsageError("KEY arguments and --sample go with --rebuild")
    from .progress import Bar

    store = _store(args)
    with Bar("verifying") as bar:
        results = verify_store(store, quarantine=not args.dry_run, progress=bar)
    bad = [r for r in results if r.status == "bad"]
    if args.format == "json":
        _json({"checked": len(results), "bad": len(bad), "dry_run": args.dry_run,
               "results": [r.to_json() for r in results]})
    else:
        shown = results if args.verbose else bad
        if shown:
            rows = [[r.key[:12] if not args.verbose else r.key, r.name, r.status,
                     r.detail + (" -> quarantined" if r.quarantined_to else "")] for r in shown]
            _out(_table(["KEY", "NAME", "STATUS", "DETAIL"], rows))
        if not args.quiet:
            verb = "found" if args.dry_run else "quarantined"
            _out(f"checked {len(results)} entr{'y' if len(results) == 1 else 'ies'}: "
                 f"{len(results) - len(bad)} ok, {len(bad)} bad" + (f" ({verb})" if bad else ""))
    return EXIT_PROBLEMS if bad else EXIT_OK


def _verify_rebuild(args: argparse.Namespace) -> int:
    """``verify --rebuild``: rebuild entries privately and compare bytes (see stubcache.audit)."""
    from .audit import UNCOVERED, rebuild_entry, select_keys

    if args.sample is not None and args.sample < 1:
        raise UsageError("--sample must be at least 1")
    store = _store(args)
    try:
        keys = select_keys(store, args.keys, args.sample)
    except KeyError as exc:
        raise UsageError(f"no single entry for key {exc.args[0]}") from None
    results = [rebuild_entry(store, k) for k in keys]
    differs = [r for r in results if r.status == "differs"]
    if args.format == "json":
        _json({"checked": len(results), "differs": len(differs), "results": [r.to_json() for r in results]})
        return EXIT_PROBLEMS if differs else EXIT_OK
    rows = [[r.key if args.verbose else r.key[:12], r.name, r.status, r.detail] for r in results
            if args.verbose or r.status != "same"]
    if rows:
        _out(_table(["KEY", "NAME", "STATUS", "DETAIL"], rows))
    for r in differs:
        _out(f"\n{r.key} ({r.name}): {UNCOVERED}: a rebuild now gives sha256 {r.rebuilt_sha256}, the entry "
             f"holds {r.sha256}. Its pre-image:")
        _out(json.dumps(r.preimage, indent=1, sort_keys=True))
    if not args.quiet:
        counts = {s: sum(1 for r in results if r.status == s) for s in ("same", "differs", "skipped", "failed")}
        _out(f"rebuilt {len(results)} entr{'y' if len(results) == 1 else 'ies'}: "
             + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return EXIT_PROBLEMS if differs else EXIT_OK


# --- explain ---------------------------------------------------------------------------------


def _stale_variants(store, keys: list[str]) -> dict[str, list[str]]:
    """Entries of one base key whose tracked files changed since they were built: key -> why."""
    from .inputs import changed_inputs

    out = {}
    for k in keys:
        try:
            m = store.read_manifest(k)
        except (OSError, ValueError):
            continue
        reasons = changed_inputs(m.headers, m.inputs) if m.headers else []
        if reasons:
            out[k] = reasons
    return out


def _resolve(ref: str, args: argparse.Namespace, store) -> list[dict[str, Any]]:
    """A reference -> [{label, key, in_cache, preimage}] (a spec file may hold several specs)."""
    from .specref import SpecRefError, is_module_ref, load_specs

    if os.path.exists(ref) or is_module_ref(ref):
        try:
            specs = load_specs(ref)
        except SpecRefError as exc:
            raise UsageError(str(exc)) from None
        from .cache import StubCache

        cache = StubCache(store.root)
        out = []
        for spec in specs:
            key = cache.key(spec)
            keys = store.variant_keys(key) + [key]  # entries with tracked files are variants
            stale = _stale_variants(store, [k for k in keys if os.path.isdir(store.entry_dir(k))])
            in_cache = any(os.path.isdir(store.entry_dir(k)) and k not in stale for k in keys)
            item = {"label": f"{ref} ({spec.name})", "key": key, "in_cache": in_cache,
                    "preimage": cache.preimage(spec)}
            if stale and not in_cache:
                item["stale"] = stale
            out.append(item)
        return out
    if not re.fullmatch(r"[0-9a-f]{4,}", ref):
        raise UsageError(f"{ref!r} is neither a spec file, a MODULE:ATTR reference nor a key (hex, 4+ chars)")
    matches = [k for k in store.entry_keys() if k.startswith(ref)]
    if not matches:
        raise UsageError(f"no entry with a key starting {ref!r} in {store.root}")
    if len(matches) > 1:
        raise UsageError(f"key prefix {ref!r} is ambiguous: {', '.join(m[:16] for m in matches[:5])}")
    try:
        manifest = store.read_manifest(matches[0])
    except (OSError, ValueError) as exc:
        raise UsageError(f"entry {matches[0]}: cannot read its manifest: {exc}") from None
    return [{"label": f"entry {matches[0][:12]} ({manifest.name})", "key": matches[0], "in_cache": True,
             "preimage": manifest.preimage, "headers": manifest.headers}]


def cmd_explain(args: argparse.Namespace) -> int:
    from .explain import closest, differences, flatten, summarize

    store = _store(args)
    if len(args.refs) > 2:
        raise UsageError("explain takes one reference (show its pre-image) or two (show what differs)")
    sides = [_resolve(r, args, store) for r in args.refs]
    full = args.verbose > 0
    if len(sides) == 2:
        if len(sides[0]) != 1 or len(sides[1]) != 1:
            raise UsageError("to compare, each reference must name exactly one spec")
        a, b = sides[0][0], sides[1][0]
        diff = differences(a["preimage"], b["preimage"])
        if args.format == "json":
            _json({"a": a, "b": b, "differences": [{"field": f, "a": x, "b": y} for f, x, y in diff]})
            return EXIT_OK
        _out(f"A: {a['label']}  key {a['key']}")
        _out(f"B: {b['label']}  key {b['key']}")
        if not diff:
            _out("the pre-images are identical" + ("" if a["key"] == b["key"] else
                 " (the keys differ by the contents of tracked headers)"))
        else:
            _out(f"{len(diff)} field(s) differ:")
            _out(_table(["FIELD", "A", "B"], [[f, summarize(x, full), summarize(y, full)] for f, x, y in diff]))
        return EXIT_OK
    results = []
    for item in sides[0]:
        res = dict(item)
        if not item["in_cache"] and not item.get("stale"):
            cands = {}
            name = (item["preimage"].get("spec") or {}).get("name")
            for k in store.entry_keys():
                try:
                    m = store.read_manifest(k)
                except (OSError, ValueError):
                    continue
                if m.name == name:
                    cands[k] = m.preimage
            best = closest(item["preimage"], cands)
            if best is not None:
                res["closest"] = {"key": best[0], "differences": [
                    {"field": f, "cached": x, "wanted": y} for f, x, y in best[1]]}
        results.append(res)
    if args.format == "json":
        _json(results if len(results) > 1 else results[0])
        return EXIT_OK
    for res in results:
        _out(f"{res['label']}")
        _out(f"key: {res['key']}  ({'in the cache' if res['in_cache'] else 'not in the cache'})")
        _out(_table(["FIELD", "VALUE"], [[f, summarize(v, full)] for f, v in flatten(res["preimage"])]))
        for k, reasons in (res.get("stale") or {}).items():
            _out(f"entry {k} has this pre-image, but the files it read changed since it was built:")
            for r in reasons[:20] if not full else reasons:
                _out(f"  {r}")
        if "closest" in res:
            c = res["closest"]
            _out(f"closest cached entry of the same name: {c['key']} — {len(c['differences'])} field(s) differ:")
            _out(_table(["FIELD", "CACHED", "WANTED"], [[d["field"], summarize(d["cached"], full),
                                                         summarize(d["wanted"], full)] for d in c["differences"]]))
        elif not res["in_cache"] and not res.get("stale"):
            _out("no cached entry has this name")
        _out()
    return EXIT_OK


# --- warm ------------------------------------------------------------------------------------


def cmd_warm(args: argparse.Namespace) -> int:
    from .errors import StubCacheError
    from .specref import SpecRefError, load_specs

    specs = []
    for ref in args.refs:
        try:
            specs += [(ref, s) for s in load_specs(ref)]
        except SpecRefError as exc:
            raise UsageError(str(exc)) from None
    os.environ.pop("STUBCACHE_REQUIRE_HIT", None)  # warming is how a require-hit cache gets filled
    from .cache import StubCache

    cache = StubCache(_root(args))
    from .progress import Bar

    results = []
    bar = Bar("warming")
    for ref, spec in specs:
        bar(len(results), len(specs))
        t0 = time.perf_counter()
        try:
            found = cache.lookup(spec)
            entry = found if found is not None else cache.get_or_build(spec)
            status = "cached" if found is not None else ("built" if entry.published else "not stored")
            results.append({"ref": ref, "name": spec.name, "key": entry.key, "status": status,
                            "seconds": round(time.perf_counter() - t0, 3), "path": entry.path})
            if not entry.published and args.format != "json":
                _err(f"{spec.name}: built, but could not be stored in the cache at {cache.root} (it was "
                     "built privately; see the warning above and `stubcache doctor`)")
        except StubCacheError as exc:
            results.append({"ref": ref, "name": spec.name, "key": None, "status": "failed",
                            "seconds": round(time.perf_counter() - t0, 3), "error": str(exc)})
            if args.format != "json":
                _err(f"{spec.name}: {exc}")
    bar.__exit__()
    failed = [r for r in results if r["status"] in ("failed", "not stored")]
    if args.format == "json":
        _json({"root": cache.root, "results": results, "failed": len(failed)})
    elif not args.quiet:
        _out(_table(["NAME", "KEY", "STATUS", "TIME"],
                    [[r["name"], (r["key"] or "-")[:12], r["status"], f"{r['seconds']:.2f}s"] for r in results]))
    return EXIT_PROBLEMS if failed else EXIT_OK


# --- doctor, dir -----------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import fix_permissions, run_checks

    if args.remote_url is not None:  # the remote checks read the environment
        os.environ["STUBCACHE_REMOTE"] = args.remote_url
    if args.remote_timeout is not None:
        os.environ["STUBCACHE_REMOTE_TIMEOUT"] = args.remote_timeout

    root = _root(args)
    if args.fix and os.path.isdir(root):
        for line in fix_permissions(root):
            _out(f"fixed: {line}")
    checks = run_checks(root)
    errors = [c for c in checks if c.status == "error"]
    if args.format == "json":
        _json({"root": root, "checks": [c.to_json() for c in checks], "errors": len(errors),
               "warnings": sum(1 for c in checks if c.status == "warn")})
    else:
        _out(f"cache root: {root}")
        for c in checks:
            if args.quiet and c.status == "ok":
                continue
            _out(f"[{c.status:^5}] {c.name}: {c.detail}")
            if c.fix and c.status != "ok":
                _out(f"        fix: {c.fix}")
    return EXIT_PROBLEMS if errors else EXIT_OK


def cmd_init(args: argparse.Namespace) -> int:
    from .shared import init_root

    root = os.path.abspath(args.dir) if args.dir else _root(args)
    if args.shared and not args.group:
        raise UsageError("--shared needs --group GROUP (the group whose members may publish)")
    if args.group and not args.shared:
        raise UsageError("--group only makes sense with --shared")
    try:
        done = init_root(root, args.group if args.shared else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.format == "json":
        _json({"root": root, "shared": bool(args.shared), "group": args.group, "actions": done})
    else:
        for line in done:
            _out(line)
    return EXIT_OK


def cmd_dir(args: argparse.Namespace) -> int:
    root = _root(args)
    if args.format == "json":
        _json({"root": root})
    else:
        _out(root)
    return EXIT_OK


# --- parser ----------------------------------------------------------------------------------


def _globals(parser: argparse.ArgumentParser, sub: bool) -> None:
    d = argparse.SUPPRESS if sub else None
    parser.add_argument("--cache-dir", metavar="DIR", default=d,
                        help="cache root (default: $STUBCACHE_DIR, else the platform cache directory)")
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS if sub else 0,
                        help="more detail (full keys, extra columns, debug logging); repeatable")
    parser.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS if sub else False,
                        help="only print results and errors")


def _fmt(p: argparse.ArgumentParser, choices=("table", "json")) -> None:
    p.add_argument("--format", choices=choices, default="table", help="output format (default: table)")


def _remote_opts(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--remote", action="store_true", help=help_)
    p.add_argument("--remote-url", metavar="URL",
                   help="remote store (default: $STUBCACHE_REMOTE), e.g. redis://host:6379/0")
    p.add_argument("--remote-timeout", metavar="SECONDS",
                   help="seconds per network call (default: $STUBCACHE_REMOTE_TIMEOUT or 2)")


_EPILOG = """\
environment:
  STUBCACHE_DIR            cache root (default: the platform cache directory, see `stubcache dir`)
  STUBCACHE_MAX_SIZE       size cap (e.g. 10G) kept after each publish; also `stubcache config`
  STUBCACHE_LOCK_TIMEOUT   seconds to wait for another process's build (default 600), then
                           build privately
  STUBCACHE_SEED_DIRS      read-only caches searched first (':'-separated), e.g. baked into an image
  STUBCACHE_REQUIRE_HIT    1: fail (CacheMissError) instead of compiling on a miss
  STUBCACHE_TRUSTED_ROOTS  roots owned by others that you trust (':'-separated)
  STUBCACHE_PATCH_TORCH    set by `stubcache run`: patch torch's loaders at start-up
  STUBCACHE_REMOTE, STUBCACHE_REMOTE_MODE, STUBCACHE_REMOTE_SECRET, STUBCACHE_REMOTE_TIMEOUT,
  STUBCACHE_REMOTE_INSECURE  the optional fleet-wide remote tier
  CXX                      the compiler (default c++), part of every key

exit codes:
  0    ok
  1    the command ran and found problems (verify: bad entries; doctor: errors; warm: a build
       failed or could not be stored; prune/clear: a removal failed)
  2    usage error (bad option, bad size or filter, unreadable spec file, unknown key)
  3    not confirmed (answered no, or no terminal and no --yes)
  127  run: the command could not be started
  130  interrupted

More in docs/cli.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stubcache",
        description="Inspect and manage the stubcache cache of built native stubs.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _globals(parser, sub=False)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, func, help_: str) -> argparse.ArgumentParser:
        p = subs.add_parser(name, help=help_, description=help_)
        _globals(p, sub=True)
        p.set_defaults(func=func)
        return p

    p = add("ls", cmd_ls, "list entries: key, name, size, torch, compiler, created, last used, in use")
    p.add_argument("--filter", action="append", metavar="EXPR",
                   help="keep entries matching FIELD OP VALUE, e.g. 'size>1M', 'accessed>30d', "
                        "'created<2h', 'name=alloc*', 'in_use=yes' (repeatable; all must match)")
    p.add_argument("--name", metavar="PATTERN", help="only entries whose name matches this glob")
    p.add_argument("--sort", choices=sorted(_SORTS), default="used",
                   help="sort by this field (default: used, least recently used first)")
    p.add_argument("--reverse", action="store_true", help="reverse the order")
    p.add_argument("--no-probe", action="store_true", help="do not check whether live processes hold entries")
    _remote_opts(p, "list the blobs in the remote store instead of the local entries")
    _fmt(p, ("table", "json", "csv"))

    p = add("stats", cmd_stats, "counters folded from every process's event file")
    _fmt(p, ("table", "json", "prometheus"))

    def removal_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dry-run", "-n", action="store_true", help="print the plan; change nothing")
        p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
        _fmt(p)

    p = add("prune", cmd_prune, "remove entries by size/age/toolchain, and leftovers of dead processes")
    p.add_argument("--max-size", metavar="SIZE",
                   help="evict least recently used entries until entries total at most SIZE (e.g. 2G)")
    p.add_argument("--older-than", metavar="AGE", help="evict entries not used for longer than AGE (e.g. 14d)")
    p.add_argument("--toolchain-mismatch", action="store_true",
                   help="evict entries built for another torch, compiler, Python or platform")
    p.add_argument("--quarantine-age", metavar="AGE", default="7d",
                   help="remove quarantined entries older than AGE (default 7d)")
    p.add_argument("--no-leftovers", action="store_true",
                   help="leave staging dirs, leases, trash and quarantine alone")
    _remote_opts(p, "prune the remote store instead of the local root (needs --max-age)")
    p.add_argument("--max-age", metavar="AGE",
                   help="with --remote: remove blobs built longer than AGE ago (e.g. 30d)")
    removal_opts(p)

    p = add("verify", cmd_verify, "recheck every entry's checksum and manifest; quarantine failures")
    p.add_argument("--dry-run", "-n", action="store_true", help="report bad entries without quarantining them")
    p.add_argument("--rebuild", action="store_true",
                   help="rebuild entries privately and compare bytes: a difference means the key does not "
                        "cover an input (exit 1)")
    p.add_argument("keys", nargs="*", metavar="KEY", help="with --rebuild: entries to rebuild (default: all)")
    p.add_argument("--sample", type=int, metavar="N", help="with --rebuild: rebuild N random entries")
    _fmt(p)

    p = add("explain", cmd_explain,
            "print a key's pre-image field by field; with two references, the fields that differ")
    p.add_argument("refs", nargs="+", metavar="SPEC|KEY",
                   help="a spec JSON file, a MODULE:ATTR reference, or an entry key (or unique prefix)")
    _fmt(p)

    p = add("clear", cmd_clear, "remove every entry not in use, and all leftovers")
    p.add_argument("--stats", action="store_true", help="also delete the event files of finished processes")
    removal_opts(p)

    p = add("warm", cmd_warm, "build the stubs described by spec files or MODULE:ATTR references")
    p.add_argument("refs", nargs="+", metavar="FILE|MODULE:ATTR",
                   help="JSON file written from StubSpec.to_json() (an object, or a list of StubSpec.to_dict() "
                        "objects), or an importable "
                        "StubSpec, list, or zero-argument callable returning them")
    _fmt(p)

    p = add("doctor", cmd_doctor, "check the root's permissions, filesystem, free space and toolchain")
    p.add_argument("--fix", action="store_true",
                   help="first repair permissions of paths you own (drop group/other write; shared modes)")
    p.add_argument("--remote-url", metavar="URL", help="check this remote store (default: $STUBCACHE_REMOTE)")
    p.add_argument("--remote-timeout", metavar="SECONDS",
                   help="seconds per network call (default: $STUBCACHE_REMOTE_TIMEOUT or 2)")
    _fmt(p)

    p = add("init", cmd_init, "create or convert a cache root: private (0700), or shared with a group")
    p.add_argument("dir", nargs="?", metavar="DIR", help="the root (default: --cache-dir / $STUBCACHE_DIR)")
    p.add_argument("--shared", action="store_true", help="share the root with the members of --group")
    p.add_argument("--group", metavar="GROUP", help="the trusted group (name or gid)")
    _fmt(p)

    p = add("dir", cmd_dir, "print the cache root")
    _fmt(p)

    p = add("config", cmd_config, "show the root's settings, or set one: config set max_size 10G")
    p.add_argument("action", nargs="?", choices=("show", "set", "unset"), default="show")
    p.add_argument("name", nargs="?", metavar="NAME", help="max_size or toolchain_max_age")
    p.add_argument("value", nargs="?", metavar="VALUE", help="e.g. 10G, or 30d")
    _fmt(p)

    p = add("run", cmd_run, "run a command with torch's load_inline/load going through the cache, in "
                            "every Python process it starts (no code changes)")
    p.add_argument("--env", action="store_true",
                   help="print the environment variables `run` sets (for a service file) and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    return parser


def cmd_config(args: argparse.Namespace) -> int:
    from .errors import TrustError
    from .sizecap import DEFAULT_TOOLCHAIN_MAX_AGE, ENV_MAX_SIZE, SETTINGS, env_max_size, root_settings, set_setting
    from .units import human_age, human_size

    root = _root(args)
    if args.action in ("set", "unset"):
        if args.name not in SETTINGS:
            raise UsageError(f"config {args.action} needs a setting name: {', '.join(SETTINGS)}")
        if (args.action == "set") != (args.value is not None):
            raise UsageError("usage: stubcache config set NAME VALUE | stubcache config unset NAME")
        if not os.path.isdir(root):
            raise UsageError(f"no cache at {root}; create it first with `stubcache init`")
        try:
            set_setting(root, args.name, args.value)
        except ValueError as exc:
            raise UsageError(f"{args.name}: {exc}") from None
        except (PermissionError, TrustError) as exc:
            _err(str(exc))
            return EXIT_PROBLEMS
    try:
        stored = root_settings(root) if os.path.isdir(root) else {}
        env = env_max_size()
    except (ValueError, TrustError) as exc:
        _err(str(exc))
        return EXIT_PROBLEMS
    caps = [v for v in (env, stored.get("max_size")) if v is not None]
    effective = min(caps) if caps else None
    age = stored.get("toolchain_max_age", DEFAULT_TOOLCHAIN_MAX_AGE)
    if args.format == "json":
        _json({"root": root, "max_size": effective, "root_max_size": stored.get("max_size"), "env_max_size": env,
               "toolchain_max_age": age})
        return EXIT_OK
    def size(v):
        return "-" if v is None else f"{human_size(v)} ({v} bytes)"
    _out(f"cache root: {root}")
    _out(_table(["SETTING", "VALUE", "FROM"], [
        ["max_size", size(effective), "the smaller of the two below" if len(caps) == 2 else
         (ENV_MAX_SIZE if env is not None else "root config" if caps else "not set: no automatic cap")],
        ["  root config max_size", size(stored.get("max_size")), "stubcache config set max_size SIZE"],
        [f"  {ENV_MAX_SIZE}", size(env), "environment"],
        ["toolchain_max_age", human_age(age), "root config" if "toolchain_max_age" in stored else "default"],
    ]))
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    import shlex

    from .run import exec_command, run_environment

    if args.cache_dir:
        os.environ["STUBCACHE_DIR"] = os.path.abspath(args.cache_dir)
    if args.env:
        for k, v in run_environment().items():
            _out(f"export {k}={shlex.quote(v)}")
        return EXIT_OK
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("run needs a command: stubcache run -- python serve.py ...")
    try:
        exec_command(cmd)
    except OSError as exc:
        _err(f"cannot run {cmd[0]!r}: {exc.strerror or exc}")
        return EXIT_NOT_RUN
    return EXIT_NOT_RUN  # not reached: exec replaced this process


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stubcache`` console script; returns the exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv[:-1]):
        # `--max-size -5G` would read as a missing value; let the option's own check answer
        if a in ("--max-size", "--older-than", "--quarantine-age") and argv[i + 1][:1] == "-" \
                and argv[i + 1][1:2].isdigit():
            argv[i:i + 2] = [f"{a}={argv[i + 1]}"]
            break
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    level = logging.ERROR if args.quiet else logging.DEBUG if args.verbose > 1 else logging.WARNING
    logger = logging.getLogger("stubcache")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    try:
        return args.func(args)
    except UsageError as exc:
        _err(str(exc))
        return EXIT_USAGE
    except _NotConfirmed as exc:
        _err(str(exc))
        return EXIT_ABORTED
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except (StubCacheError, OSError) as exc:
        # A hostile or broken root gets a one-line message, never a traceback.
        from .fsroot import printable

        _err(printable(exc, 2000))
        return EXIT_PROBLEMS
    except BrokenPipeError:
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
