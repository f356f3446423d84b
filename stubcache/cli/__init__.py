"""The ``stubcache`` command line (also ``python -m stubcache``).

Commands: ``ls``, ``stats``, ``prune``, ``verify``, ``explain``, ``clear``, ``warm``, ``doctor``,
``init``, ``dir``, ``config``, ``run``. See ``docs/cli.md``. ``ls``, ``stats`` and
``prune --dry-run`` never import torch.

Layout (docs/cli.md, "adding a command"): :mod:`.parser` declares every command and its
options; :mod:`.dispatch` has ``main()``, which parses and dispatches; :mod:`.exits` holds the
exit codes and the one place that maps exceptions to them; :mod:`.output` is the one renderer
(``--format``); the commands live by group in :mod:`.inspect` (ls, stats, explain, dir),
:mod:`.maintain` (prune, clear, verify, doctor, init, config), :mod:`.build` (warm, run) and
:mod:`.remote` (``ls``/``prune --remote``). Only the module of the command that runs is imported.

Exit codes:
    0  success
    1  the command ran and found problems (verify: bad entries; doctor: errors; warm: a build
       failed; prune/clear: a removal failed)
    2  usage error (bad option, bad filter, unreadable spec file, unknown key)
    3  not confirmed (answered no, or no terminal and no ``--yes``)
    127 run: the command could not be started
    130 interrupted
"""

from __future__ import annotations

from ..admin.entryfilter import parse_filter  # the --filter language, beside the scan it filters
from .exits import (EXIT_ABORTED, EXIT_INTERRUPTED, EXIT_NOT_RUN, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE,
                    UsageError)
from .dispatch import main
from .parser import build_parser

__all__ = ["main", "build_parser", "parse_filter", "UsageError", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE",
           "EXIT_ABORTED", "EXIT_INTERRUPTED", "EXIT_NOT_RUN"]

