"""The caller's ``build_directory``: the library placed at ``<build_directory>/<name>.so``, as
torch leaves it there, and the file the drop-in itself loads.

SGLang, vLLM and others ignore ``load_inline``'s return value and ``dlopen`` (or hand to
``CUDAPluggableAllocator``) ``f"{build_directory}/{name}.so"``. glibc hands back the same handle,
and so the same static state, only for the same device and inode, so the drop-in loads the very
file it placed there. That file is a **copy** of the cache entry's library, never a hard link:
the caller owns the directory and may chmod, truncate or rewrite what it finds there, and a link
would make that the published entry every other process loads.

A build directory is often a predictable path in a world-writable ``/tmp`` (vLLM uses
``tempfile.gettempdir()`` itself). So it is opened once with ``O_NOFOLLOW|O_DIRECTORY`` and every
step is relative to that descriptor: a link planted at the directory fails, one planted at
``<name>.so`` is replaced (``rename`` never follows it), nothing is written outside it. The
directory must belong to this user or root, and must not be writable by others unless it is
sticky (in a sticky directory nobody else can rename or remove our file). Anything else raises a
``PermissionError`` naming the path; a directory that does not exist raises
``FileNotFoundError``, as torch's own write of ``main.cpp`` there would. Nothing stubcache needs
is kept in the directory: callers delete ``lock`` or the whole directory whenever they like.
"""

from __future__ import annotations

import errno
import os

from ..edge import fsroot
from ..storage import locking
from ..hit import PLACED_MODE, build_directory_problem, copy_checked, placed_copy
from ..storage.locking import temp_name

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from ..storage.manifest import Manifest

class Placed:
    """A library placed in a build directory: ``path`` (as torch would return it), ``fd`` (open
    on the placed file, for the mapping check; the caller closes it) and its ``stat``."""

    __slots__ = ("path", "fd", "st")

    def __init__(self, path: str, fd: int, st: os.stat_result) -> None:
        self.path = path
        self.fd = fd
        self.st = st


def _unsafe(message: str, path: str) -> PermissionError:
    return PermissionError(errno.EPERM, f"refusing build_directory: {message}", path)


def open_build_directory(directory: str) -> int:
    """Open ``directory`` for placing a library, after the checks in the module docstring;
    returns its descriptor."""
    try:
        dfd = os.open(directory, fsroot.O_DIR)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        # O_NOFOLLOW|O_DIRECTORY on a link gives ENOTDIR or ELOOP: which one it was, from lstat
        if os.path.islink(directory):
            raise _unsafe("it is a symbolic link (stubcache never follows one there)", directory) from None
        raise NotADirectoryError(errno.ENOTDIR, "build_directory is not a directory", directory) from None
    try:
        problem = build_directory_problem(os.fstat(dfd))
        if problem is not None:
            raise _unsafe(problem, directory)
    except BaseException:
        os.close(dfd)
        raise
    return dfd


def _same_library(dfd: int, name: str, manifest: Manifest) -> tuple[int, os.stat_result] | None:
    """An fd on ``name`` if it already is our copy of the library (see
    :func:`stubcache.hit.placed_copy`, which a warm drop-in call uses directly), else None.
    Reusing it keeps one inode for processes sharing a fixed name in one directory (the NCCL
    allocators)."""
    return placed_copy(dfd, name, manifest.size, manifest.sha256)


def _copy_verified(src_fd: int, dst_fd: int, manifest: Manifest, source: str) -> None:
    """Copy the library, hashing what was read: the copy is the manifest's bytes or an error."""
    if not copy_checked(src_fd, dst_fd, manifest.size, manifest.sha256):
        from ..edge.errors import IntegrityError

        raise IntegrityError(f"library {source} changed while it was copied into the build directory")


def place(directory: str | os.PathLike[str], library: str, manifest: Manifest, module_name: str) -> Placed:
    """Put a verified copy of ``library`` (a cache entry's file, described by ``manifest``) at
    ``<directory>/<module_name>.so``, atomically, unless our identical copy is already there."""
    given = os.fspath(directory)
    name = fsroot.check_name(f"{module_name}.so")
    path = os.path.join(given, name)
    dfd = open_build_directory(given)
    try:
        # Processes placing one name in one directory (a fixed name in /tmp) take turns on a flock
        # of the directory itself (no file of ours there): the first writes, the others find its
        # copy and keep that inode. Bounded: past the lock timeout (someone holding /tmp's lock),
        # place it unlocked; the rename is atomic either way.
        locking.wait_flock(dfd, locking.EX, locking.lock_timeout_from_env())
        same = _same_library(dfd, name, manifest)
        if same is not None:
            return Placed(path, *same)
        fd = _write_copy(dfd, name, library, manifest, path)
        return Placed(path, fd, os.fstat(fd))
    finally:
        os.close(dfd)  # drops the flock


def _write_copy(dfd: int, name: str, library: str, manifest: Manifest, path: str) -> int:
    """Copy into a fresh temporary name in the directory, then rename it to ``name``; returns an
    fd on the file now at ``name``."""
    src = fsroot.open_regular(None, library)
    try:
        tmp = temp_name(name)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PLACED_MODE, dir_fd=dfd)
        try:
            _copy_verified(src, fd, manifest, library)
            try:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # replaces a link at name, never follows it
            except PermissionError:  # a file another user owns there, in a sticky directory
                raise PermissionError(errno.EPERM, "cannot replace the library in build_directory (it "
                                      "belongs to another user); remove it or use another build_directory",
                                      path) from None
            except IsADirectoryError:
                raise IsADirectoryError(errno.EISDIR, "cannot place the library in build_directory: a "
                                        "directory has its name", path) from None
        except BaseException:
            fsroot.unlink_at(dfd, tmp)
            os.close(fd)
            raise
        return fd
    finally:
        os.close(src)
