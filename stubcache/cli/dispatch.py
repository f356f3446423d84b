"""``main``: parse the command line, send the ``stubcache`` logger to stderr, and run the chosen
command through :func:`.exits.run_command`."""

from __future__ import annotations

import sys

from ..edge import log
from .exits import EXIT_USAGE, broken_pipe, run_command
from .parser import build_parser

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    import argparse

# options whose value may be a negative number: `--max-size -5G` would read as a missing value,
# so it is joined as `--max-size=-5G` and the option's own check answers
_SIGNED_VALUE_OPTIONS = ("--max-size", "--older-than", "--quarantine-age")


def _validate_remote(args: argparse.Namespace) -> None:
    """The remote tier's settings, where a remote store is named (``STUBCACHE_REMOTE`` or
    ``--remote-url``): their shape only (URL, mode, timeout, lease, secret length), as the admin
    commands read them; what loading code needs besides (a secret) is checked where it is loaded."""
    from ..edge.settings import remote_configured

    url = getattr(args, "remote_url", None)
    if not (url or remote_configured()):
        return
    from ..remote.config import config_from_env

    config_from_env(url=url, timeout=getattr(args, "remote_timeout", None), for_admin=True)


def _settings_problem(args: argparse.Namespace) -> int | None:
    """Check every setting once at start: a malformed STUBCACHE_* variable (exit 2) or a root
    that is a file (exit 1: nothing can work) ends here with one line, before any command runs."""
    from ..edge.settings import root_path_problem, validate
    from .common import root
    from .exits import EXIT_PROBLEMS, error

    rc = run_command(lambda: validate() or _validate_remote(args) or 0)  # type: ignore[func-returns-value]
    if rc:
        return rc
    if args.command in ("dir", "run") or getattr(args, "dir", None):  # `dir` prints the path; `run` hands it to its command
        return None
    source = "--cache-dir" if getattr(args, "cache_dir", None) else "STUBCACHE_DIR"
    problem = root_path_problem(root(args), source)
    if problem is not None:
        error(problem)
        return EXIT_PROBLEMS
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stubcache`` console script; returns the exit code."""
    try:
        try:
            return _main(argv)
        finally:
            # What was written is still in stdout's buffer unless stdout is unbuffered
            # (PYTHONUNBUFFERED): a reader that went away (`stubcache ls | head -1`, `--help |
            # head -1`) is found here, not by the exit-time flush, which would print "Exception
            # ignored ... BrokenPipeError" and exit 120.
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        return broken_pipe()


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv[:-1]):
        if a in _SIGNED_VALUE_OPTIONS and argv[i + 1][:1] == "-" and argv[i + 1][1:2].isdigit():
            argv[i:i + 2] = [f"{a}={argv[i + 1]}"]
            break
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    log.log_to_stderr("ERROR" if args.quiet else "DEBUG" if args.verbose > 1 else "WARNING")
    if args.command != "doctor":  # doctor reports every malformed setting itself
        bad = _settings_problem(args)
        if bad is not None:
            return bad
    module, func = args.handler.split(":")
    # __import__ rather than importlib.import_module: the same import, but one that
    # `python -X importtime` reports, so the cost of each command group stays visible
    return run_command(lambda: getattr(__import__(f"{__package__}.{module}", fromlist=[func]), func)(args))
