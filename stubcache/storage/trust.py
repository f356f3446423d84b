"""Ownership and permission checks before anything from the cache is loaded (docs/design.md, invariant 6).

A private root (the default) trusts paths owned by you or root and writable by nobody else. A
shared root (``stubcache init --shared --group G``) records its trusted group in
``<root>/stubcache-root.json`` (the root itself is not group-writable, so no member can replace
it); it then also trusts paths owned by members of G, and allows group write where the group is
G. World-writable paths and symlinks are refused everywhere.
"""

from __future__ import annotations

import os
import stat

from ..edge import settings
from ..edge.errors import TrustError, UntrustedRootError
from ..hit import CONFIG_NAME as CONFIG_NAME  # at the root, beside v1/ (the compact hit path checks it too)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any


class TrustPolicy:
    """Who may own, and who may write, the files stubcache loads."""

    __slots__ = ("uid", "gid", "group", "_members", "extra_uids")

    def __init__(self, gid: int | None = None, group: str | None = None, extra_uids: frozenset[Any] = frozenset()) -> None:
        self.uid = os.geteuid()
        self.gid = gid
        self.group = group
        self._members: set[int] | None = None
        self.extra_uids = extra_uids  # the owner of a root the user trusts explicitly

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
                names = set(grp.getgrgid(self.gid).gr_mem)  # type: ignore[arg-type]  # a group's: shared
            except KeyError:
                names = set()
            for pw in pwd.getpwall():
                if pw.pw_gid == self.gid or pw.pw_name in names:
                    members.add(pw.pw_uid)
            self._members = members
        return self._members

    def trusted_owner(self, uid: int) -> bool:
        if uid == self.uid or uid == 0 or uid in self.extra_uids:
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


def layout_policy(root: str, extra_uids: frozenset[Any] = frozenset()) -> TrustPolicy:
    """The layout policy of a root: shared if ``<root>/stubcache-root.json`` says so. This says
    who may write there (used by ``verify``, ``doctor``, ``init``); whether *this* user loads
    code from the root is :func:`loader_policy`'s question. See :func:`load_root_config`."""
    return load_root_config(root, extra_uids)[0]


def load_root_config(root: str, extra_uids: frozenset[Any] = frozenset()) -> tuple[TrustPolicy, dict[str, Any]]:
    """The layout policy of a root and its whole configuration (``{}`` without a config file),
    read once and checked as :func:`layout_policy` describes (settings such as ``max_size`` live
    in the same file, so they carry the same trust).

    That file decides whom to trust, so it and the root directory holding it must be beyond the
    group's reach: both owned by a trusted user (the config by the root's owner or by root), and
    neither writable by group or others. Members can write below ``v1/``, never here.
    """
    path = os.path.join(root, CONFIG_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return (TrustPolicy(extra_uids=extra_uids) if extra_uids else private_policy()), {}
    except PermissionError:
        raise UntrustedRootError(f"cannot read the cache config {path} (permission denied): this account "
                            "is not one the root's owner shares it with", "ask the owner to add this account "
                            "to the root's group, or use a cache directory of your own (STUBCACHE_DIR)") from None
    except OSError as exc:
        raise TrustError(f"cannot read the cache config {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        data = os.read(fd, 1 << 16) if stat.S_ISREG(st.st_mode) else b"not a regular file"
    finally:
        os.close(fd)
    try:
        from ..edge import cjson

        cfg: Any = cjson.loads(data.decode("utf-8"))
        gid = cfg.get("gid") if cfg.get("mode") == "shared" else None
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):  # nested past the parser
        raise TrustError(f"refusing cache config {path}: not valid JSON; recreate it with `stubcache init`") from None
    if gid is None:
        policy = TrustPolicy(extra_uids=extra_uids) if extra_uids else private_policy()
    elif not isinstance(gid, int):
        raise TrustError(f"refusing cache config {path}: gid must be an integer")
    else:
        group = cfg.get("group")
        policy = TrustPolicy(gid, group if isinstance(group, str) else None, extra_uids)
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
    return policy, cfg


# --- trust anchored in the loading user ----------------------------------------------------------

TRUSTED_ROOTS_FILE = "trusted-roots"  # under platformdirs.user_config_dir("stubcache")


def trusted_roots_file() -> str:
    import platformdirs

    return os.path.join(platformdirs.user_config_dir("stubcache"), TRUSTED_ROOTS_FILE)


def trusted_roots() -> list[str]:
    """Roots this user trusts explicitly: ``STUBCACHE_TRUSTED_ROOTS`` (``os.pathsep``-separated)
    and the lines of :func:`trusted_roots_file` (``#`` comments). The file counts only if it is a
    regular file owned by this user (or root) and writable by nobody else."""
    from ..edge import fsroot

    out = settings.path_list(settings.TRUSTED_ROOTS)
    try:
        path = trusted_roots_file()
        fd = fsroot.open_regular(None, path)
    except (OSError, ImportError):
        return out
    try:
        st = os.fstat(fd)
        if st.st_uid in (os.geteuid(), 0) and not stat.S_IMODE(st.st_mode) & 0o022:
            text = fsroot.read_fd(fd, fsroot.SMALL_CAP, path).decode("utf-8", "replace")
            out += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    except (OSError, ValueError):
        pass
    finally:
        os.close(fd)
    return out


def _canon(path: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def explicitly_trusted(root: str) -> bool:
    """True if the user listed ``root`` (after resolving links on both sides)."""
    want = _canon(root)
    return any(_canon(p) == want for p in trusted_roots())


def how_to_trust(root: str) -> str:
    return (f"if you trust everyone who can write to it, export {settings.TRUSTED_ROOTS}={root} or add "
            f"that line to {_config_hint()}; otherwise use a cache directory of your own (STUBCACHE_DIR)")


def _config_hint() -> str:
    try:
        return trusted_roots_file()
    except ImportError:
        return f"~/.config/stubcache/{TRUSTED_ROOTS_FILE}"


def loader_policy(root: str) -> TrustPolicy:
    """The policy for loading code from ``root`` as this user, or :class:`UntrustedRootError`.

    Like git's ``safe.directory``, trust is anchored in the loading user, never in the root:
    the root must be owned by this user or by root (uid 0), or be listed by the user
    (:func:`trusted_roots`). ``stubcache-root.json`` can then only narrow who is trusted: a
    shared root's group counts only for a member of that group, and for uid 0 only when the
    root is listed explicitly (root does not run code other uids wrote just because they share
    a group). Raises :class:`TrustError` for a root or config that fails the mode checks.
    """
    st = os.lstat(root)
    euid = os.geteuid()
    explicit = None
    if st.st_uid not in (euid, 0):
        explicit = explicitly_trusted(root)
        if not explicit:
            raise UntrustedRootError(f"the cache root {root} is owned by uid {st.st_uid}, not by you (uid {euid}) "
                                "or root, and you have not said to trust it", how_to_trust(root))
    policy = layout_policy(root, frozenset({st.st_uid}) if explicit else frozenset())
    if policy.shared:
        gid = policy.gid
        member = os.getegid() == gid or gid in os.getgroups()
        if euid == 0:
            if explicit is None:
                explicit = explicitly_trusted(root)
            if not explicit:
                raise UntrustedRootError(
                    f"the cache root {root} is shared with group {policy.group!r} (gid {gid}); as root, "
                    "stubcache does not load code that its members wrote unless you trust it explicitly",
                    how_to_trust(root))
        elif not member:
            raise UntrustedRootError(
                f"the shared cache at {root} trusts group {policy.group!r} (gid {gid}), and you are not a "
                "member; its group counts only for members", "add this account to the group "
                f"(usermod -aG {policy.group} USER) or use a cache directory of your own (STUBCACHE_DIR)")
    return policy


def write_root_config(root: str, cfg: dict[str, Any]) -> str:
    """Atomically replace ``<root>/stubcache-root.json`` (mode 0644, through the root's descriptor,
    never following a link); returns its path."""
    import json

    from ..edge import fsroot
    from . import locking

    dfd = fsroot.open_dir(root)
    try:
        locking.write_file(dfd, CONFIG_NAME, json.dumps(cfg, indent=1).encode("utf-8"), mode=0o644)
    finally:
        os.close(dfd)
    return os.path.join(root, CONFIG_NAME)
