"""A size cap that holds itself: settings (``STUBCACHE_MAX_SIZE`` and the root's configuration)
and the prune a publishing process runs when the root has grown past the cap.

The prune runs only after a publish, never on the hit path; only one process cleans at a time
(a non-blocking lock: the others carry on at once); it is time-boxed, and it follows the usual
rules (entries in use are never removed; entries never hit go first, then the least recently
used). Every root has a cap, :data:`DEFAULT_MAX_SIZE` unless configured (``off``: none). Entries built for a
toolchain this host no longer matches age out after ``toolchain_max_age`` unused.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from ..edge import log
from ..edge.settings import DEFAULT_MAX_SIZE, DEFAULT_TOOLCHAIN_MAX_AGE, MAX_SIZE, NO_CAP, ROOT_SETTINGS
from ..storage import locking
from ..storage.trust import CONFIG_NAME
from ..storage.store import Store

TIME_BOX = 2.0  # seconds a publishing process may spend cleaning


def root_settings(root: str) -> dict[str, Any]:
    """The settings stored in the root's configuration, parsed (invalid values are skipped with a
    warning; a config that fails the trust checks raises :class:`~stubcache.edge.errors.TrustError`)."""
    from ..storage.trust import load_root_config

    if not os.path.lexists(os.path.join(root, CONFIG_NAME)):
        return {}
    cfg = load_root_config(root)[1]
    out = {}
    for name, parse in ROOT_SETTINGS.items():
        if name in cfg and cfg[name] is not None:  # max_size "off" parses to None: kept
            try:
                out[name] = parse(cfg[name])
            except ValueError as exc:
                log.warning("ignoring %s in the configuration of %s: %s", name, root, exc)
    return out


@dataclass(frozen=True)
class CapSetting:
    """What one source (``STUBCACHE_MAX_SIZE``, the root's ``max_size``) says about the cap:
    nothing (``given`` False), a limit in bytes, or ``limit=None``: no cap (:data:`NO_CAP`)."""

    given: bool = False
    limit: int | None = None


@dataclass(frozen=True)
class SizeCap:
    """The cap in force: ``limit`` in bytes (``None``: none) and where it comes from."""

    limit: int | None
    source: str  # "default", "off", MAX_SIZE, "root config", or "the smaller of the two"


def env_cap() -> CapSetting:
    raw = os.environ.get(MAX_SIZE, "").strip()
    if not raw:
        return CapSetting()
    if raw.lower() == NO_CAP:
        return CapSetting(True, None)
    from ..edge.settings import max_size  # the one reader of the variable: its SettingsError names it

    return CapSetting(True, max_size())


def env_max_size() -> int | None:
    """``STUBCACHE_MAX_SIZE`` in bytes; ``None`` if unset or ``off``."""
    return env_cap().limit


def root_cap(settings: dict[str, Any]) -> CapSetting:
    """The root's ``max_size`` from :func:`root_settings`."""
    return CapSetting(True, settings["max_size"]) if "max_size" in settings else CapSetting()


def effective_cap(env: CapSetting, root: CapSetting) -> SizeCap:
    """The smaller of the limits given (a user can tighten a shared root's cap, never loosen
    it); :data:`DEFAULT_MAX_SIZE` if neither source says anything; none if every source that
    does says ``off``."""
    given = [(c, name) for c, name in ((env, MAX_SIZE), (root, "root config")) if c.given]
    if not given:
        return SizeCap(DEFAULT_MAX_SIZE, "default")
    limits = [(c.limit, name) for c, name in given if c.limit is not None]
    if not limits:
        return SizeCap(None, "off")
    if len(limits) == 2:
        return SizeCap(min(v for v, _ in limits), "the smaller of the two")
    return SizeCap(limits[0][0], limits[0][1])


def size_cap(root: str) -> SizeCap:
    """The cap in force for ``root`` (raises ``ValueError`` on a malformed ``STUBCACHE_MAX_SIZE``)."""
    return effective_cap(env_cap(), root_cap(root_settings(root)))


def configured_max_size(root: str) -> int | None:
    """The cap in bytes (see :func:`effective_cap`); ``None``: no cap."""
    return size_cap(root).limit


def set_setting(root: str, name: str, value: str | None) -> Any:
    """Store (``value``) or remove (``None``) a setting in the root's configuration; only the
    root's owner (or uid 0) may. Returns the parsed value."""
    from ..storage.trust import write_root_config
    from ..storage.trust import load_root_config

    if name not in ROOT_SETTINGS:
        raise ValueError(f"unknown setting {name!r}; known: {', '.join(ROOT_SETTINGS)}")
    parsed = ROOT_SETTINGS[name](value) if value is not None else None
    st = os.lstat(root)
    if os.geteuid() not in (st.st_uid, 0):
        raise PermissionError(f"only the owner of {root} (uid {st.st_uid}) can change its configuration")
    cfg = dict(load_root_config(root)[1]) or {"mode": "private", "created": time.time(), "by_uid": os.geteuid()}
    if value is None:
        cfg.pop(name, None)
    else:
        cfg[name] = value
    write_root_config(root, cfg)
    return parsed


def entries_size(store: Store) -> int:
    """Total size of the published entries (two ``stat``s an entry, no manifest reads)."""
    total = 0
    for key in store.entry_keys():
        edir = store.entry_dir(key)
        try:
            with os.scandir(edir) as it:
                for de in it:
                    if de.is_file(follow_symlinks=False):
                        total += de.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total


AGEOUT_INTERVAL = 86400.0  # toolchain age-out below the cap: at most once a day per root


def after_publish(store: Store, time_box: float = TIME_BOX) -> str:
    """Called by a process that has just published (and released its build lock). Returns what
    happened, for tests and logs: ``no cap`` (turned off), ``under cap``, ``busy`` (another process is
    cleaning), ``gone`` (the root was removed meanwhile), ``pruned N`` or ``error``.

    With a cap (every root has one unless it is turned off), entries of a toolchain this host no longer
    matches that nobody used for ``toolchain_max_age`` are removed even below the cap, at most once
    a day; over the cap they go first, then the least recently used."""
    if not os.path.isdir(store.base):
        # The root went away after the publish (its owner removed it): a background job must
        # not bring it back (opening the lock file below would make the layout afresh).
        return "gone"
    try:
        settings = root_settings(store.root)
        cap = configured_max_size(store.root)
        if cap is None and "toolchain_max_age" not in settings:
            return "no cap"
        over = cap is not None and entries_size(store) > cap
        stamp = store.path("state", "toolchain-ageout")
        try:
            due = time.time() - os.stat(stamp).st_mtime > AGEOUT_INTERVAL
        except FileNotFoundError:
            due = True
        if not over and not due:
            return "under cap"
        # Fork-safe: the prune runs on a helper thread while the program goes on, and engines
        # fork workers (DataLoader, multiprocessing "fork") right after loading; a worker keeping
        # an inherited copy of the open file would keep every later prune "busy".
        with locking.Lock(store.open_lock_file(store.lock_path("sizecap")), fork_safe=True) as lock:
            if not locking.try_flock(lock.fd):
                return "busy"
            if due:  # stamped first: a failing age-out is not retried on every publish
                from ..edge import fsroot

                dfd = fsroot.open_dir(store.path("state"))
                try:
                    locking.write_file(dfd, os.path.basename(stamp), b"", mode=store.mode(0o600, 0o660))
                finally:
                    os.close(dfd)
            age = settings.get("toolchain_max_age", DEFAULT_TOOLCHAIN_MAX_AGE)
            return f"pruned {_prune(store, cap if over else None, age, time_box)}"
    except Exception as exc:  # a bad setting or a broken root must not fail the build that succeeded
        log.warning("size cap not applied to %s: %s", store.root, exc)
        return "error"


def _prune(store: Store, cap: int | None, toolchain_age: float, time_box: float) -> int:
    from .prune import PrunePolicy, current_fingerprint, execute_item, plan_prune, toolchain_mismatch
    from .scan import CacheScan, scan_cache

    deadline = time.monotonic() + time_box
    scan = scan_cache(store, leftovers=False)
    # Entries this toolchain cannot use and nobody used for toolchain_age go first, then LRU.
    old = [e for e in scan.entries if e.error is None and scan.now - e.last_used > toolchain_age]
    fp = current_fingerprint(store) if old else {}
    stale = [e for e in old if toolchain_mismatch(e.fingerprint, fp)]
    items = plan_prune(CacheScan(scan.root, scan.now, stale, []),
                       PrunePolicy(everything=True, leftovers=False)).removals
    if cap is not None:
        gone = {i.key for i in items}
        rest = CacheScan(scan.root, scan.now, [e for e in scan.entries if e.key not in gone], [])
        items += plan_prune(rest, PrunePolicy(max_size=cap, leftovers=False)).removals
    removed = 0
    for item in items:
        if time.monotonic() > deadline:
            log.info("size cap: time box of %.1fs used up; the next publish continues", time_box)
            break
        try:
            outcome = execute_item(store, item)
        except OSError as exc:
            outcome = f"failed: {exc}"
        if outcome == "removed":
            removed += 1
    if removed:
        log.info("size cap: removed %d entr%s from %s", removed, "y" if removed == 1 else "ies", store.root)
    return removed
