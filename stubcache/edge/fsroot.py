"""Every filesystem step under a cache root, done one way: through directory file descriptors.

In a shared root any group member can rename, replace or plant anything below ``v1/``, and
administrators run ``prune``/``verify``/``clear`` there as root. So nothing below the root is
reached by a path string that the kernel resolves afresh: a directory is opened once, component
by component, with ``O_NOFOLLOW|O_DIRECTORY`` (a planted symlink fails with ``ELOOP``), and every
later step is relative to that descriptor (``dir_fd=``). Reads open with ``O_NONBLOCK|O_NOFOLLOW``,
accept regular files only and are capped (a FIFO cannot hang a reader, a 10 GB file cannot
exhaust memory). Walks and tree removal are this module's own, iterative and bounded in depth
and count (the standard library's recurse, and ``shutil.rmtree(dir_fd=)`` is 3.11+); a mode is
only ever changed through a descriptor this module opened itself, on a directory we own.

Names read from a directory or a manifest are checked with :func:`check_name` before they are
used relative to a descriptor, and are printed through :func:`printable`. Locks and atomic
writes, built on these, are in :mod:`stubcache.storage.locking`.
"""

from __future__ import annotations

import errno
import os
import stat

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

SMALL_CAP = 1 << 20        # leases, failure records, configs, memos, quarantine reasons
EVENTS_CAP = 64 << 20      # one event file (an archive holds many processes' lines)
MANIFEST_CAP = 1 << 30     # a manifest holds the spec's sources: tens of MB must still load
LIBRARY_CAP = 4 << 30      # a library is hashed before use: a 16 TiB sparse file must not be


class NotRegularFile(OSError):
    """A path that should be a regular file is a FIFO, device, socket, directory or symlink."""


class FileTooLarge(ValueError):
    """A file is larger than the cap for what it is supposed to hold."""


def kind(mode: int) -> str:
    """A word for the file type in ``mode`` (for messages)."""
    for test, word in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return word
    return "unknown file type"


def printable(text: object, limit: int = 200) -> str:
    """``text`` with control and non-printable characters escaped (``\\n``, ``\\x1b``...) and cut to
    ``limit`` characters: for names and values from a root that someone else may have written."""
    s = text if isinstance(text, str) else str(text)
    if s.isprintable() and len(s) <= limit:
        return s
    out = s.encode("unicode_escape", "backslashreplace").decode("ascii") if not s.isprintable() else s
    return out if len(out) <= limit else out[:limit] + "…"


def check_name(name: str) -> str:
    """``name`` if it is a single path component; ``ValueError`` for ``..``, ``/``, NUL, empty."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a plain file name: {printable(repr(name))}")
    return name


def open_dir(path: str, *parts: str, create: bool = False, mode: int = 0o700) -> int:
    """Open ``path`` and then each of ``parts`` below it, never following a symlink; returns an fd
    (close it). ``path`` itself must not be a symlink (its parents may be). With ``create``,
    missing components are made with ``mode`` (and ``fchmod``-ed to it, whatever the umask).
    Raises ``OSError`` (``ELOOP`` for a symlink, ``ENOTDIR`` for another file type)."""
    return open_dir_at(os.open(path, O_DIR), *parts, create=create, mode=mode, own=True)


def open_dir_at(fd: int, *parts: str, create: bool = False, mode: int = 0o700, own: bool = False) -> int:
    """:func:`open_dir` starting from the directory open as ``fd`` (which is closed only when
    ``own``). With no ``parts``, a new descriptor of that directory."""
    if not own:
        fd = os.open(".", O_DIR, dir_fd=fd)
    try:
        for part in parts:
            check_name(part)
            try:
                nfd = os.open(part, O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                    made = True
                except FileExistsError:
                    made = False
                nfd = os.open(part, O_DIR, dir_fd=fd)
                if made:
                    try:
                        os.fchmod(nfd, mode)
                    except OSError:
                        pass
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


class Dir:
    """``with Dir(path, *parts) as fd:`` — :func:`open_dir` as a context manager."""

    __slots__ = ("fd", "_args", "_kw")

    def __init__(self, path: str, *parts: str, **kw: Any) -> None:
        self._args = (path, *parts)
        self._kw = kw
        self.fd = -1

    def __enter__(self) -> int:
        self.fd = open_dir(*self._args, **self._kw)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def mkdir_mode(path: str, mode: int) -> None:
    """``mkdir`` then ``fchmod`` to exactly ``mode`` (whatever the umask) through an fd opened on
    the new directory without following links."""
    os.mkdir(path, 0o700)
    fd = os.open(path, O_DIR)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def own_single(st: os.stat_result) -> bool:
    """True if a file may have its mode or times changed by us: this uid's own, and (unless a
    directory) with no other hard link. A member can hard-link a file from outside the root
    (/etc/shadow, when root owns both) where a lock or pin file belongs; root must not chmod it."""
    return st.st_uid == os.geteuid() and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1)


def listdir(dir_fd: int) -> list[str]:
    """Sorted names in the directory open as ``dir_fd`` (hidden names included)."""
    return sorted(os.listdir(dir_fd))


def lstat_at(dir_fd: int, name: str) -> os.stat_result:
    return os.stat(check_name(name), dir_fd=dir_fd, follow_symlinks=False)


def open_regular(dir_fd: int | None, name: str, flags: int = 0, follow: bool = False) -> int:
    """Open a regular file for reading without following a link or blocking on a FIFO; returns
    the fd. ``NotRegularFile`` for any other type. (``O_NONBLOCK`` stays set: it means nothing
    for a regular file.) ``follow``: links are followed (a path outside any root, read as the
    tool that reads it would: a linker script, a specs file, torch's source)."""
    if follow:
        fd = os.open(name, (O_READ & ~os.O_NOFOLLOW) | flags, dir_fd=dir_fd)
    elif dir_fd is None:
        fd = os.open(name, O_READ | flags)
    else:
        fd = os.open(check_name(name), O_READ | flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"is a {kind(st.st_mode)}, not a regular file", name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_fd(fd: int, cap: int, name: str = "file") -> bytes:
    """The whole content of an open regular file, at most ``cap`` bytes (``FileTooLarge`` beyond)."""
    size = os.fstat(fd).st_size
    if size > cap:
        raise FileTooLarge(f"{printable(name)} is {size} bytes, over the {cap}-byte limit for it")
    chunks = []
    total = 0
    while True:
        want = min(max(size - total, 0) + 1, cap + 1 - total)  # one more byte than expected: EOF seen
        chunk = os.pread(fd, want, total)
        chunks.append(chunk)
        total += len(chunk)
        if total > cap:
            raise FileTooLarge(f"{printable(name)} grew over the {cap}-byte limit while being read")
        if len(chunk) < want:
            break  # short read of a regular file: end of file
    return b"".join(chunks)


def read_at(dir_fd: int | None, name: str, cap: int = SMALL_CAP) -> bytes:
    """Read a regular file ``name`` (relative to ``dir_fd``, or a path when ``dir_fd`` is None),
    typed and bounded: :class:`NotRegularFile` (an ``OSError``) or :class:`FileTooLarge` (a
    ``ValueError``) instead of blocking or reading without end."""
    fd = open_regular(dir_fd, name)
    try:
        return read_fd(fd, cap, name)
    finally:
        os.close(fd)


def unlink_at(dir_fd: int, name: str) -> bool:
    """Remove a non-directory ``name`` (a link itself, never its target). False if it was gone."""
    try:
        os.unlink(check_name(name), dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def rename_at(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    os.rename(check_name(src), check_name(dst), src_dir_fd=src_fd, dst_dir_fd=dst_fd)


# Walks and removals are iterative (a stack of directory descriptors, never recursion: a member
# can plant a tree 3,000 levels deep) and bounded: deeper than MAX_DEPTH levels or past MAX_ENTRIES
# names they stop and say what they left. A build tree is a few levels deep and a few hundred files.
MAX_DEPTH = 128
MAX_ENTRIES = 1_000_000


class TreeRemoval:
    """What :func:`remove_tree_at` did: ``gone`` if nothing is left; otherwise ``refused`` says why.
    (A plain class, not a dataclass: this module is on the hit path, which does not import
    ``dataclasses``.)"""

    __slots__ = ("gone", "removed", "refused")

    def __init__(self, gone: bool, removed: int = 0, refused: str = "") -> None:
        self.gone = gone
        self.removed = removed    # names removed (files, links, directories)
        self.refused = refused    # "" or what was left and why, for a message

    def __bool__(self) -> bool:
        return self.gone

    def __repr__(self) -> str:
        return f"TreeRemoval(gone={self.gone}, removed={self.removed}, refused={self.refused!r})"


def _open_child_dir(parent_fd: int, name: str) -> int:
    """Open a subdirectory without following a link, and give it ``u+rwx`` if this uid owns it and
    it lacks it (a build tree with a read-only directory); the mode changes through this fd only."""
    fd = os.open(name, O_DIR, dir_fd=parent_fd)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)
    except OSError:
        pass
    return fd


def _names(fd: int, budget: int) -> list[tuple[str, bool]]:
    """(name, is a directory, not following links) for at most ``budget`` entries of ``fd``."""
    out: list[tuple[str, bool]] = []
    with os.scandir(fd) as it:
        for entry in it:
            if len(out) >= budget:
                break
            try:
                out.append((entry.name, entry.is_dir(follow_symlinks=False)))
            except OSError:
                out.append((entry.name, False))
    return out


def _depth_note(depth: int, max_depth: int, entries: int, max_entries: int) -> str:
    if entries >= max_entries:
        return f"stopped after {max_entries} names (a tree that large is not a build tree)"
    return f"left what lies deeper than {max_depth} levels (remove it by hand, e.g. rm -rf)"


def remove_tree_at(dir_fd: int, name: str, *, max_depth: int = MAX_DEPTH,
                   max_entries: int = MAX_ENTRIES) -> TreeRemoval:
    """Remove ``name`` below ``dir_fd`` whatever it is: a file, link, FIFO... is unlinked (a link
    itself, never its target); a directory is emptied depth-first through descriptors, never
    following a link, at most ``max_depth`` levels and ``max_entries`` names, then removed.
    What could not be removed within those bounds stays, and ``refused`` says so."""
    check_name(name)
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return TreeRemoval(True)
    if not stat.S_ISDIR(st.st_mode):
        unlink_at(dir_fd, name)
        return TreeRemoval(True, 1)
    try:
        top = _open_child_dir(dir_fd, name)
    except FileNotFoundError:
        return TreeRemoval(True)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced by a link or file since the stat
            unlink_at(dir_fd, name)
            return TreeRemoval(True, 1)
        return TreeRemoval(False, 0, f"could not open it: {exc.strerror}")
    removed = 0
    seen = 0
    refused = ""
    failed = False
    # Each frame: (fd, its name in the parent, the names still to remove in it).
    stack: list[tuple[int, str, list[tuple[str, bool]]]] = []
    try:
        stack.append((top, name, _names(top, max_entries)))
        seen += len(stack[-1][2])
        if seen >= max_entries:
            refused = _depth_note(1, max_depth, seen, max_entries)
        while stack:
            fd, _dname, todo = stack[-1]
            if todo:
                child, is_dir = todo.pop()
                if not is_dir:
                    try:
                        os.unlink(child, dir_fd=fd)
                        removed += 1
                    except FileNotFoundError:
                        pass
                    except IsADirectoryError:
                        todo.append((child, True))  # replaced by a directory meanwhile
                    except OSError:
                        failed = True
                    continue
                if len(stack) >= max_depth:
                    refused = refused or _depth_note(len(stack), max_depth, seen, max_entries)
                    continue
                try:
                    cfd = _open_child_dir(fd, child)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced by a link or file
                        todo.append((child, False))
                    else:
                        failed = True
                    continue
                try:
                    names = _names(cfd, max(max_entries - seen, 0))
                except OSError:
                    os.close(cfd)
                    failed = True
                    continue
                seen += len(names)
                if seen >= max_entries:
                    refused = refused or _depth_note(len(stack), max_depth, seen, max_entries)
                stack.append((cfd, child, names))
                continue
            stack.pop()
            os.close(fd)
            parent = stack[-1][0] if stack else dir_fd
            try:
                os.rmdir(_dname, dir_fd=parent)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                failed = True
    finally:
        for fd, _n, _t in stack:
            os.close(fd)
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return TreeRemoval(True, removed)
    if not refused and failed:
        refused = "some names could not be removed (permissions, or a file system that refused)"
    return TreeRemoval(False, removed, refused or "it changed while it was being removed")


def rmtree_at(dir_fd: int, name: str) -> bool:
    """:func:`remove_tree_at` with the default bounds; True if ``name`` is gone."""
    return remove_tree_at(dir_fd, name).gone


def rmtree(path: str) -> bool:
    """:func:`rmtree_at` for an absolute ``path`` (its parent is opened without following)."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        pfd = os.open(parent or "/", O_DIR)
    except OSError:
        return not os.path.lexists(path)
    try:
        return rmtree_at(pfd, name)
    finally:
        os.close(pfd)


def tree_size_at(dir_fd: int, name: str, limit: int = 100_000, max_depth: int = MAX_DEPTH) -> int:
    """Bytes of regular files under ``name`` (links not followed; at most ``limit`` names and
    ``max_depth`` levels looked at: past either, the sum so far). Iterative, like the removal."""
    try:
        st = os.stat(check_name(name), dir_fd=dir_fd, follow_symlinks=False)
    except (OSError, ValueError):
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size if stat.S_ISREG(st.st_mode) else 0
    total = 0
    seen = 0
    try:
        top = os.open(name, O_DIR, dir_fd=dir_fd)
    except OSError:
        return 0
    stack = [top]
    pending: list[list[tuple[int, str]]] = [[]]  # per level: subdirectories still to visit
    try:
        level_names = [(top, n, d) for n, d in _names(top, limit)]
        seen += len(level_names)
        for fd, n, d in level_names:
            if d:
                pending[0].append((fd, n))
            else:
                total += _file_size(fd, n)
        while stack:
            if not pending[-1]:
                os.close(stack.pop())
                pending.pop()
                continue
            pfd, child = pending[-1].pop()
            if len(stack) >= max_depth or seen >= limit:
                continue
            try:
                cfd = os.open(child, O_DIR, dir_fd=pfd)
            except OSError:
                continue
            stack.append(cfd)
            pending.append([])
            try:
                names = _names(cfd, limit - seen)
            except OSError:
                names = []
            seen += len(names)
            for n, d in names:
                if d:
                    pending[-1].append((cfd, n))
                else:
                    total += _file_size(cfd, n)
    finally:
        for fd in stack:
            os.close(fd)
    return total


def _file_size(dir_fd: int, name: str) -> int:
    try:
        s = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return 0
    return s.st_size if stat.S_ISREG(s.st_mode) else 0
