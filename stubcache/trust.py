"""Ownership and permission checks before anything from the cache is loaded (invariant 6).

A private root (the default) trusts paths owned by you or root and writable by nobody else. A
shared root (``stubcache init --shared --group G``) records its trusted group in
``<root>/stubcache-root.json`` (the root itself is not group-writable, so no member can replace
it); it then also trusts paths owned by members of G, and allows group write where the group is
G. World-writable paths and symlinks are refused everywhere.
"""

from __future__ import annotations

import json
import os
import stat

from .errors import TrustError

CONFIG_NAME = "stubcache-root.json"  # at the root, beside v1/


class TrustPolicy:
    """Who may own, and who may write, the files stubcache loads."""

    __slots__ = ("uid", "gid", "group", "_members")

    def __init__(self, gid: int | None = None, group: str | None = None) -> None:
        self.uid = os.geteuid()
        self.gid = gid
        self.group = group
        self._members: set[int] | None = None

    @property
    def shared(self) -> bool:
        return self.gid is not None

    def member_uids(self) -> set[int]:
        """uids of the trusted group's members (supplementary and primary)."""
        if self._members is None:
            import grp
            import pwd

            members: set[int] = set()
            try:
                names = set(grp.getgrgid(self.gid).gr_mem)
            except KeyError:
                names = set()
            for pw in pwd.getpwall():
                if pw.pw_gid == self.gid or pw.pw_name in names:
                    members.add(pw.pw_uid)
            self._members = members
        return self._members

    def trusted_owner(self, uid: int) -> bool:
        if uid == self.uid or uid == 0:
            return True
        return self.shared and uid in self.member_uids()

    def check(self, st: os.stat_result, path: str, what: str) -> None:
        """Refuse a path that is a symlink, owned by someone untrusted, or writable by others."""
        if stat.S_ISLNK(st.st_mode):
            raise TrustError(f"refusing {what} {path}: it is a symlink; remove it (stubcache never follows links)")
        if not self.trusted_owner(st.st_uid):
            who = "you, root or a member of the trusted group" if self.shared else "you or root"
            raise TrustError(
                f"refusing {what} {path}: owned by uid {st.st_uid}, not by {who} (uid {self.uid}); "
                "use your own cache directory (STUBCACHE_DIR) or remove the path"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not (self.shared and st.st_gid == self.gid)):
            raise TrustError(
                f"refusing {what} {path}: writable by {'others' if mode & stat.S_IWOTH else 'group'} "
                f"(mode {mode:o}); fix with: chmod go-w {path}"
                + ("  (or `stubcache doctor --fix`)" if not self.shared else "")
            )


PRIVATE = None  # lazily created default policy


def private_policy() -> TrustPolicy:
    global PRIVATE
    if PRIVATE is None or PRIVATE.uid != os.geteuid():
        PRIVATE = TrustPolicy()
    return PRIVATE


def check_stat(st: os.stat_result, path: str, what: str, policy: TrustPolicy | None = None) -> None:
    (policy or private_policy()).check(st, path, what)


def check_dir(path: str, what: str = "cache directory", policy: TrustPolicy | None = None) -> None:
    check_stat(os.lstat(path), path, what, policy)


def load_policy(root: str) -> TrustPolicy:
    """The policy of a root: shared if ``<root>/stubcache-root.json`` says so.

    That file decides whom to trust, so it and the root directory holding it must be beyond the
    group's reach: both owned by a trusted user (the config by the root's owner or by root), and
    neither writable by group or others. Members can write below ``v1/``, never here.
    """
    path = os.path.join(root, CONFIG_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return private_policy()
    except OSError as exc:
        raise TrustError(f"cannot read the cache config {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        data = os.read(fd, 1 << 16) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    try:
        cfg = json.loads(data.decode("utf-8"))
        gid = cfg.get("gid") if cfg.get("mode") == "shared" else None
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise TrustError(f"refusing cache config {path}: not valid JSON; recreate it with `stubcache init`") from None
    if gid is None:
        policy = private_policy()
    elif not isinstance(gid, int):
        raise TrustError(f"refusing cache config {path}: gid must be an integer")
    else:
        policy = TrustPolicy(gid, cfg.get("group"))
        if os.getegid() != gid and gid not in os.getgroups() and os.geteuid() != 0:
            raise TrustError(
                f"the shared cache at {root} trusts group {cfg.get('group')!r} (gid {gid}), and you "
                "are not a member; add this account to the group or use another root"
            )
    root_st = os.lstat(root)
    for what, p, s in (("cache root", root, root_st), ("cache config", path, st)):
        if stat.S_ISLNK(s.st_mode) or not policy.trusted_owner(s.st_uid) or stat.S_IMODE(s.st_mode) & 0o022:
            raise TrustError(
                f"refusing {what} {p}: it decides whom the cache trusts, so it must be owned by a trusted "
                f"user and writable by nobody else (uid {s.st_uid}, mode {stat.S_IMODE(s.st_mode):o}); "
                f"fix with: chmod go-w {p}, or recreate the root with `stubcache init`")
    if st.st_uid not in (root_st.st_uid, 0):
        raise TrustError(f"refusing cache config {path}: owned by uid {st.st_uid}, but the root by uid "
                         f"{root_st.st_uid}; recreate it with `stubcache init`")
    return policy
