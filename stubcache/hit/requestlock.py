"""Whose turn it is to serve a request that has no hit record yet (a miss only: the hit path
does not import this module). A herd of engines starting at once on one key: one process serves
the request and leaves the record, the others wait for it and take that record through
:mod:`stubcache.hit`."""

from __future__ import annotations

import os
import stat
import threading

from . import open_state, private_ok

# How long a request waits for another process that is serving it (building, usually) before it
# takes the full path itself, which waits on the key's build lock, bounded, with the notice and
# the terminal's status line naming the builder (stubcache.edge.progress.STATUS_AFTER after that:
# a direct build, what a herd waits for, is done well within it).
REQUEST_WAIT = 1.0
WAITED = -1  # request_turn's answer: another process served the request meanwhile


def request_lock_name(digest: str) -> str:
    return f"hit-{digest}.lock"


def request_turn(root: str, digest: str, make_root: bool = False) -> int | None:
    # Called when no record answers the request ``digest`` in ``root``: whose turn it is to
    # serve it. The request's lock (``v1/state/hit-<digest>.lock``, an exclusive ``flock``) is
    # taken without waiting: its fd is returned, held, and the caller takes the full path and
    # closes the fd once that has left its record. If another process holds it (serving the same
    # request, which a herd of engines starting at once does), this waits until that process
    # lets go, at most :data:`REQUEST_WAIT` seconds, and returns :data:`WAITED`: ``find`` again,
    # and the full path if there is still no record. ``None``: no lock here (no root and not
    # ``make_root``, not a private root, an odd file); take the full path. A missing root (with
    # ``make_root``: the request is known to be valid, a StubSpec) and, in a private root, a
    # missing ``v1/state`` are made (0700), as the full path would make them.
    #
    # Only a shortcut: the full path's build lock is what makes builds happen once (invariant 1).
    # A process that dies drops the lock (a kernel flock). The wait is a blocking shared ``flock``
    # in a helper thread, so it ends the moment the holder lets go and costs nothing meanwhile;
    # the thread owns its descriptor (nothing else can be given that number while it waits) and
    # closes it as soon as the lock is granted, so a wait that timed out leaves nothing held.
    import fcntl

    try:
        try:
            state_fd = open_state(root, make=True)
        except FileNotFoundError:
            if not make_root:
                return None  # the full path makes it, once it has checked the request
            os.makedirs(root, mode=0o700, exist_ok=True)  # as Store.ensure makes a missing root
            state_fd = open_state(root, make=True)
        if state_fd is None:
            return None  # a shared (or narrowed) root: the full path reads its configuration
        try:
            fd = os.open(request_lock_name(digest), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         0o600, dir_fd=state_fd)
        finally:
            os.close(state_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not private_ok(st):
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        pass
    done = threading.Event()

    def wait() -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:
            pass
        finally:
            os.close(fd)  # drops the shared lock at once
            done.set()

    try:
        threading.Thread(target=wait, name="stubcache-request-wait", daemon=True).start()
    except BaseException:
        os.close(fd)
        raise
    done.wait(REQUEST_WAIT)
    return WAITED
