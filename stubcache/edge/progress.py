"""What a person at a terminal sees while a stub builds: the ``verbose=`` flag of the drop-ins
(torch's build output, live) and a one-line status for long builds and waits.

The status line appears only when stderr is a terminal and the build or wait has lasted
``STATUS_AFTER`` seconds; it is rewritten in place once a second and erased when done. Nothing is
ever written when stderr is a pipe or a file, so logs stay clean.
"""

from __future__ import annotations

import os
import sys
import time
import threading

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    import threading
    from typing import Callable

STATUS_AFTER = 2.0
_state = threading.local()


def verbose() -> bool:
    """Whether the current thread's build was asked for ``verbose=True``."""
    return getattr(_state, "verbose", False)


class verbose_scope:
    """``with verbose_scope(True): ...``: builds on this thread show torch's verbose output."""

    def __init__(self, flag: bool) -> None:
        self.flag = bool(flag)
        self.prev = False

    def __enter__(self) -> None:
        self.prev = verbose()
        _state.verbose = self.flag

    def __exit__(self, *exc: object) -> None:
        _state.verbose = self.prev


def echo(text: str) -> None:
    """Write verbose output where torch's verbose build writes it: file descriptor 1, after
    flushing ``sys.stdout`` so the order of lines holds."""
    try:
        sys.stdout.flush()
    except (AttributeError, ValueError, OSError):
        pass
    try:
        os.write(1, text.encode("utf-8", "replace"))
    except OSError:
        pass


def _stderr_fd() -> int | None:
    """stderr's fd if it is a terminal, else None."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        return None
    try:
        return fd if os.isatty(fd) else None
    except OSError:
        return None


def stderr_is_terminal() -> bool:
    """Whether standard error is a terminal (where a person reads status and notices)."""
    return _stderr_fd() is not None


_shown: set["status"] = set()  # status lines on the terminal now


def clear_lines() -> None:
    """Erase any status line before a log message is written, so the message starts on a clean
    line; the line is drawn again on its next tick."""
    for line in list(_shown):
        line._write("\r\x1b[K")
        _shown.discard(line)


class status:
    """``with status(lambda: "building foo (direct)"): ...``: a live line on a terminal.

    ``describe`` is called once a second from a helper thread (only on a terminal and only after
    ``STATUS_AFTER`` seconds), so it may read a lease file to say whom a waiter waits for.
    """

    def __init__(self, describe: Callable[[], str]) -> None:
        import threading  # a build or a wait: never on a hit

        self.describe = describe
        self.fd: int | None = None
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.shown = False

    def __enter__(self) -> "status":
        if verbose():  # torch's own output is on the terminal: no line to interleave with it
            return self
        self.fd = _stderr_fd()
        if self.fd is not None:
            import threading

            self.thread = threading.Thread(target=self._run, name="stubcache-status", daemon=True)
            self.thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        if self.done.wait(STATUS_AFTER):
            return
        while True:
            try:
                text = f"stubcache: {self.describe()}, {time.monotonic() - t0:.0f}s"
            except Exception:  # a status line must never break a build
                text = f"stubcache: working, {time.monotonic() - t0:.0f}s"
            width = _columns(self.fd) - 1
            self._write("\r" + text[:width] + "\x1b[K")
            self.shown = True
            _shown.add(self)
            if self.done.wait(1.0):
                return

    def _write(self, text: str) -> None:
        try:
            os.write(self.fd, text.encode("utf-8", "replace"))  # type: ignore[arg-type]  # shown only with an fd
        except OSError:
            pass

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()
            if self in _shown:
                self._write("\r\x1b[K")
            _shown.discard(self)


def _columns(fd: int | None) -> int:
    try:
        cols = os.get_terminal_size(fd).columns  # type: ignore[arg-type]  # None: the TypeError below
    except (OSError, TypeError, ValueError):
        cols = 0
    return max(cols, 20) if cols else 80  # 0: a terminal that never said its size


class Bar:
    """A progress bar for the CLI's long operations, on stderr and only when it is a terminal
    (no dependency; redrawn at most 10 times a second, erased when closed). Call it with
    ``(done, total)``; use as a context manager."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.fd = _stderr_fd()
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if self.fd is None or total <= 1:
            return
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        width = max(10, min(40, _columns(self.fd) - len(self.label) - 20))
        filled = width * done // total
        text = f"\r{self.label} [{'#' * filled}{' ' * (width - filled)}] {done}/{total}\x1b[K"
        try:
            os.write(self.fd, text.encode())
            self.shown = True
        except OSError:
            self.fd = None

    def __enter__(self) -> "Bar":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.shown and self.fd is not None:
            try:
                os.write(self.fd, b"\r\x1b[K")
            except OSError:
                pass
