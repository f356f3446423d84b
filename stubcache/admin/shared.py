"""Preparing a root that several users share (``stubcache init --shared --group G DIR``).

The root itself is ``2750`` (setgid, not group-writable: only its owner can replace
``stubcache-root.json``, which names the trusted group); every layout directory below is
``2770`` (group-writable so members can take locks, stage builds, pin and evict), entry
directories ``2775``; published libraries and manifests stay read-only for everyone. See
docs/security.md.
"""

from __future__ import annotations

import os
import stat
import time

from ..storage.store import SUBDIRS, Store

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Callable

SHARED_ROOT_MODE = 0o2750
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


def set_mode(path: str, mode: int, gid: int | None = None, *, directory: bool, dir_fd: int | None = None) -> bool:
    """``chgrp``/``chmod`` through an fd opened with ``O_NOFOLLOW``, so a symlink (or a FIFO, or a
    directory swapped for a link) planted by someone else is never followed. Returns True if it
    changed something; raises ``ValueError`` for a path of the wrong kind. With ``dir_fd``,
    ``path`` is a single name relative to that directory."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        raise ValueError(f"{path}: not a {'directory' if directory else 'regular file'} "
                         f"stubcache can fix ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
            raise ValueError(f"{path}: unexpected file type; remove it")
        if not directory and st.st_nlink != 1:
            # A hard link planted by a member: the same inode as a file outside the root, whose
            # mode and group this would change (root's doctor --fix making /etc/shadow 0660).
            raise ValueError(f"{path}: has {st.st_nlink} hard links (the same file is elsewhere too); remove it")
        changed = False
        if gid is not None and st.st_gid != gid:
            os.fchown(fd, -1, gid)
            changed = True
        if stat.S_IMODE(st.st_mode) != mode or changed:
            os.fchmod(fd, mode)  # after chown: chown may clear setgid
            changed = True
        return changed
    finally:
        os.close(fd)


def fix_shared_files(store: Store, gid: int) -> list[str]:
    """Entry directories ``2775`` (their files keep only read/execute bits), pin and lock files
    ``0660``, all in group ``gid``; every step through directory fds without following links.
    Returns what changed; odd file types are reported, not touched."""
    from ..edge import fsroot

    done: list[str] = []

    def one(dfd: int, name: str, mode: int | Callable[[os.stat_result], int], directory: bool, label: str) -> None:
        try:
            if callable(mode):
                mode = mode(fsroot.lstat_at(dfd, name))
            if set_mode(name, mode, gid, directory=directory, dir_fd=dfd):
                done.append(f"chmod {mode:o} {label} (group {gid})")
        except (OSError, ValueError) as exc:
            done.append(f"skipped {fsroot.printable(label)}: {fsroot.printable(exc)}")

    with store.at("entries") as efd:
        for key in store.entry_keys():
            one(efd, key, SHARED_ENTRY_MODE, True, store.entry_dir(key))
            try:
                kfd = os.open(key, fsroot.O_DIR, dir_fd=efd)
            except OSError:
                continue
            try:
                for f in fsroot.listdir(kfd):
                    one(kfd, f, lambda st: stat.S_IMODE(st.st_mode) & 0o555, False, os.path.join(store.entry_dir(key), f))
            finally:
                os.close(kfd)
    for sub in ("pins", "locks"):
        with store.at(sub) as sfd:
            for f in fsroot.listdir(sfd):
                one(sfd, f, 0o660, False, store.path(sub, f))
    return done


def init_root(root: str, group: str | None = None) -> list[str]:
    """Create (or convert) a cache root; shared with ``group`` when given. Returns what it did."""
    store = Store(root)
    done: list[str] = []
    gid = None
    name = None
    if group is not None:
        name, gid = resolve_group(group)
    dirs = [store.root, store.base] + [store.path(s) for s in SUBDIRS]
    for d in dirs:
        if os.path.islink(d):
            raise ValueError(f"{d} is a symlink; refusing to use it as a cache directory")
        if not os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
            done.append(f"created {d}")
        if gid is None:
            mode = 0o700
        else:
            mode = SHARED_ROOT_MODE if d == store.root else SHARED_DIR_MODE
        set_mode(d, mode, gid, directory=True)
    if gid is not None:
        skipped = [d for d in fix_shared_files(store, gid) if d.startswith("skipped")]
        if skipped:
            raise ValueError("left unchanged (remove them, then run init again): " + "; ".join(skipped))
        cfg = {"mode": "shared", "group": name, "gid": gid, "created": time.time(), "by_uid": os.geteuid()}
        done.append(f"shared with group {name} (gid {gid}): root mode {SHARED_ROOT_MODE:o}, "
                    f"directories mode {SHARED_DIR_MODE:o}")
    else:
        cfg = {"mode": "private", "created": time.time(), "by_uid": os.geteuid()}
        done.append("private to uid %d, directories mode 700" % os.geteuid())
    from ..storage.trust import load_root_config, write_root_config

    try:  # settings (`stubcache config`) survive a conversion
        from ..edge.settings import ROOT_SETTINGS

        old = load_root_config(store.root)[1]
        cfg.update({k: v for k, v in old.items() if k in ROOT_SETTINGS})
    except Exception:
        pass
    done.append(f"wrote {write_root_config(store.root, cfg)}")
    return done
