"""The ``stubcache`` command line (placeholder until the CLI issue lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .store import default_root

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["dir"]:
        print(default_root())
        return 0
    print("usage: stubcache dir", file=sys.stderr)
    return 2
