"""The one renderer of command output.

A command describes what it prints as a :class:`View` (the JSON document, the text lines of the
table format, and, where offered, CSV rows or another verbatim format) and hands it to
:func:`show`; only this module looks at ``--format``. Messages that the JSON document already
carries go through :func:`note` (stdout) or :func:`problem` (stderr), printed in text formats
only. Cells are escaped: names and values come from files that someone else may have written.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from .exits import error as err

if TYPE_CHECKING:
    import argparse

__all__ = ["View", "show", "is_text", "note", "problem", "out", "err", "table", "iso", "short_compiler"]


class View:
    """What one command prints, per format.

    ``json``: the document for ``--format json``, or a function returning it. ``text``: a
    function returning (or yielding) the lines of the table format, called only when that format
    is chosen; a line may hold a whole table, and a yielded line is printed before the next is
    made, so a message it writes to stderr comes after the lines above it.
    ``csv``: ``(field names, row dicts)``; row values that are strings are escaped unless
    ``csv_escape`` is false. ``raw``: other formats (``prometheus``) -> a function returning the
    text to write as is.
    """

    __slots__ = ("json", "text", "csv", "csv_escape", "raw")

    def __init__(self, json: Any = None, text: Callable[[], Iterable[str]] | None = None,
                 csv: tuple[Sequence[str], Iterable[dict[str, Any]]] | None = None, csv_escape: bool = True,
                 raw: dict[str, Callable[[], str]] | None = None) -> None:
        self.json = json
        self.text = text
        self.csv = csv
        self.csv_escape = csv_escape
        self.raw = raw or {}


def _format(args: argparse.Namespace) -> str:
    return getattr(args, "format", "table")


def is_text(args: argparse.Namespace) -> bool:
    """Whether the chosen format is for a person (not json, csv or prometheus)."""
    return _format(args) == "table"


def show(args: argparse.Namespace, view: View) -> None:
    """Print ``view`` in the format ``args.format`` asks for."""
    fmt = _format(args)
    if fmt == "json":
        import json

        doc = view.json() if callable(view.json) else view.json
        out(json.dumps(doc, indent=2, sort_keys=False, default=str))
    elif fmt == "csv" and view.csv is not None:
        _write_csv(*view.csv, escape=view.csv_escape)
    elif fmt in view.raw:
        sys.stdout.write(view.raw[fmt]())
    elif view.text is not None:
        for line in view.text():
            out(line)


def _write_csv(fields: Sequence[str], rows: Iterable[dict[str, Any]], escape: bool) -> None:
    import csv
    import io

    from ..edge.fsroot import printable

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: printable(v, 4000) if escape and isinstance(v, str) else v for k, v in row.items()})
    sys.stdout.write(buf.getvalue())


def note(args: argparse.Namespace, text: str) -> None:
    """A summary line for a person: not in JSON (the document says it) and not with ``-q``."""
    if is_text(args) and not getattr(args, "quiet", False):
        out(text)


def problem(args: argparse.Namespace, text: str) -> None:
    """A message on stderr that the JSON document carries as data: text formats only."""
    if is_text(args):
        err(text)


def out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain text table; columns in ``right`` are right-aligned. Cells are escaped (no terminal
    control sequences)."""
    from ..edge.fsroot import printable

    cells = [[str(c) for c in headers]] + [[printable(c, 4000) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [(c.rjust(w) if i in right else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def iso(t: float | None) -> str | None:
    """Local time as ``2025-06-15T14:06:40``; ``None`` for no time."""
    if not t:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def short_compiler(line: str | None) -> str:
    """``x86_64-linux-gnu-g++-12 (Debian 12.2.0-14) 12.2.0`` -> ``gcc 12.2.0``."""
    if not line:
        return "-"
    import re

    m = re.search(r"(\d+\.\d+(?:\.\d+)?)\s*$", line) or re.search(r"version (\d+\.\d+(?:\.\d+)?)", line)
    version = m.group(1) if m else ""
    low = line.lower()
    family = ("clang" if "clang" in low else "gcc" if ("g++" in low or "gcc" in low) else
              "nvcc" if "nvcc" in low else line.split()[0][-16:])
    return f"{family} {version}".strip()
