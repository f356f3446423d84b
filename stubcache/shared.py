"""Preparing a root that several users share (``stubcache init --shared --group G DIR``).

Layout directories become ``2770`` (setgid, so everything created inside belongs to G, and
group-writable so members can take locks, stage builds, pin and evict); published libraries and
manifests stay read-only for everyone. The trusted group is recorded in ``v1/config.json``, which
only its owner can change. See docs/security.md.
"""

from __future__ import annotations

import json
import os
import time

from .store import SUBDIRS, Store
from .trust import CONFIG_NAME

SHARED_DIR_MODE = 0o2770
SHARED_ENTRY_MODE = 0o2775


def resolve_group(group: str) -> tuple[str, int]:
    """``(name, gid)`` of a group given by name or number; ``ValueError`` if unknown."""
    import grp

    try:
        g = grp.getgrgid(int(group)) if group.isdigit() else grp.getgrnam(group)
    except KeyError:
        raise ValueError(f"unknown group {group!r}; create it first (groupadd {group})") from None
    return g.gr_name, g.gr_gid


def init_root(root: str, group: str | None = None) -> list[str]:
    """Create (or convert) a cache root; shared with ``group`` when given. Returns what it did."""
    store = Store(root)
    done: list[str] = []
    gid = None
    name = None
    if group is not None:
        name, gid = resolve_group(group)
    dir_mode = SHARED_DIR_MODE if gid is not None else 0o700
    dirs = [store.root, store.base] + [store.path(s) for s in SUBDIRS]
    for d in dirs:
        if os.path.islink(d):
            raise ValueError(f"{d} is a symlink; refusing to use it as a cache directory")
        if not os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
            done.append(f"created {d}")
        if gid is not None:
            os.chown(d, -1, gid)
        os.chmod(d, dir_mode)
    if gid is not None:
        for key in store.entry_keys():
            edir = store.entry_dir(key)
            for p in [edir] + [os.path.join(edir, f) for f in os.listdir(edir)]:
                os.chown(p, -1, gid, follow_symlinks=False)
            os.chmod(edir, SHARED_ENTRY_MODE)
        for sub in ("pins", "locks"):
            for f in os.listdir(store.path(sub)):
                p = store.path(sub, f)
                os.chown(p, -1, gid, follow_symlinks=False)
                os.chmod(p, 0o660)
        cfg = {"mode": "shared", "group": name, "gid": gid, "created": time.time(), "by_uid": os.geteuid()}
        done.append(f"shared with group {name} (gid {gid}), directories mode {dir_mode:o}")
    else:
        cfg = {"mode": "private", "created": time.time(), "by_uid": os.geteuid()}
        done.append("private to uid %d, directories mode 700" % os.geteuid())
    path = os.path.join(store.base, CONFIG_NAME)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    done.append(f"wrote {path}")
    return done
