"""What every command needs: the selected root, its Store, and a confirmation prompt."""

from __future__ import annotations

import argparse
import os
import sys

from .exits import NotConfirmed

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Iterable

    from ..admin.keyref import KeyMatch
    from ..admin.scan import EntryRecord
    from ..storage.store import Store


def root(args: argparse.Namespace) -> str:
    """``--cache-dir`` (absolute), else the default root."""
    if getattr(args, "cache_dir", None):
        cache_dir: str = args.cache_dir
        return os.path.abspath(os.path.expanduser(cache_dir))
    from ..storage.store import default_root

    return default_root()


def store(args: argparse.Namespace) -> Store:
    """The Store of the selected root, made with the root's layout policy (so files it creates
    get group modes in a shared root); a root whose config fails the trust checks is private."""
    from ..edge.errors import TrustError
    from ..storage.store import Store
    from ..storage.trust import layout_policy

    path = root(args)
    try:
        policy = layout_policy(path)
    except TrustError:
        policy = None
    return Store(path, policy)


def confirm(prompt: str, args: argparse.Namespace) -> None:
    """Return if ``--yes`` was given or the user says yes on a terminal; raise
    :class:`NotConfirmed` (exit 3) if there is no terminal or the answer is not yes."""
    if getattr(args, "yes", False):
        return
    if not sys.stdin.isatty():
        raise NotConfirmed("stdin is not a terminal; pass --yes to proceed without confirmation")
    sys.stderr.write(f"{prompt} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise NotConfirmed("aborted; nothing removed")


def match_key(ref: str, entries: Iterable[EntryRecord], store_root: str) -> KeyMatch:
    """What the KEY argument ``ref`` names among scanned ``entries``
    (:class:`stubcache.admin.keyref.KeyMatch`: a spec key or an entry key, in full or a unique prefix);
    a :class:`UsageError` (exit 2) if it is not a key, names nothing or is ambiguous."""
    from ..admin.keyref import KeyRefError, resolve_key
    from .exits import UsageError

    try:
        return resolve_key(ref, entries)
    except KeyRefError as exc:
        raise UsageError(f"{exc} in {store_root}" if str(exc).startswith("no entry") else str(exc)) from None
