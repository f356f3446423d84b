"""Commands that read a root and change nothing: ``ls``, ``stats``, ``explain``, ``dir``.
``ls`` and ``stats`` never import torch (tests/test_cli.py checks it)."""

from __future__ import annotations

import argparse
import os
import re
import time
from typing import TYPE_CHECKING, Any

from .common import root as _root
from .common import store as _store
from .exits import EXIT_OK, UsageError
from .output import View, iso, short_compiler, show, table

if TYPE_CHECKING:
    from ..admin.scan import EntryRecord
    from ..admin.stats import Stats
    from ..storage.store import Store

# --- ls --------------------------------------------------------------------------------------


def _ls_rows(entries: list[EntryRecord], now: float, verbose: bool) -> tuple[list[str], list[list[Any]]]:
    from ..edge.units import human_age, human_size

    headers = ["ENTRY KEY", "NAME", "SIZE", "TORCH", "COMPILER", "CREATED", "LAST USED", "IN USE"]
    if verbose:
        headers += ["METHOD", "BUILD", "SPEC KEY"]
    rows = []
    for e in entries:
        row = [e.key if verbose else e.key[:12], e.name, human_size(e.size), e.torch or "-",
               short_compiler(e.compiler), human_age(now - e.created) + " ago",
               human_age(now - e.last_used) + " ago",
               "yes" if e.in_use else ("no" if e.in_use is not None else "?")]
        if e.error:
            row[3:5] = ["-", f"BROKEN: {e.error}"]
        if verbose:
            row += [e.build_method or "-", f"{e.build_seconds:.2f}s", e.base_key or "-"]
        rows.append(row)
    return headers, rows


LS_CSV_FIELDS = ["key", "name", "size", "torch", "compiler", "python", "build_method", "build_seconds",
                 "created", "last_used", "in_use", "path", "error", "base_key"]


def cmd_ls(args: argparse.Namespace) -> int:
    if args.remote:
        from .remote import cmd_ls_remote

        return cmd_ls_remote(args)
    from ..admin.entryfilter import FilterError, parse_filter, select
    from ..admin.scan import scan_entries

    store = _store(args)
    try:
        filters = [parse_filter(f) for f in args.filter or []]
    except FilterError as exc:
        raise UsageError(str(exc)) from None
    now = time.time()
    entries = select(scan_entries(store, probe_in_use=not args.no_probe), now, filters,
                     name=args.name, sort=args.sort, reverse=args.reverse)

    def text() -> list[str]:
        headers, rows = _ls_rows(entries, now, args.verbose > 0)
        lines = [table(headers, rows, right=(2,))] if rows else []
        if not args.quiet:
            from ..edge.units import human_size

            total = sum(e.size for e in entries)
            in_use = sum(1 for e in entries if e.in_use)
            lines.append(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {human_size(total)}"
                         + (f", {in_use} in use" if not args.no_probe else "") + f" ({store.root})")
        return lines

    show(args, View(
        json=lambda: [dict(e.to_json(), created_iso=iso(e.created), last_used_iso=iso(e.last_used))
                      for e in entries],
        csv=(LS_CSV_FIELDS, (e.to_json() for e in entries)),
        text=text))
    return EXIT_OK


# --- stats -----------------------------------------------------------------------------------


def _stats_rows(s: Stats) -> list[tuple[str, str | None]]:
    from ..edge.units import human_seconds, human_size

    rate = f"{s.hit_rate * 100:.1f}%" if s.hit_rate is not None else "-"
    return [
        ("entries", str(s.entries)),
        ("total size", f"{human_size(s.total_size)} ({s.total_size} bytes)"),
        ("entries never hit", f"{s.never_hit} ({human_size(s.never_hit_size)})"),
    ] + ([("counters reset", iso(s.reset_at))] if s.reset_at is not None else []) + [
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
        ("first event", iso(s.first_event) or "-"),
        ("last event", iso(s.last_event) or "-"),
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
    from ..admin.scan import scan_entries
    from ..admin.stats import compute_stats, fold_events

    store = _store(args)
    if getattr(args, "reset", False):
        return _reset_stats(args, store)
    entries = scan_entries(store, probe_in_use=False)
    totals = fold_events(store.path("events"))
    try:
        with store.at("quarantine") as qfd:
            qitems = len(os.listdir(qfd))
    except OSError:
        qitems = 0
    s = compute_stats(store.root, entries, totals, qitems)

    def prometheus() -> str:
        from ..admin.prometheus import render
        from ..admin.sizecap import configured_max_size

        return render(s, configured_max_size(store.root))

    show(args, View(json=s.to_json, raw={"prometheus": prometheus},
                    text=lambda: [table(["STAT", "VALUE"], _stats_rows(s))]))
    return EXIT_OK


def reset_view(store: Store, args: argparse.Namespace) -> View | None:
    """Zero the counters of ``store`` (``stats --reset``, ``clear --stats``): what to show, or
    ``None`` where there is no cache."""
    from ..admin.stats import reset_counters

    if not os.path.isdir(store.base):
        return None
    try:
        with store.at("events", create=True):
            pass
        res = reset_counters(store.path("events"), store.lock_path("events-compact"), store.mode(0o600, 0o660))
    except TimeoutError as exc:
        from .exits import Failed

        raise Failed(str(exc)) from None
    return View(json={"root": store.root, "reset_at": res.time, "deleted_files": res.deleted,
                      "live_files": res.live},
                text=lambda: [f"stats reset: deleted {res.deleted} event file(s) of finished processes; "
                              f"{res.live} live process(es) keep theirs, but their earlier events no longer "
                              f"count; counting from {iso(res.time)}"])


def _reset_stats(args: argparse.Namespace, store: Store) -> int:
    if args.format == "prometheus":
        raise UsageError("--reset prints what it did as a table or JSON, not --format prometheus")
    view = reset_view(store, args)
    if view is None:
        show(args, View(json={"root": store.root, "reset_at": None, "deleted_files": 0, "live_files": 0},
                        text=lambda: [f"nothing to reset: no cache at {store.root}"]))
        return EXIT_OK
    show(args, view)
    return EXIT_OK


# --- explain ---------------------------------------------------------------------------------


def _current_entries(store: Store, spec_key: str) -> tuple[list[str], dict[str, list[str]]]:
    """The entry keys of ``spec_key`` that a lookup would use now, and those whose tracked files
    changed since they were built (entry key -> why)."""
    from ..admin.manifestscan import stale_variants

    there = [k for k in store.variant_keys(spec_key) + [spec_key] if os.path.isdir(store.entry_dir(k))]
    stale = stale_variants(store, there)
    return [k for k in there if k not in stale], stale


def _resolve(ref: str, store: Store) -> list[dict[str, Any]]:
    """A reference -> [{label, key, spec_key, entry_keys, in_cache, preimage}] (a spec file may
    hold several specs). ``key`` is the key the reference names (a spec file: its spec key)."""
    from ..admin.specref import SpecRefError, is_module_ref, load_specs

    if os.path.exists(ref) or is_module_ref(ref):
        try:
            specs = load_specs(ref)
        except SpecRefError as exc:
            raise UsageError(str(exc)) from None
        from ..hit.front import StubCache

        cache = StubCache(store.root)
        items = []
        for spec in specs:
            key = cache.key(spec)
            current, stale = _current_entries(store, key)
            item = {"label": f"{ref} ({spec.name})", "key": key, "spec_key": key, "entry_keys": current,
                    "in_cache": bool(current), "preimage": cache.preimage(spec)}
            if stale and not current:
                item["stale"] = stale
            items.append(item)
        return items
    if not re.fullmatch(r"[0-9a-fA-F]{4,}", ref):
        raise UsageError(f"{ref!r} is neither a spec file, a MODULE:ATTR reference nor a key (a spec key or an "
                         "entry key, or a prefix of one: 4 to 64 hex digits)")
    from ..admin.keyref import SPEC_KEY
    from ..admin.scan import scan_entries
    from .common import match_key

    m = match_key(ref, scan_entries(store, probe_in_use=False), store.root)
    try:
        manifest = store.read_manifest(m.entries[0])
    except (OSError, ValueError) as exc:
        raise UsageError(f"entry {m.entries[0]}: cannot read its manifest: {exc}") from None
    if m.kind == SPEC_KEY:  # as for a spec file: the entries a lookup would use now, and stale ones
        current, stale = _current_entries(store, m.key)
        item = {"label": f"{ref} ({manifest.name}: a spec key)", "key": m.key, "spec_key": m.key,
                "entry_keys": current, "in_cache": bool(current), "preimage": manifest.preimage}
        if stale and not current:
            item["stale"] = stale
        return [item]
    return [{"label": f"{ref} ({manifest.name}: an entry key)", "key": m.key, "spec_key": manifest.base_key,
             "entry_keys": [m.key], "in_cache": True, "preimage": manifest.preimage, "headers": manifest.headers}]


def _keys_line(item: dict[str, Any]) -> str:
    one = item["entry_keys"][0] if len(item["entry_keys"]) == 1 else None
    return f"spec key {item['spec_key']}" + (f", entry key {one}" if one else "")


def _explain_two(args: argparse.Namespace, a: dict[str, Any], b: dict[str, Any]) -> int:
    from ..admin.explain import differences, summarize

    full = args.verbose > 0
    diff = differences(a["preimage"], b["preimage"])

    def text() -> list[str]:
        lines = [f"A: {a['label']}  {_keys_line(a)}", f"B: {b['label']}  {_keys_line(b)}"]
        if not diff:
            lines.append("the pre-images are identical" + ("" if a["entry_keys"] == b["entry_keys"] else
                         " (one spec key; the entry keys differ by the contents of the files the builds read)"))
        else:
            lines.append(f"{len(diff)} field(s) differ:")
            lines.append(table(["FIELD", "A", "B"],
                               [[f, summarize(x, full), summarize(y, full)] for f, x, y in diff]))
        return lines

    show(args, View(json={"a": a, "b": b, "differences": [{"field": f, "a": x, "b": y} for f, x, y in diff]},
                    text=text))
    return EXIT_OK


def _explain_text(res: dict[str, Any], full: bool) -> list[str]:
    from ..admin.explain import flatten, summarize

    lines = [f"{res['label']}",
             f"spec key:  {res['spec_key']}  ({'in the cache' if res['in_cache'] else 'not in the cache'})"]
    lines += [f"entry key: {k}" for k in res["entry_keys"]]
    lines.append(table(["FIELD", "VALUE"], [[f, summarize(v, full)] for f, v in flatten(res["preimage"])]))
    for k, reasons in (res.get("stale") or {}).items():
        lines.append(f"entry key {k} has this pre-image, but the files it read changed since it was built:")
        lines += [f"  {r}" for r in (reasons[:20] if not full else reasons)]
    if "closest" in res:
        c = res["closest"]
        lines.append(f"closest cached entry of the same name: entry key {c['key']} — "
                     f"{len(c['differences'])} field(s) differ:")
        lines.append(table(["FIELD", "CACHED", "WANTED"], [[d["field"], summarize(d["cached"], full),
                                                             summarize(d["wanted"], full)] for d in c["differences"]]))
    elif not res["in_cache"] and not res.get("stale"):
        lines.append("no cached entry has this name")
    lines.append("")
    return lines


def cmd_explain(args: argparse.Namespace) -> int:
    from ..admin.explain import closest
    from ..admin.manifestscan import preimages_named

    store = _store(args)
    if len(args.refs) > 2:
        raise UsageError("explain takes one reference (show its pre-image) or two (show what differs)")
    sides = [_resolve(r, store) for r in args.refs]
    if len(sides) == 2:
        if len(sides[0]) != 1 or len(sides[1]) != 1:
            raise UsageError("to compare, each reference must name exactly one spec")
        return _explain_two(args, sides[0][0], sides[1][0])
    results = []
    for item in sides[0]:
        res = dict(item)
        if not item["in_cache"] and not item.get("stale"):
            name = (item["preimage"].get("spec") or {}).get("name")
            best = closest(item["preimage"], preimages_named(store, name))
            if best is not None:
                res["closest"] = {"key": best[0], "differences": [
                    {"field": f, "cached": x, "wanted": y} for f, x, y in best[1]]}
        results.append(res)
    full = args.verbose > 0
    show(args, View(json=results if len(results) > 1 else results[0],
                    text=lambda: [line for res in results for line in _explain_text(res, full)]))
    return EXIT_OK


# --- dir -------------------------------------------------------------------------------------


def cmd_dir(args: argparse.Namespace) -> int:
    root = _root(args)
    show(args, View(json={"root": root}, text=lambda: [root]))
    return EXIT_OK
