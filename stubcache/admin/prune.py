"""Deletion plans (pure) and their execution (the only code here that removes anything).

``plan_prune`` turns a :class:`~stubcache.admin.scan.CacheScan` and a :class:`PrunePolicy` into a
:class:`PrunePlan` that can be printed (``--dry-run``) before :func:`execute_plan` carries it
out. Execution re-checks everything at the moment of removal, so a stale plan is still safe
(invariant 7 of docs/design.md):

* an entry is removed only while holding an exclusive ``flock`` on ``pins/<key>`` (taken
  non-blocking; every process that has loaded the entry holds a shared one, so if it fails the
  entry is in use and is skipped). Under that lock the entry is renamed into ``trash/`` (readers
  never see a half-deleted entry) and then deleted. Readers take their shared lock before they
  check that the entry exists, so a reader that races with a removal sees a miss and rebuilds.
  The entry's build lock (``locks/<base_key>.lock``) is also taken non-blocking: a builder
  pins before it publishes and holds the build lock throughout, so an entry whose build lock is
  held is skipped as "being published".
* a staging directory is removed only if its builder pid is gone and its build lock is free;
  a lease file only while holding its build lock.

The pin file of a removed entry is unlinked while its exclusive lock is held. Whoever opened the
old file just before that notices (readers in ``Store.pin``, other prunes here) by comparing the
inode they locked with the one now at the path, and does not trust the orphaned lock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..edge import faults, fsroot
from ..storage.locking import flock_held_at, try_flock
from .scan import CacheScan, EntryRecord, Leftover, pid_alive
from ..storage.store import Store, is_key
from ..edge.units import human_age, human_size

DEFAULT_QUARANTINE_AGE = 7 * 86400.0
TOOLCHAIN_FIELDS = ("format", "torch", "cxx", "python", "platform")


@dataclass
class PrunePolicy:
    """What to remove. Policies compose: an entry goes if any selected policy picks it.

    Attributes:
        max_size: evict entries never hit, then least recently used ones, until the entries
            total at most this.
        older_than: evict entries not used for longer than this many seconds.
        toolchain_mismatch: evict entries built for another torch/compiler/Python/platform.
        everything: remove every entry (``stubcache clear``).
        leftovers: remove dead builders' staging dirs, stale leases, abandoned trash, and
            quarantine items older than ``quarantine_age`` (every quarantine item with ``everything``).
    """

    max_size: int | None = None
    older_than: float | None = None
    toolchain_mismatch: bool = False
    everything: bool = False
    leftovers: bool = True
    quarantine_age: float = DEFAULT_QUARANTINE_AGE


@dataclass
class PlanItem:
    """One thing the plan would remove (``action="remove"``) or deliberately keeps (``"skip"``)."""

    kind: str            # entry | staging | lease | quarantine | trash
    path: str
    name: str
    size: int
    reason: str
    action: str = "remove"
    key: str | None = None
    base_key: str | None = None
    pid: int | None = None
    outcome: str | None = None   # set by execute_plan: removed | in use | gone | failed: ...

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "name": self.name, "path": self.path,
                "size": self.size, "reason": self.reason, "action": self.action, "outcome": self.outcome}


@dataclass
class PrunePlan:
    """The plan: items in removal order, plus the size accounting of entries."""

    items: list[PlanItem] = field(default_factory=list)
    entries_before: int = 0
    size_before: int = 0
    max_size: int | None = None

    @property
    def removals(self) -> list[PlanItem]:
        return [i for i in self.items if i.action == "remove"]

    @property
    def skipped(self) -> list[PlanItem]:
        return [i for i in self.items if i.action == "skip"]

    @property
    def bytes_to_free(self) -> int:
        return sum(i.size for i in self.removals)

    @property
    def entry_size_after(self) -> int:
        return self.size_before - sum(i.size for i in self.removals if i.kind == "entry")

    @property
    def target_reached(self) -> bool:
        return self.max_size is None or self.entry_size_after <= self.max_size

    def summary(self) -> dict[str, Any]:
        removed = [i for i in self.items if i.outcome == "removed"]
        return {
            "entries_before": self.entries_before,
            "size_before": self.size_before,
            "planned_removals": len(self.removals),
            "planned_bytes": self.bytes_to_free,
            "skipped": len(self.skipped),
            "size_after_planned": self.entry_size_after,
            "max_size": self.max_size,
            "target_reached": self.target_reached,
            "removed": len(removed),
            "bytes_freed": sum(i.size for i in removed),
            "in_use_at_removal": sum(1 for i in self.items if i.outcome in ("in use", "being published")),
        }

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary(), "items": [i.to_json() for i in self.items]}


# --- planning (pure) -------------------------------------------------------------------------


def toolchain_mismatch(entry_fp: dict[str, Any], current_fp: dict[str, Any]) -> str | None:
    """Why an entry's fingerprint cannot match this environment any more, or ``None``."""
    if not entry_fp:
        return None
    why = []
    for f in TOOLCHAIN_FIELDS:
        a, b = entry_fp.get(f), current_fp.get(f)
        if a == b:
            continue
        if f == "torch" and isinstance(a, dict) and isinstance(b, dict) and a.get("version") != b.get("version"):
            why.append(f"torch {a.get('version')} (now {b.get('version')})")
        elif f == "cxx" and isinstance(a, dict) and isinstance(b, dict):
            la = (a.get("version") or "").splitlines()[:1] or [a.get("path")]
            lb = (b.get("version") or "").splitlines()[:1] or [b.get("path")]
            why.append(f"compiler {a.get('command')}: {la[0]} (now {b.get('command')}: {lb[0]})")
        elif f == "python" and isinstance(a, dict) and isinstance(b, dict):
            why.append(f"python {a.get('version')} {a.get('implementation')} (now {b.get('version')} "
                       f"{b.get('implementation')})")
        else:
            why.append(f"{f} differs")
    if "cuda" in entry_fp and "cuda" in current_fp and entry_fp["cuda"] != current_fp["cuda"]:
        why.append("nvcc differs")
    return "toolchain mismatch: " + "; ".join(why) if why else None


def _entry_item(e: EntryRecord, reason: str) -> PlanItem:
    reason = fsroot.printable(reason, 500)  # built from manifest values
    if e.in_use:
        return PlanItem("entry", e.path, e.name, e.size, f"{reason}; in use by a live process",
                        action="skip", key=e.key, base_key=e.base_key)
    return PlanItem("entry", e.path, e.name, e.size, reason, key=e.key, base_key=e.base_key)


def eviction_order(e: EntryRecord) -> tuple[Any, ...]:
    """The order in which a size cap evicts: entries no process has hit since they were
    published first (a name or source that embeds a pid makes a new one per start, and nobody
    will ever hit it), then least recently used."""
    return (not e.never_hit, e.last_used, e.created, e.key)


def plan_prune(scan: CacheScan, policy: PrunePolicy, current_fp: dict[str, Any] | None = None) -> PrunePlan:
    """Compute what ``policy`` removes from ``scan`` (no I/O).

    Order: entries picked by ``everything``/age/toolchain, then entries for ``max_size`` in
    :func:`eviction_order` (never hit, then oldest "last used" first; entries in use are skipped
    and the next one is taken), then leftovers. ``current_fp`` is required for ``toolchain_mismatch``.
    """
    now = scan.now
    good = [e for e in scan.entries if e.error is None]
    plan = PrunePlan(entries_before=len(scan.entries), size_before=scan.total_size, max_size=policy.max_size)
    picked: set[str] = set()
    for e in scan.entries:
        if e.error is not None:
            plan.items.append(PlanItem("entry", e.path, e.name, e.size, f"broken entry ({e.error}); "
                                       "run `stubcache verify` to quarantine it", action="skip", key=e.key))
    for e in sorted(good, key=lambda r: (r.last_used, r.created, r.key)):
        reasons = []
        if policy.everything:
            reasons.append("clear")
        if policy.older_than is not None and now - e.last_used > policy.older_than:
            reasons.append(f"unused for {human_age(now - e.last_used)} (> {human_age(policy.older_than)})")
        if policy.toolchain_mismatch:
            if current_fp is None:
                raise ValueError("toolchain_mismatch needs the current fingerprint")
            why = toolchain_mismatch(e.fingerprint, current_fp)
            if why:
                reasons.append(why)
        if reasons:
            item = _entry_item(e, "; ".join(reasons))
            plan.items.append(item)
            picked.add(e.key)
    if policy.max_size is not None:
        total = sum(e.size for e in good) - sum(
            i.size for i in plan.items if i.kind == "entry" and i.action == "remove")
        for e in sorted(good, key=eviction_order):
            if total <= policy.max_size:
                break
            if e.key in picked:
                continue
            why = (f"never hit (built {human_age(now - e.created)} ago)" if e.never_hit else
                   f"least recently used (last used {human_age(now - e.last_used)} ago)")
            item = _entry_item(e, f"{why}; entries over {human_size(policy.max_size)}")
            plan.items.append(item)
            if item.action == "remove":
                total -= e.size
    if policy.leftovers or policy.everything:
        plan.items.extend(_leftover_items(scan.leftovers, policy))
    return plan


def plan_removal(scan: CacheScan, asked: dict[str, str]) -> PrunePlan:
    """The plan of ``stubcache rm``: the entries of ``scan`` whose keys are in ``asked`` (key ->
    why), in that order (no I/O). Broken entries too, since they were named (their removal never
    follows what stands at their path); entries in use are skipped."""
    plan = PrunePlan(entries_before=len(scan.entries), size_before=scan.total_size)
    by_key = {e.key: e for e in scan.entries}
    for key, why in asked.items():
        e = by_key.get(key)
        if e is None:
            continue
        if e.error is not None:
            why = f"{why}; broken entry ({e.error})"
        plan.items.append(_entry_item(e, why))
    return plan


def _leftover_items(leftovers: Iterable[Leftover], policy: PrunePolicy) -> list[PlanItem]:
    out = []
    for lo in leftovers:
        if lo.kind == "quarantine":
            if policy.everything or lo.age > policy.quarantine_age:
                why = f"quarantined {human_age(lo.age)} ago" + (f" ({lo.detail})" if lo.detail else "")
                out.append(PlanItem(lo.kind, lo.path, lo.name, lo.size, why, pid=lo.pid))
        elif lo.stale:
            out.append(PlanItem(lo.kind, lo.path, lo.name, lo.size, lo.detail, pid=lo.pid))
        elif lo.kind == "staging":
            out.append(PlanItem(lo.kind, lo.path, lo.name, lo.size, lo.detail, action="skip", pid=lo.pid))
    return out


# --- execution (I/O) -------------------------------------------------------------------------


def evict_entry(store: Store, key: str, base_key: str | None = None) -> str:
    """Remove one entry unless a live process holds it.

    Returns ``removed``, ``in use`` (a process holds its pin), ``being published`` (a builder of
    its key holds the build lock: it publishes first and pins right after, so the lock covers
    that gap) or ``gone``.

    Takes ``LOCK_EX|LOCK_NB`` on ``pins/<key>`` (the same inode readers lock) and on the build
    lock of ``base_key``, renames the entry into ``trash/`` and deletes it there, then releases.
    """
    fsroot.check_name(key)
    if base_key is None or not is_key(base_key):
        base_key = key  # a manifest's value never becomes a path
    pin = store.pin_path(key)
    try:
        fd = store.open_lock_file(pin)
    except FileNotFoundError:
        return "gone"  # no pins/ directory: no layout here
    except fsroot.NotRegularFile:
        return "failed: its pin is not a regular file (run `stubcache doctor`)"
    lock_fd = -1
    try:
        if not try_flock(fd):
            return "in use"
        try:
            with store.at("pins") as pfd:
                same = os.fstat(fd).st_ino == os.stat(key, dir_fd=pfd, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            # Another prune removed this pin file after we opened it; readers now lock a new one,
            # which our lock does not cover. Leave the entry for the next run.
            return "in use"
        try:
            lock_fd = store.open_lock_file(store.lock_path(base_key), create=False)
        except FileNotFoundError:
            lock_fd = -1  # never built here (or lock not created yet): no builder to protect
        except fsroot.NotRegularFile:
            return "failed: its build lock is not a regular file (run `stubcache doctor`)"
        if lock_fd >= 0 and not try_flock(lock_fd):
            return "being published"
        faults.point("evict_locked")
        trashed = store.trash(key)
        if trashed is None:
            return "gone"
        faults.point("evict_trashed")
        store.remove_in("trash", os.path.basename(trashed))
        store.drop_entry_records(key, base_key)
        # Safe while we hold it exclusively: Store.pin re-checks the inode after locking, so a
        # reader that opened this file just before the unlink takes a fresh pin instead.
        with store.at("pins") as pfd:
            fsroot.unlink_at(pfd, key)
        return "removed"
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
        os.close(fd)


def _remove_lease(store: Store, item: PlanItem) -> str:
    name = item.name
    base = name[:-5] if name.endswith(".json") else None
    if name.endswith(".tmp") or base is None or not is_key(base):
        if item.pid is not None and pid_alive(item.pid):
            return "in use"
        return _remove(store, "leases", name)
    try:
        fd = store.open_lock_file(store.lock_path(base), create=False)
    except FileNotFoundError:
        return _remove(store, "leases", name)
    except fsroot.NotRegularFile:
        return "failed: its build lock is not a regular file (run `stubcache doctor`)"
    try:
        if not try_flock(fd):
            return "in use"
        return _remove(store, "leases", name)
    finally:
        os.close(fd)


def _remove(store: Store, area: str, name: str) -> str:
    """Remove ``v1/<area>/<name>`` (whatever it is) through a descriptor of ``area``; nothing is
    followed and no mode is changed except, through its own descriptor, on a directory we own."""
    try:
        with store.at(area) as fd:
            try:
                fsroot.lstat_at(fd, name)
            except FileNotFoundError:
                return "gone"
            removal = fsroot.remove_tree_at(fd, name)
            return "removed" if removal.gone else f"failed: {removal.refused}"
    except FileNotFoundError:
        return "gone"


def execute_item(store: Store, item: PlanItem) -> str:
    """Carry out one removal, re-checking that it is still safe; returns the outcome."""
    if item.kind == "entry":
        assert item.key is not None
        return evict_entry(store, item.key, item.base_key)
    fsroot.check_name(item.name)
    if item.kind == "staging":
        base = item.name.split("-", 1)[0]
        if item.pid is not None and pid_alive(item.pid):
            return "in use"
        if is_key(base):
            try:
                with store.at("locks") as lfd:
                    if flock_held_at(lfd, f"{base}.lock"):
                        return "in use"
            except FileNotFoundError:
                pass
        return _remove(store, "staging", item.name)
    if item.kind == "lease":
        return _remove_lease(store, item)
    if item.kind == "trash":
        if item.pid is not None and item.pid != os.getpid() and pid_alive(item.pid):
            return "in use"
        return _remove(store, "trash", item.name)
    if item.kind == "quarantine":
        return _remove(store, "quarantine", item.name)
    raise ValueError(f"unknown plan item kind {item.kind!r}")


def execute_plan(store: Store, plan: PrunePlan, progress: Callable[[int, int], object] | None = None) -> PrunePlan:
    """Carry out every ``remove`` item of ``plan`` in order; fills each item's ``outcome``.
    ``progress``, if given, is called with ``(done, total)`` before each item."""
    removals = plan.removals
    for i, item in enumerate(removals):
        if progress is not None:
            progress(i, len(removals))
        try:
            item.outcome = execute_item(store, item)
        except (OSError, ValueError) as exc:
            item.outcome = f"failed: {fsroot.printable(exc)}"
    return plan


def current_fingerprint(store: Store, need_cuda: bool = False) -> dict[str, Any]:
    """This environment's fingerprint (no torch import; the compiler's version is memoised)."""
    from ..key.fingerprint import Fingerprint

    state = store.path("state")
    # read_only: reading the cache must not write to it (prune --dry-run)
    fingerprint = Fingerprint(state if os.path.isdir(state) else None, read_only=True)
    fp = dict(fingerprint.base())
    if need_cuda:
        fp["cuda"] = fingerprint.cuda()
    return fp

