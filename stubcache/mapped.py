"""Checks that what the dynamic loader mapped for a path is the file stubcache verified.

Libraries are loaded by their real path, so debuggers, profilers and symbolizers (torch's
``TORCH_SHOW_CPP_STACKTRACES`` runs ``addr2line -e <path>`` in a child process) see a path in
``/proc/self/maps`` that names the file in any process. Loading by path opens the file a second
time, so afterwards the mapping is compared with the descriptor the checksum was computed through.
"""

from __future__ import annotations

import os

from .errors import IntegrityError


def _mappings(path: str) -> list[tuple[int, int, str]]:
    """``(dev, inode, address range)`` of each mapping of ``path`` in this process."""
    with open("/proc/self/maps", "rb") as fh:
        data = fh.read()
    name = os.fsencode(path)
    out = []
    i = data.find(name)
    while i != -1:  # only the lines naming the path are parsed (a torch process has hundreds)
        start = data.rfind(b"\n", 0, i) + 1
        end = data.find(b"\n", i)
        parts = data[start:end if end != -1 else len(data)].split(None, 5)
        if len(parts) == 6 and parts[5] in (name, name + b" (deleted)"):  # the kernel's spelling
            major, minor = (int(x, 16) for x in parts[3].split(b":"))
            out.append((os.makedev(major, minor), int(parts[4]), parts[0].decode()))
        i = data.find(name, end if end != -1 else len(data))
    return out


_checked: set[str] = set()  # paths loaded and checked in this process


def check_mapped(path: str, st: os.stat_result, sha256: str) -> None:
    """Raise :class:`IntegrityError` unless every mapping of ``path`` is the verified file
    (device and inode of ``st``). Where the kernel reports another device or inode for a file it
    maps (overlayfs on some kernels reports the underlying layer's), the mapped bytes are read back
    through ``/proc/self/map_files`` and compared with the verified checksum instead.

    Once a path has passed, later loads of it in this process are not checked again: glibc hands
    back the handle it already has for that name, the one that was checked, even if the entry has
    since been pruned and rebuilt at the same path (same key, so the same inputs)."""
    if path in _checked:
        return
    from .store import file_sha256

    maps = _mappings(os.path.realpath(path))
    if not maps:
        raise IntegrityError(f"{path} was loaded but does not appear in /proc/self/maps; refusing it")
    for dev, ino, span in maps:
        if (dev, ino) == (st.st_dev, st.st_ino):
            continue
        try:
            fd = os.open(f"/proc/self/map_files/{span}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                if file_sha256(fd) == sha256:
                    continue
            finally:
                os.close(fd)
        raise IntegrityError(
            f"the file mapped for {path} (device {dev}, inode {ino}) is not the verified file (device "
            f"{st.st_dev}, inode {st.st_ino}): the entry was replaced while it was loading; refusing it")
    _checked.add(path)
