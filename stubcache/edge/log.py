"""Lazy access to the ``stubcache`` logger: ``logging`` costs milliseconds to import, and the hit
path logs nothing, so it is imported only when something is logged."""

from __future__ import annotations

import sys
import threading

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    import logging

_stderr_level: str | None = None  # set by the command line; applied by the next logger()
_stderr_lock = threading.Lock()


def logger() -> logging.Logger:
    import logging

    log = logging.getLogger("stubcache")
    if _stderr_level is not None:
        _apply_stderr(log)
    return log


def log_to_stderr(level: str) -> None:
    """Print this logger's messages of ``level`` (``"WARNING"``...) and above as bare lines on
    stderr: the command line's setting. It takes effect when something is first logged, so a
    command that logs nothing does not import ``logging``."""
    global _stderr_level
    _stderr_level = level


def _apply_stderr(log: logging.Logger) -> None:
    import logging

    global _stderr_level
    with _stderr_lock:
        if _stderr_level is None:
            return
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
        log.setLevel(_stderr_level)
        _stderr_level = None


def warning(msg: str, *args: object) -> None:
    from .progress import clear_lines

    clear_lines()  # a status line on the terminal would run into the message
    logger().warning(msg, *args)


def info(msg: str, *args: object) -> None:
    logger().info(msg, *args)


def debug(msg: str, *args: object) -> None:
    """A build's phase, for whoever watches (``logging.getLogger("stubcache")`` at ``DEBUG``).
    Nothing, not even the import of ``logging``, unless ``logging`` is imported already: a
    process that never imported it cannot have given this logger a handler (a torch-free
    process's build stays free of its import)."""
    logging = sys.modules.get("logging")
    if logging is None and _stderr_level is None:
        return
    logger().debug(msg, *args)
