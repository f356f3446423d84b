"""Files a build read besides its spec (headers, linker inputs), tracked by content.

A build records every file the compiler and the linker read, from their own dependency output
(``-Wp,-MD`` lists "system" headers too, which ``-MMD`` leaves out; ``-Wl,--dependency-file``
lists objects, archives, linker scripts and shared libraries). Files under a directory whose
contents the fingerprint already pins are not tracked: torch's include and library directories
(torch version), Python's include directory (Python version) and the compiler's own directories
and C++ standard library headers (compiler identity). Everything else is hashed into the entry
key, ``/usr/include`` included.

On lookup (:func:`still_valid`) each tracked file is checked by a ``stat``: its hash is trusted
while its stat signature (device, inode, size, mtime, ctime) is the one recorded, and re-hashed
otherwise. For every tracked header, the directories searched *before* the one it was found in
are checked too: a file with its name appearing there would shadow it. Those checks are grouped
by directory: one ``stat`` of a directory whose mtime did not change proves that no name
appeared in it; one that is no longer a directory does not hold. The whole-fingerprint memo
checks the plain directories on ``sys.path`` the same way (:func:`stubcache.key.toolchain.import_path_checks`).

Nothing here imports more than ``os``. The build-time half (recording what a build read, the
compiler's search path) is :mod:`stubcache.key.tracking`, which only builds import.
"""

from __future__ import annotations

import os
import time

from ..hit import WAS, WAS_DIR, appeared, name_appeared
from ..storage.store import file_sha256

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

    # What __getattr__ below hands out from stubcache.tracking, for type checkers.
    from .tracking import SearchPath as SearchPath, Tracked as Tracked, file_candidates as file_candidates
    from .tracking import files_named_by_flags as files_named_by_flags, finish_search_path as finish_search_path
    from .tracking import has_include_names as has_include_names, library_candidates as library_candidates
    from .tracking import parse_depfile as parse_depfile, pinned_prefixes as pinned_prefixes
    from .tracking import start_search_path as start_search_path, track as track

# A file whose ctime is this close to (or after) the start of the build may have been written
# while the compiler read it: such a build is never published. The kernel stamps files from a
# coarse clock that lags time.time() by up to a jiffy.
CLOCK_SLACK_NS = 20_000_000



def slack_ns(stamp_ns: int) -> int:
    """How close to now a timestamp must be to count as "maybe still being written": the clock
    slack, or twice the file system's timestamp granularity if that is coarser. ext3, ext4 with
    128-byte inodes and FAT stamp whole seconds: two writes within one second leave the same
    mtime and ctime. The granularity is read off the stamp (the largest power of ten dividing
    it); on a nanosecond file system that only rarely overestimates it, which costs nothing but
    caution."""
    gran = 1
    while gran < 1_000_000_000 and stamp_ns % (gran * 10) == 0:
        gran *= 10
    return max(CLOCK_SLACK_NS, 2 * gran)


DEPFILE = "stubcache.deps"  # relative to the build directory, so no staging path leaks
LINK_DEPFILE = "stubcache.link.deps"
AS_DEPFILE = "stubcache.as.deps"  # GNU as: files the assembler read (.incbin, .include)

# path -> (signature, sha256) for files this process has hashed: a repeated check is a stat.
known_hashes: dict[str, tuple[list[Any], str]] = {}


def signature(st: os.stat_result) -> list[Any]:
    """What must stay equal for a recorded hash to be trusted without reading the file."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def dir_sig(path: str) -> list[Any] | None:
    # A directory's signature: device, inode, modification and change time (an entry added by
    # a tar extraction that restores the directory's mtime still moves its ctime).
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def recordable(sig: list[Any] | None) -> list[Any] | None:
    """A signature stamped within the clock's slack of now could be reused by a write that
    follows at once; record none (the lookup then checks the slow way). Judged by its last
    field, the change time (which moves with every change of the modification time)."""
    if sig is None or sig[-1] >= time.time_ns() - slack_ns(sig[-1]):
        return None
    return sig


# --- lookup (hit path) ------------------------------------------------------------------------


class MalformedInputs(ValueError):
    """A manifest's ``headers``/``inputs`` record is not what stubcache writes."""


def still_valid(files: dict[str, Any], inputs: dict[str, Any] | None, memo_path: str | None = None) -> bool:
    """True if every tracked file has its recorded content and no shadowing file appeared.

    ``files`` is ``{path: sha256}`` (the manifest's ``headers``); ``inputs`` the manifest's
    ``inputs`` record (signatures and shadow candidates), or None for an older entry. A
    malformed record raises :class:`MalformedInputs` (the caller treats the entry as corrupt). ``memo_path``
    (a file in the local root's ``state/``) remembers signatures of files re-hashed and found
    unchanged, for this entry, so that other processes (an entry from a seed store or built on
    another host, a file touched but not changed) do not hash them again.
    """
    try:
        return _still_valid(files, inputs, memo_path)
    except (TypeError, ValueError, AttributeError) as exc:
        raise MalformedInputs(f"malformed tracked-input record ({type(exc).__name__}: {exc})") from None


def read_sig_memo(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    from ..edge import cjson as json
    from ..edge import fsroot

    try:  # in the root's state/: a regular file only, size-capped (a planted FIFO must not hang)
        data = json.loads(fsroot.read_at(None, path, fsroot.SMALL_CAP * 16))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def _still_valid(files: dict[str, Any], inputs: dict[str, Any] | None, memo_path: str | None) -> bool:
    sigs = (inputs or {}).get("sigs") or {}
    memo: dict[str, Any] | None = None
    learned: dict[str, Any] = {}
    for path, digest in files.items():
        try:
            st = os.stat(path)
        except OSError:
            return False
        sig = signature(st)
        if sigs.get(path) == sig:
            continue
        seen = known_hashes.get(path)
        if seen is not None and seen[0] == sig:
            if seen[1] != digest:
                return False
            continue
        if memo is None:
            memo = read_sig_memo(memo_path)
        if memo.get(path) == sig:
            continue
        try:
            actual = file_sha256(path)
        except OSError:
            return False
        stable = _stable(path, sig)
        if stable:
            known_hashes[path] = (sig, actual)
        if actual != digest:
            return False
        if stable:
            learned[path] = sig
    for directory, (dsig, candidates) in ((inputs or {}).get("shadows") or {}).items():
        now = dir_sig(directory)
        if now == dsig:
            continue
        if now is not None and not os.path.isdir(directory):
            return False  # no longer a directory: a file on sys.path may be a zip archive
        if appeared(directory, candidates):
            return False
    if learned and memo_path:
        from .memofile import write_json

        write_json(memo_path, {**(memo or {}), **learned})
    return True


def changed_inputs(files: dict[str, Any], inputs: dict[str, Any] | None) -> list[str]:
    """Why an entry's tracked files no longer match, one line each (for ``stubcache explain``);
    empty if they all do. Reads and hashes; remembers nothing."""
    out = []
    try:
        for path, digest in files.items():
            try:
                actual = file_sha256(path)
            except OSError as exc:
                out.append(f"{path}: {exc.strerror or exc}")
                continue
            if actual != digest:
                out.append(f"{path}: content changed")
        for directory, (_, names) in ((inputs or {}).get("shadows") or {}).items():
            for rel in names:
                name, marked, was = rel.partition(WAS)
                cand = os.path.join(directory, name)
                if not name_appeared(directory, rel):
                    continue
                if not marked:
                    out.append(f"{cand}: new file, would be found before the tracked one")
                else:
                    then = "a directory" if was == WAS_DIR else f"a link to {was[1:]}"
                    out.append(f"{cand}: was {then} the compiler passed over, is not now")
    except (TypeError, ValueError, AttributeError) as exc:
        out.append(f"malformed tracked-input record ({exc})")
    return out


def _stable(path: str, sig: list[Any]) -> bool:
    """A hash may be memoised only if the file is not being written right now."""
    try:
        return signature(os.stat(path)) == sig and sig[4] < time.time_ns() - slack_ns(sig[4])
    except OSError:
        return False


def absent_paths(record: dict[str, Any] | None) -> list[str]:
    """The shadow candidates of a :func:`track` record, as absolute paths (for the entry key)."""
    shadows = (record or {}).get("shadows") or {}
    return [os.path.join(d, rel) for d, (_, names) in shadows.items() for rel in names]
