"""``stubcache stats --format prometheus``: the counters and gauges of :class:`stubcache.admin.stats.Stats`
in the Prometheus text exposition format (version 0.0.4), for node_exporter's textfile collector."""

from __future__ import annotations

from .stats import Stats

# (metric, type, help, Stats attribute)
METRICS = (
    ("stubcache_hits_total", "counter", "Lookups served from the cache.", "hits"),
    ("stubcache_misses_total", "counter", "Lookups that found no entry.", "misses"),
    ("stubcache_builds_total", "counter", "Stubs built and published.", "builds"),
    ("stubcache_build_seconds_total", "counter", "Seconds spent in published builds.", "build_seconds"),
    ("stubcache_saved_seconds_total", "counter", "Build seconds that hits did not have to spend.",
     "saved_seconds"),
    ("stubcache_waits_total", "counter", "Waits for another process's build of the same key.", "waits"),
    ("stubcache_wait_seconds_total", "counter", "Seconds spent waiting for other processes' builds.",
     "wait_seconds"),
    ("stubcache_failed_builds_total", "counter", "Builds that failed to compile or link.", "failed_builds"),
    ("stubcache_quarantined_total", "counter", "Entries quarantined after failing verification.",
     "quarantined"),
    ("stubcache_lock_timeouts_total", "counter", "Lock waits that timed out.", "lock_timeouts"),
    ("stubcache_private_builds_total", "counter", "Builds that could not be published (private).",
     "private_builds"),
    ("stubcache_processes_total", "counter", "Processes that used the cache.", "processes"),
    ("stubcache_entries", "gauge", "Published entries in the cache.", "entries"),
    ("stubcache_bytes", "gauge", "Total size of the published entries in bytes.", "total_size"),
    ("stubcache_quarantine_items", "gauge", "Items in the quarantine directory.", "quarantine_items"),
    ("stubcache_never_hit_entries", "gauge", "Entries no process has hit since they were published.",
     "never_hit"),
    ("stubcache_never_hit_bytes", "gauge", "Total size of the entries never hit, in bytes.", "never_hit_size"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def render(stats: Stats, max_size: int | None = None) -> str:
    """The exposition text: one ``# HELP``/``# TYPE`` pair and one sample per metric, each sample
    labelled with the cache root."""
    label = f'{{root="{_label(stats.root)}"}}'
    lines = []
    rows = [(m, t, h, getattr(stats, a)) for m, t, h, a in METRICS]
    remote = getattr(stats, "remote", None)
    if remote is not None:  # the remote tier's counters (docs/remote.md), all monotonic
        from dataclasses import fields

        for f in fields(remote):
            rows.append((f"stubcache_remote_{f.name}_total", "counter",
                         f"Remote tier: {f.name.replace('_', ' ')}.", getattr(remote, f.name)))
    if max_size is not None:
        rows.append(("stubcache_max_size_bytes", "gauge", "The configured size cap in bytes.", max_size))
    for metric, kind, help_, value in rows:
        lines.append(f"# HELP {metric} {help_}")
        lines.append(f"# TYPE {metric} {kind}")
        lines.append(f"{metric}{label} {_number(value)}")
    return "\n".join(lines) + "\n"
