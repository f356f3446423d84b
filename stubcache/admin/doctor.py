"""Health checks for ``stubcache doctor``: the root's ownership and permissions, its filesystem,
free space, and the toolchain. Each check returns a :class:`Check`; nothing here prints."""

from __future__ import annotations

import os
import shutil
import stat
import sysconfig
from ..storage.store import SUBDIRS, Store
from .check import Check

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from ..storage.trust import TrustPolicy

NETWORK_FS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "fuse.sshfs", "gpfs", "beegfs",
              "glusterfs", "fuse.glusterfs", "ceph", "fuse.ceph", "9p", "afs", "fuse.s3fs", "virtiofs")
FREE_WARN = 1 << 30
FREE_ERROR = 100 << 20


def _existing_ancestor(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> tuple[str, str] | None:
    """``(fstype, mount point)`` of the mount holding ``path`` (Linux), or ``None``."""
    real = os.path.realpath(os.path.abspath(path))  # resolves the part that exists
    best: tuple[str, str] | None = None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        if len(fields) < 5:
            continue
        mnt = fields[4].replace("\\040", " ")
        fstype = right.split()[0] if right.split() else "?"
        if real == mnt or real.startswith(mnt.rstrip("/") + "/") or mnt == "/":
            if best is None or len(mnt) >= len(best[1]):
                best = (fstype, mnt)
    return best


def _layout_paths(root: str) -> list[str]:
    store = Store(root)
    paths = [root]
    if os.path.isdir(store.base):
        paths += [store.base] + [store.path(s) for s in SUBDIRS if os.path.lexists(store.path(s))]
        paths += [store.entry_dir(k) for k in store.entry_keys()]
    return paths


def check_root(root: str) -> list[Check]:
    """Ownership and permissions of the root, its layout directories and entry directories,
    judged by the same trust policy the loader applies (private, or shared with a group)."""
    from ..edge.errors import TrustError
    from ..storage.trust import layout_policy

    out: list[Check] = []
    if not os.path.lexists(root):
        out.append(Check("root", "ok", f"{root} does not exist yet; it is created (mode 0700) on first use"))
        return out
    if not os.path.isdir(root):
        kind = "a file" if os.path.isfile(root) else "not a directory"
        return [Check("root", "error", f"{root} is {kind}, not a directory: nothing can be cached there",
                      "point STUBCACHE_DIR (or --cache-dir) at a directory, or remove the file")]
    from ..edge.errors import UntrustedRootError
    from ..storage.trust import loader_policy

    try:
        policy = layout_policy(root)
    except UntrustedRootError as exc:
        return [Check("trust", "warn", f"{exc}; engines build privately and share nothing", exc.how)]
    except TrustError as exc:
        return [Check("config", "error", str(exc), "recreate the root with `stubcache init`")]
    try:
        loader_policy(root)
        out.append(Check("trust", "ok", "you trust this root (owned by you or root, or listed in "
                                        "STUBCACHE_TRUSTED_ROOTS or your trusted-roots file)"))
    except UntrustedRootError as exc:
        out.append(Check("trust", "warn", f"{exc}; engines build privately and share nothing", exc.how))
    except TrustError:
        pass  # reported below, path by path
    if policy.shared:
        out += check_shared_layout(root, policy)
    store = Store(root)
    odd = [n for n in store.entry_names() if n not in set(store.entry_keys())]
    if odd:
        from ..edge.fsroot import printable

        out.append(Check("entries", "warn", f"{len(odd)} name(s) under {store.path('entries')} are not entry "
                         f"keys and are ignored: {printable(odd[:5])}", "remove them (nothing reads them)"))
    bad = []
    for p in _layout_paths(root):
        try:
            policy.check(os.lstat(p), p, "cache directory")
        except TrustError as exc:
            bad.append(Check("permissions", "error", str(exc).replace("  (or `stubcache doctor --fix`)", ""),
                             "stubcache doctor --fix" if os.lstat(p).st_uid == os.geteuid()
                             else "use a cache directory of your own (--cache-dir or STUBCACHE_DIR)"))
    out += bad
    if not bad:
        mode = stat.S_IMODE(os.lstat(root).st_mode)
        kind = f"shared with group {policy.group} (gid {policy.gid})" if policy.shared else "private"
        out.append(Check("ownership", "ok", f"{root}: {kind}, mode {mode:o}, nothing writable by untrusted users"))
    real = os.path.realpath(root)
    if real == "/tmp" or real.startswith("/tmp/"):
        out.append(Check("location", "warn", f"{root} is under /tmp (predictable, may be wiped on reboot)",
                         "set STUBCACHE_DIR to a directory in your home or on local scratch"))
    return out


def check_shared_layout(root: str, policy: TrustPolicy) -> list[Check]:
    """Every deviation from the shared layout that stops members from sharing or the owner from
    cleaning up: a layout directory missing or not ``2770`` in the trusted group (the root
    ``2750``), entry directories not ``2775``, pin and lock files not ``0660``. Read-only."""
    from ..edge import fsroot
    from .shared import SHARED_DIR_MODE, SHARED_ENTRY_MODE, SHARED_ROOT_MODE

    store = Store(root)
    found: list[str] = []

    def judge(st: os.stat_result, want: int, label: str) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if mode != want or st.st_gid != policy.gid:
            found.append(f"{fsroot.printable(label)} is mode {mode:o} group {st.st_gid} (want {want:o} group {policy.gid})")

    try:
        judge(os.lstat(root), SHARED_ROOT_MODE, root)
        judge(os.lstat(store.base), SHARED_DIR_MODE, store.base)
        with fsroot.Dir(store.base) as bfd:
            for sub in SUBDIRS:
                try:
                    judge(fsroot.lstat_at(bfd, sub), SHARED_DIR_MODE, store.path(sub))
                except FileNotFoundError:
                    found.append(f"{store.path(sub)} is missing")
        with store.at("entries") as efd:
            for key in store.entry_keys():
                judge(fsroot.lstat_at(efd, key), SHARED_ENTRY_MODE, store.entry_dir(key))
        for sub in ("pins", "locks"):
            with store.at(sub) as sfd:
                for name in fsroot.listdir(sfd):
                    st = fsroot.lstat_at(sfd, name)
                    if not stat.S_ISREG(st.st_mode):
                        found.append(f"{fsroot.printable(store.path(sub, name))} is a {fsroot.kind(st.st_mode)}")
                    else:
                        judge(st, 0o660, store.path(sub, name))
    except OSError as exc:
        found.append(f"cannot read the layout: {fsroot.printable(exc)}")
    if not found:
        return [Check("shared layout", "ok", f"every directory and lock file has the shared mode and group {policy.group}")]
    more = f" (and {len(found) - 5} more)" if len(found) > 5 else ""
    return [Check("shared layout", "error", "; ".join(found[:5]) + more,
                  "stubcache doctor --fix (as the root's owner, or as root)")]


def fix_permissions(root: str) -> list[str]:
    """Repair what ``check_root`` reports on paths you own: drop group/other write (private
    roots) or restore the shared modes. Works through ``O_NOFOLLOW`` fds; symlinks, odd file
    types and others' paths are left for a human."""
    from .shared import SHARED_DIR_MODE, SHARED_ENTRY_MODE, SHARED_ROOT_MODE, set_mode
    from ..storage.trust import layout_policy

    policy = layout_policy(root)
    store = Store(root, policy)
    done = []
    if policy.shared and os.path.isdir(store.base):
        try:
            missing = [s for s in SUBDIRS if not os.path.lexists(store.path(s))]
            if missing:
                store.ensure(force=True)
                done += [f"created {store.path(s)}" for s in missing]
        except OSError as exc:
            done.append(f"skipped: cannot create layout directories: {exc}")
    entry_dirs = {store.entry_dir(k) for k in store.entry_keys()}
    for p in _layout_paths(root):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) or (st.st_uid != os.geteuid() and os.geteuid() != 0):
            continue
        if policy.shared and p in entry_dirs:
            continue  # fix_shared_files does these through the entries directory's fd
        mode = stat.S_IMODE(st.st_mode)
        if policy.shared:
            want = (SHARED_ROOT_MODE if p == root else SHARED_ENTRY_MODE if p in entry_dirs
                    else SHARED_DIR_MODE)
        else:
            want = mode & ~0o022
        try:
            if set_mode(p, want, policy.gid if policy.shared else None, directory=True):
                done.append(f"chmod {want:o} {p}" + (f" (group {policy.group})" if policy.shared else ""))
        except ValueError as exc:
            done.append(f"skipped: {exc}")
    if policy.shared and os.path.isdir(store.base):
        from .shared import fix_shared_files

        try:
            done += fix_shared_files(store, policy.gid)  # type: ignore[arg-type]  # shared: a gid
        except OSError as exc:
            done.append(f"skipped: {exc}")
    return done


def check_filesystem(root: str) -> list[Check]:
    """Filesystem type (kernel locks may be unreliable on network filesystems) and free space."""
    out: list[Check] = []
    fs = filesystem_type(root)
    if fs is None:
        out.append(Check("filesystem", "warn", "could not tell the filesystem type (no /proc/self/mountinfo)"))
    else:
        fstype, mnt = fs
        if fstype.lower() in NETWORK_FS or fstype.lower().startswith("nfs"):
            out.append(Check("filesystem", "warn",
                             f"{fstype} at {mnt}: flock may be unreliable or emulated across hosts; "
                             "concurrent builds of one key may duplicate work and pins may not protect "
                             "entries used on other hosts",
                             "put the cache on a local disk (STUBCACHE_DIR), one per host"))
        else:
            out.append(Check("filesystem", "ok", f"{fstype} at {mnt}"))
    try:
        vfs = os.statvfs(_existing_ancestor(root))
        free = vfs.f_bavail * vfs.f_frsize
    except OSError as exc:
        out.append(Check("free space", "warn", f"statvfs failed: {exc}"))
        return out
    from ..edge.units import human_size

    if free < FREE_ERROR:
        out.append(Check("free space", "error", f"{human_size(free)} free", "free disk space or `stubcache prune`"))
    elif free < FREE_WARN:
        out.append(Check("free space", "warn", f"{human_size(free)} free", "consider `stubcache prune --max-size ...`"))
    else:
        out.append(Check("free space", "ok", f"{human_size(free)} free"))
    return out


def check_toolchain(root: str) -> list[Check]:
    """The compiler (``CXX`` or ``c++``), ninja, torch and Python headers, without importing torch."""
    from ..key.fingerprint import Fingerprint

    out: list[Check] = []
    state = Store(root).path("state")
    fingerprint = Fingerprint(state if os.path.isdir(state) else None)
    cxx = os.environ.get("CXX", "c++")
    ident = fingerprint.compiler_identity(cxx)
    if ident.get("path") is None:
        out.append(Check("compiler", "error", f"{cxx!r} not found on PATH",
                         "install a C++ compiler (e.g. g++) or set CXX to one"))
    else:
        first = (ident.get("version") or "").splitlines()[:1]
        out.append(Check("compiler", "ok", f"{cxx} -> {ident['path']}" + (f" ({first[0]})" if first else "")))
    ninja = shutil.which("ninja")
    if ninja is None:
        out.append(Check("ninja", "warn", "ninja not found: stubs built through load_inline will fail "
                         "(plain direct stubs still build)", "pip install ninja"))
    else:
        out.append(Check("ninja", "ok", ninja))
    tfacts = fingerprint.base().get("torch") or {}
    version = tfacts.get("version")
    if fingerprint.torch_dir() is None or version is None:
        out.append(Check("torch", "warn", "torch not found: only direct (torch-free) stubs can be built",
                         "pip install torch>=2.13"))
    else:
        try:
            major, minor = (int(x) for x in str(version).split(".")[:2])
        except ValueError:
            major, minor = (0, 0)
        if (major, minor) < (2, 8):
            out.append(Check("torch", "warn", f"torch {version}: load_inline has no no_implicit_headers, "
                             "so header-free stubs build slowly", "upgrade to torch>=2.13"))
        elif (major, minor) < (2, 13):
            out.append(Check("torch", "warn", f"torch {version} is older than the oldest release tested "
                             "(2.13; see the README's Supported table)", "upgrade to torch>=2.13"))
        else:
            cuda = tfacts.get("cuda")
            out.append(Check("torch", "ok", f"torch {version}" + (f" (CUDA {cuda})" if cuda else " (no CUDA)")))
    inc = sysconfig.get_path("include", scheme="posix_prefix")
    if not inc or not os.path.exists(os.path.join(inc, "Python.h")):
        out.append(Check("python headers", "warn", f"Python.h not found under {inc}",
                         "install the Python development headers (e.g. python3-dev)"))
    else:
        out.append(Check("python headers", "ok", inc))
    return out


def check_environment() -> list[Check]:
    """Settings read from the environment: every malformed one is an error."""
    from ..edge.settings import REQUIRE_HIT, SettingsError, lock_timeout, problems, require_hit

    out: list[Check] = []
    bad = [e for e in problems() if isinstance(e, SettingsError)]
    for exc in bad:
        name = getattr(exc, "name", "remote")
        out.append(Check("setting", "error", str(exc), f"fix or unset {name}"))
    if not any(getattr(e, "name", "") == "STUBCACHE_LOCK_TIMEOUT" for e in bad):
        out.append(Check("lock timeout", "ok", f"{lock_timeout():g}s (STUBCACHE_LOCK_TIMEOUT)"))
    if not any(getattr(e, "name", "") == REQUIRE_HIT for e in bad) and require_hit():
        out.append(Check("require hit", "ok", "STUBCACHE_REQUIRE_HIT is set: a miss raises instead of building"))
    return out


def check_root_config(root: str) -> list[Check]:
    """The settings stored in the root's configuration (``stubcache config``): one that does not
    parse is ignored by every process (the default applies), so it is an error here."""
    from ..edge.errors import TrustError
    from ..edge.settings import ROOT_SETTINGS
    from ..storage.trust import load_root_config

    if not os.path.lexists(os.path.join(root, "stubcache-root.json")):
        return []
    try:
        cfg = load_root_config(root)[1]
    except (TrustError, OSError, ValueError):
        return []  # check_root reports a config it cannot read or trust
    out = []
    for name, parse in ROOT_SETTINGS.items():
        if cfg.get(name) is None:
            continue
        try:
            parse(cfg[name])
        except ValueError as exc:
            out.append(Check("root config", "error", f"{name} in {os.path.join(root, 'stubcache-root.json')} is "
                             f"ignored: {exc}", f"stubcache config set {name} VALUE, or stubcache config unset {name}"))
    return out


def check_writable(root: str) -> list[Check]:
    """Whether this user can create the root, or publish into it: if not, every build is private
    (nothing is shared, every process compiles)."""
    fix = "use a directory you can write (--cache-dir or STUBCACHE_DIR), or fix its permissions"
    target = root
    if os.path.lexists(root) and not os.path.isdir(root):
        return []  # check_root says what is wrong: it is not a directory
    if not os.path.lexists(root):
        target = _existing_ancestor(root)
        if not os.path.isdir(target):
            return [Check("writable", "error", f"{root} cannot be created: {target} is not a directory; builds "
                          "will be private", fix)]
        what = f"{root} cannot be created: {target} is not writable by you; builds will be private"
    else:
        store = Store(root)
        for sub in ("staging", "entries", "locks"):  # where a build writes, if the layout exists
            if os.path.isdir(store.path(sub)):
                target = store.path(sub)
                break
        what = f"{target} is not writable by you: builds will be private and nothing is shared"
    try:
        readonly = bool(os.statvfs(target).f_flag & os.ST_RDONLY)
    except OSError:
        readonly = False
    if readonly:
        return [Check("writable", "error", f"{target} is on a read-only filesystem: builds will be private", fix)]
    if not os.access(target, os.W_OK | os.X_OK):
        return [Check("writable", "error", what, fix)]
    return [Check("writable", "ok", f"{target} is writable")]


def run_checks(root: str) -> list[Check]:
    """Every check, in the order ``doctor`` prints them."""
    from .remote import doctor_checks as check_remote  # imports the client only if configured

    return (check_root(root) + check_writable(root) + check_filesystem(root) + check_toolchain(root)
            + check_environment() + check_root_config(root) + check_remote())
