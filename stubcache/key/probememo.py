"""The toolchain probes' memo per user and host, in the user's own state directory.

:func:`stubcache.key.toolchain.memo` keeps each probe's answer in the cache root's ``state/``, so a
fresh root's first stub used to run the compiler driver about ten times (``--version``, ``-###``,
``-print-prog-name``, ``-E -v``, ``as``/``ld --version``, ...) before it could compile. The
answers depend on the host's binaries, not on the root, so they are also kept here,
``$XDG_STATE_HOME/stubcache/probes/`` (:func:`memo_dir`), and a new root reads them instead of
probing. Each is stored under the same memo key as in a root (which names the binaries by path,
size and modification time, ``PATH`` and the variables that steer the driver) and is still
subject to the probe's own check (:func:`stubcache.key.toolchain.memo`'s ``valid``: the stat
signatures of the compiler proper, assembler and linker it found), so a changed binary is probed
again.

A probe's answer decides which files a build tracks, so it is trusted only as the user's own:
the directory is opened without following a link and must belong to this user and be writable by
no one else; a file must be a regular file of this user's that no one else can write, at most
:data:`CAP` bytes, whose memo key is exactly the one asked for. Anything else is ignored (and
probed again); nothing here ever fails a build. At most :data:`MAX_FILES` answers are kept.
"""

from __future__ import annotations

import os
import stat

from ..edge import cjson, fsroot
from hashlib import sha256

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

CAP = fsroot.SMALL_CAP * 16
MAX_FILES = 256


def memo_dir() -> str | None:
    """Where this user's probe answers are kept: ``$XDG_STATE_HOME/stubcache/probes``, or
    ``$HOME/.local/state/stubcache/probes``, by platformdirs' ``user_state_dir`` rule on Linux
    (computed here: a build must not depend on platformdirs being importable). Only an absolute
    ``XDG_STATE_HOME`` or ``HOME`` counts; with neither, ``None``: no memo (the probes run)."""
    state = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        home = os.environ.get("HOME", "")
        if not os.path.isabs(home):
            return None
        state = os.path.join(home, ".local", "state")
    return os.path.join(state, "stubcache", "probes")


def _name(memo_key: str) -> str:
    return sha256(memo_key.encode("utf-8", "surrogatepass")).hexdigest()[:32] + ".json"


def _own(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _open_dir(create: bool) -> int | None:
    # The state directory itself (XDG_STATE_HOME or ~/.local/state) may be reached through links
    # its owner made, but it must be this user's: root run with another user's HOME (sudo -E)
    # does not write, prune or trust files in a tree that user controls. ``stubcache/probes``
    # below it are opened without following a link and must be this user's too.
    path = memo_dir()
    if path is None:
        return None
    state = os.path.dirname(os.path.dirname(path))
    try:
        if create:
            os.makedirs(state, 0o700, exist_ok=True)
        sfd = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(sfd).st_uid != os.geteuid():
            return None
        fd = fsroot.open_dir_at(sfd, "stubcache", create=create)
        try:
            if not _own(os.fstat(fd)):
                return None
            pfd = fsroot.open_dir_at(fd, "probes", create=create)
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        os.close(sfd)
    if not _own(os.fstat(pfd)):
        os.close(pfd)
        return None
    return pfd


def usable() -> bool:
    """Whether this user's memo directory can hold answers (made if missing, and trusted)."""
    fd = _open_dir(create=True)
    if fd is None:
        return False
    os.close(fd)
    return True


def read(memo_key: str) -> dict[str, Any] | None:
    """The answer kept for ``memo_key`` (a probe's answer is a JSON object), or ``None``."""
    dfd = _open_dir(create=False)
    if dfd is None:
        return None
    try:
        fd = fsroot.open_regular(dfd, _name(memo_key))
        try:
            if not _own(os.fstat(fd)):
                return None
            data = cjson.loads(fsroot.read_fd(fd, CAP))
        finally:
            os.close(fd)
        if isinstance(data, dict) and data.get("memo_key") == memo_key and isinstance(data.get("value"), dict):
            value: dict[str, Any] = data["value"]
            return value
    except (OSError, ValueError, RecursionError):
        pass
    finally:
        os.close(dfd)
    return None


def write(memo_key: str, value: dict[str, Any]) -> None:
    """Keep ``value`` as the answer for ``memo_key`` (atomically, mode ``0600``); best-effort."""
    from ..storage import locking

    dfd = _open_dir(create=True)
    if dfd is None:
        return
    try:
        locking.write_file(dfd, _name(memo_key), cjson.dumps({"memo_key": memo_key, "value": value}).encode(),
                           mode=0o600)
        names = [n for n in fsroot.listdir(dfd) if n.endswith(".json")]
        if len(names) > MAX_FILES:  # the oldest answers go (compilers replaced long ago)
            stamps = []
            for n in names:
                try:
                    stamps.append((fsroot.lstat_at(dfd, n).st_mtime_ns, n))
                except OSError:
                    pass
            for _, n in sorted(stamps)[:len(stamps) - MAX_FILES]:
                fsroot.unlink_at(dfd, n)
    except (OSError, ValueError):
        pass
    finally:
        os.close(dfd)
