"""The memo files under a root's ``state/`` (the fingerprint's, the toolchain probes', the
tracked inputs' re-hashed signatures): read through a regular file only and size-capped, written
atomically, never through a planted link."""

from __future__ import annotations

import os

from ..edge import cjson

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any


def write_json(path: str, data: dict[str, Any]) -> None:
    """Best-effort atomic write of a memo (readers see the old file or the new one)."""
    from ..edge import fsroot
    from ..storage import locking

    try:
        parent, name = os.path.split(path)
        with fsroot.Dir(parent) as dfd:  # never through a planted link (O_EXCL temp, dir fd)
            locking.write_file(dfd, name, cjson.dumps(data).encode(), mode=0o644)
    except (OSError, ValueError):
        pass


def load_json(path: str) -> Any:
    """A memo's JSON: a regular file only, size-capped (a FIFO planted in state/ cannot hang a start)."""
    from ..edge import fsroot

    try:
        return cjson.loads(fsroot.read_at(None, path, fsroot.SMALL_CAP * 16))
    except RecursionError:
        raise ValueError("nests too deeply") from None
