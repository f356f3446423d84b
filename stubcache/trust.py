"""Ownership and permission checks before anything from the cache is loaded (invariant 6)."""

from __future__ import annotations

import os
import stat

from .errors import TrustError


def _trusted_owner(uid: int) -> bool:
    return uid == os.geteuid() or uid == 0


def check_stat(st: os.stat_result, path: str, what: str) -> None:
    """Refuse a path that is a symlink, owned by someone untrusted, or writable by others."""
    if stat.S_ISLNK(st.st_mode):
        raise TrustError(f"refusing {what} {path}: it is a symlink; remove it (stubcache never follows links)")
    if not _trusted_owner(st.st_uid):
        raise TrustError(
            f"refusing {what} {path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}) or root; "
            "use your own cache directory (STUBCACHE_DIR) or remove it"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise TrustError(
            f"refusing {what} {path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"fix with: chmod go-w {path}"
        )


def check_dir(path: str, what: str = "cache directory") -> None:
    check_stat(os.lstat(path), path, what)
