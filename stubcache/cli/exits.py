"""Exit codes, the exceptions commands raise to end with one, and :func:`run_command`: the one
place that turns an exception into a message and an exit code (``stubcache --help`` and
docs/cli.md list the codes)."""

from __future__ import annotations

import sys
from typing import Callable

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_ABORTED = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # the reader went away (`stubcache ls | head -1`): 128 + SIGPIPE, as a shell reports
EXIT_NOT_RUN = 127  # `run`: the command could not be started (as a shell says)


class CommandError(Exception):
    """An error that ends a command with ``exit_code`` and its message (no traceback)."""

    exit_code = EXIT_PROBLEMS


class UsageError(CommandError):
    """Bad input from the user: printed without a traceback, exit 2."""

    exit_code = EXIT_USAGE


class NotConfirmed(CommandError):
    """The user did not confirm (answered no, or no terminal and no ``--yes``): exit 3."""

    exit_code = EXIT_ABORTED


class Failed(CommandError):
    """The command ran and cannot go on (a setting it cannot write, a remote store that is down):
    its message is printed, exit 1."""

    exit_code = EXIT_PROBLEMS


class NotRun(CommandError):
    """``run`` could not start its command: exit 127, as a shell says."""

    exit_code = EXIT_NOT_RUN


def error(text: str) -> None:
    """``stubcache: TEXT`` on stderr."""
    sys.stderr.write(f"stubcache: {text}\n")


def broken_pipe() -> int:
    """The output's reader went away: exit quietly, as other Unix tools (stdout pointed at
    /dev/null, so that the exit-time flush is silent too)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return EXIT_BROKEN_PIPE


def run_command(command: Callable[[], int]) -> int:
    """Run one command; its return value is the exit code, and each exception it raises maps to
    one code here, with a one-line message instead of a traceback."""
    from ..edge.errors import StubCacheError
    from ..edge.settings import SettingsError

    try:
        return command()
    except BrokenPipeError:
        return broken_pipe()
    except SettingsError as exc:
        error(str(exc))
        return EXIT_USAGE
    except CommandError as exc:
        error(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        error("interrupted")
        return EXIT_INTERRUPTED
    except (StubCacheError, OSError) as exc:
        # A hostile or broken root gets a one-line message, never a traceback.
        from ..edge.fsroot import printable
        from ..remote.config import RemoteConfigError

        error(printable(exc, 2000))
        # a remote setting stubcache cannot use is a malformed setting, as the others (exit 2)
        return EXIT_USAGE if isinstance(exc, RemoteConfigError) else EXIT_PROBLEMS
