"""The ``stubcache`` argument parser: every command, its options and the ``--help`` text.

Each command names its handler as ``"module:function"`` in this package; :mod:`.dispatch` imports
only the module of the command that runs, so building the parser imports no command code.
"""

from __future__ import annotations

import argparse

from ..admin.entryfilter import SORTS
from ..edge.settings import help_text


def _globals(parser: argparse.ArgumentParser, sub: bool) -> None:
    d = argparse.SUPPRESS if sub else None
    parser.add_argument("--cache-dir", metavar="DIR", default=d,
                        help="cache root (default: $STUBCACHE_DIR, else the platform cache directory)")
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS if sub else 0,
                        help="more detail (full keys, extra columns, debug logging); repeatable")
    parser.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS if sub else False,
                        help="only print results and errors")


def _fmt(p: argparse.ArgumentParser, choices: tuple[str, ...] = ("table", "json")) -> None:
    p.add_argument("--format", choices=choices, default="table", help="output format (default: table)")


def _remote_opts(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--remote", action="store_true", help=help_)
    _remote_store_opts(p, "remote store (default: $STUBCACHE_REMOTE), e.g. redis://host:6379/0")


def _remote_store_opts(p: argparse.ArgumentParser, url_help: str) -> None:
    p.add_argument("--remote-url", metavar="URL", help=url_help)
    p.add_argument("--remote-timeout", metavar="SECONDS",
                   help="seconds per network call (default: $STUBCACHE_REMOTE_TIMEOUT or 2)")


_EPILOG = "environment:\n" + help_text() + """

exit codes:
  0    ok
  1    the command ran and found problems (verify: bad entries; doctor: errors; warm: a build
       failed or could not be stored; prune/clear: a removal failed; rm: a named entry was
       not removed, e.g. in use)
  2    usage error (bad option, bad size, duration or filter, a malformed STUBCACHE_* setting,
       unreadable spec file, unknown key)
  3    not confirmed (answered no, or no terminal and no --yes)
  127  run: the command could not be started
  130  interrupted
  141  the output's reader went away (`stubcache ls | head -1`): quiet, as other tools

More in docs/cli.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stubcache",
        description="Inspect and manage the stubcache cache of built native stubs.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _globals(parser, sub=False)
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"stubcache {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, handler: str, help_: str) -> argparse.ArgumentParser:
        p = subs.add_parser(name, help=help_, description=help_)
        _globals(p, sub=True)
        p.set_defaults(handler=handler)
        return p

    p = add("ls", "inspect:cmd_ls", "list entries: key, name, size, torch, compiler, created, last used, in use")
    p.add_argument("--filter", action="append", metavar="EXPR",
                   help="keep entries matching FIELD OP VALUE, e.g. 'size>1M', 'accessed>30d', "
                        "'created<2h', 'name=alloc*', 'in_use=yes' (repeatable; all must match)")
    p.add_argument("--name", metavar="PATTERN", help="only entries whose name matches this glob")
    p.add_argument("--sort", choices=sorted(SORTS), default="used",
                   help="sort by this field (default: used, least recently used first)")
    p.add_argument("--reverse", action="store_true", help="reverse the order")
    p.add_argument("--no-probe", action="store_true", help="do not check whether live processes hold entries")
    _remote_opts(p, "list the blobs in the remote store instead of the local entries")
    _fmt(p, ("table", "json", "csv"))

    p = add("stats", "inspect:cmd_stats", "counters folded from every process's event file")
    _fmt(p, ("table", "json", "prometheus"))
    p.add_argument("--reset", action="store_true",
                   help="zero the counters (entries are untouched); safe while processes run")

    def removal_opts(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dry-run", "-n", action="store_true", help="print the plan; change nothing")
        p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
        _fmt(p)

    p = add("prune", "maintain:cmd_prune", "remove entries by size/age/toolchain, and leftovers of dead processes")
    p.add_argument("--max-size", metavar="SIZE",
                   help="evict least recently used entries until entries total at most SIZE (e.g. 2G)")
    p.add_argument("--older-than", metavar="AGE", help="evict entries not used for longer than AGE (e.g. 14d)")
    p.add_argument("--toolchain-mismatch", action="store_true",
                   help="evict entries built for another torch, compiler, Python or platform")
    p.add_argument("--quarantine-age", metavar="AGE", default="7d",
                   help="remove quarantined entries older than AGE (default 7d)")
    p.add_argument("--no-leftovers", action="store_true",
                   help="leave staging dirs, leases, trash and quarantine alone")
    _remote_opts(p, "prune the remote store instead of the local root (needs --max-age)")
    p.add_argument("--max-age", metavar="AGE",
                   help="with --remote: remove blobs built longer than AGE ago (e.g. 30d)")
    removal_opts(p)

    p = add("rm", "maintain:cmd_rm", "remove the entries named by key or name (never one in use)")
    p.add_argument("keys", nargs="*", metavar="KEY",
                   help="a spec key or an entry key, or a unique prefix of either (a spec key removes "
                        "every entry built from it)")
    p.add_argument("--name", metavar="GLOB", help="also remove the entries whose name matches this glob")
    removal_opts(p)

    p = add("verify", "maintain:cmd_verify", "recheck every entry's checksum and manifest; quarantine failures")
    p.add_argument("--dry-run", "-n", action="store_true", help="report bad entries without quarantining them")
    p.add_argument("--rebuild", action="store_true",
                   help="rebuild entries privately and compare bytes: a difference means the key does not "
                        "cover an input (exit 1)")
    p.add_argument("keys", nargs="*", metavar="KEY", help="with --rebuild: entries to rebuild (default: all)")
    p.add_argument("--sample", type=int, metavar="N", help="with --rebuild: rebuild N random entries")
    _fmt(p)

    p = add("explain", "inspect:cmd_explain",
            "print a key's pre-image field by field; with two references, the fields that differ")
    p.add_argument("refs", nargs="+", metavar="SPEC|KEY",
                   help="a spec JSON file, a MODULE:ATTR reference, or an entry key (or unique prefix)")
    _fmt(p)

    p = add("clear", "maintain:cmd_clear", "remove every entry not in use, and all leftovers")
    p.add_argument("--stats", action="store_true", help="also delete the event files of finished processes")
    removal_opts(p)

    p = add("warm", "build:cmd_warm", "build the stubs described by spec files or MODULE:ATTR references")
    p.add_argument("refs", nargs="+", metavar="FILE|MODULE:ATTR",
                   help="JSON file written from StubSpec.to_json() (an object, or a list of StubSpec.to_dict() "
                        "objects), or an importable "
                        "StubSpec, list, or zero-argument callable returning them")
    _fmt(p)

    p = add("doctor", "maintain:cmd_doctor", "check the root's permissions, filesystem, free space and toolchain")
    p.add_argument("--fix", action="store_true",
                   help="first repair permissions of paths you own (drop group/other write; shared modes)")
    _remote_store_opts(p, "check this remote store (default: $STUBCACHE_REMOTE)")
    _fmt(p)

    p = add("init", "maintain:cmd_init", "create or convert a cache root: private (0700), or shared with a group")
    p.add_argument("dir", nargs="?", metavar="DIR", help="the root (default: --cache-dir / $STUBCACHE_DIR)")
    p.add_argument("--shared", action="store_true", help="share the root with the members of --group")
    p.add_argument("--group", metavar="GROUP", help="the trusted group (name or gid)")
    _fmt(p)

    p = add("dir", "inspect:cmd_dir", "print the cache root")
    _fmt(p)

    p = add("config", "maintain:cmd_config", "show the root's settings, or set one: config set max_size 10G")
    p.add_argument("action", nargs="?", choices=("show", "set", "unset"), default="show")
    p.add_argument("name", nargs="?", metavar="NAME", help="max_size or toolchain_max_age")
    p.add_argument("value", nargs="?", metavar="VALUE", help="e.g. 10G, or 30d")
    _fmt(p)

    p = add("run", "build:cmd_run", "run a command with torch's load_inline/load going through the cache, in "
                            "every Python process it starts (no code changes)")
    p.add_argument("--env", action="store_true",
                   help="print the environment variables `run` sets (for a service file) and exit")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    return parser
