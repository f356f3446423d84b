"""Checks that what the dynamic loader mapped for a path is the file stubcache verified.

Libraries are loaded by their real path, so debuggers, profilers and symbolizers (torch's
``TORCH_SHOW_CPP_STACKTRACES`` runs ``addr2line -e <path>`` in a child process) see a path in
``/proc/self/maps`` that names the file in any process. Loading by path opens the file a second
time, so afterwards the mapping is compared with the descriptor the checksum was computed through.

The direct way (:func:`_first_segment`) asks the loader where the object it returned is (its load
address, ``dlinfo``), finds its first segment from the verified file's own ELF headers, and stats
that one mapping through ``/proc/self/map_files``: one ``stat`` instead of reading and searching
all of ``/proc/self/maps`` (0.1 ms in a bare process, 0.4-0.6 ms in one with torch loaded). All
segments of one loaded object come from the one file the loader opened, so that mapping's device
and inode are the object's. Anything it cannot establish (another ELF layout, no ``dlinfo``, a
mapping the kernel merged or split differently, a mismatch) goes the full way, which decides.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)

# The direct way's pieces live in stubcache.hit, which checks a recorded hit's mapping
# without importing this module; both share the set of paths already checked.
from ..hit import (MAPPED as _checked, first_segment as _first_segment,  # noqa: E402
                   mappings_against as _mappings_against)

def check_mapped(path: str, st: os.stat_result, sha256: str, handle: int | None = None,
                 fd: int | None = None) -> None:
    """Raise :class:`IntegrityError` unless every mapping of ``path`` is the verified file
    (device and inode of ``st``). Where the kernel reports another device or inode for a file it
    maps (overlayfs on some kernels reports the underlying layer's), the mapped bytes are read back
    through ``/proc/self/map_files`` and compared with the verified checksum instead.

    Once a path has passed, later loads of it in this process are not checked again: glibc hands
    back the handle it already has for that name, the one that was checked, even if the entry has
    since been pruned and rebuilt at the same path (same key, so the same inputs).

    With the ``dlopen`` ``handle`` and the verified descriptor ``fd``, a match of the object's
    first mapping (see the module docstring) settles it without reading ``/proc/self/maps``."""
    if path in _checked:
        return
    if handle is not None and fd is not None:
        try:
            span = _first_segment(fd, handle)
            mapped = os.stat(f"/proc/self/map_files/{span}") if span else None
        except (OSError, ValueError, OverflowError):  # a header pread cannot follow: the full way
            mapped = None
        if mapped is not None and (mapped.st_dev, mapped.st_ino) == (st.st_dev, st.st_ino):
            _checked.add(path)
            return
    from ..edge.errors import IntegrityError  # the full way only: a hit that matches never imports it
    from .store import file_sha256

    # Where the kernel shows another pair in /proc/self/maps than fstat (btrfs, overlayfs before
    # Linux 6.8), the mapped bytes are read back through /proc/self/map_files and checksummed.
    # A process that may not (it lacks CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN) compares the
    # pair with the one the verified descriptor's own mapping shows (maps read again with it).
    maps, view = _mappings_against(os.path.realpath(path), st, fd)
    if not maps:
        raise IntegrityError(f"{path} was loaded but does not appear in /proc/self/maps; refusing it")
    for dev, ino, span in maps:
        if (dev, ino) == (st.st_dev, st.st_ino):
            continue
        try:
            mapped_fd = os.open(f"/proc/self/map_files/{span}", os.O_RDONLY | os.O_CLOEXEC)
        except PermissionError:
            if (dev, ino) == view:
                continue
            mapped_fd = -1
        except OSError:
            mapped_fd = -1
        if mapped_fd >= 0:
            try:
                if file_sha256(mapped_fd) == sha256:
                    continue
            finally:
                os.close(mapped_fd)
        raise IntegrityError(
            f"the file mapped for {path} (device {dev}, inode {ino}) is not the verified file (device "
            f"{st.st_dev}, inode {st.st_ino}): the entry was replaced while it was loading; refusing it")
    _checked.add(path)
