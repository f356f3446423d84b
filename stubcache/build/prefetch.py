"""A fresh host's link inputs, hashed while the compiler runs.

Tracking a build hashes the large files its link read (libc, libm, libstdc++, the loader: ~6 MiB,
8–17 ms on a 2-core machine) unless this user's hash memo
(:func:`stubcache.key.tracking.hash_memo`) already has them by signature. On a host where the
memo is empty (this user's first build there: a new machine, a new container) that hashing came
after the compile, on the build's critical path, while the compiler had left a core idle. So
there, while the compiler runs, :class:`LinkPrefetch` links an empty object with the same driver
and link flags, which names the files a link reads (``ld --trace``), and a helper thread hashes
those the memo would keep and remembers them; tracking then finds them by signature.

It is only a head start: tracking checks each row by its signature, as it does every memo row,
and hashes a file the head start missed, or that changed since, itself. A head start still
linking when the compile ends is stopped (its whole session: the driver's ``as`` and ``ld`` too).
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading
import time

from ..edge import kpath, log
from ..key import probememo, tracking
from ..key.fingerprint import torch_dir
from ..key.inputs import signature
from ..storage.store import file_sha256
from . import buildinputs

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

    from ..key import StubSpec

# The empty link's output in the build directory: not a spec's library name (a '-' is in no
# identifier), and removed with the staging directory.
OUTPUT = "prefetch-link.so"
HASH_MAX = 64 << 20  # a larger file is left to tracking (libc, libstdc++ and the loader are ~1–2 MiB)
FINISH_WAIT = 1.0  # seconds the helper thread is waited for once the link has ended (or been killed)


class LinkPrefetch:
    """An empty link started beside the compile (:meth:`start`), and the thread that hashes what
    it read; :meth:`finish` after the compile, :meth:`stop` if the build fails."""

    __slots__ = ("proc", "thread", "learned", "started_ns", "stopped")

    def __init__(self, proc: subprocess.Popen[bytes], memo: dict[str, Any], skip: tuple[str, ...] = ()) -> None:
        self.proc = proc
        self.learned: dict[str, list[Any]] = {}  # filled row by row: finish takes what is done
        self.stopped = threading.Event()
        self.started_ns = time.time_ns()
        self.thread = threading.Thread(target=self._run, args=(memo, skip), name="stubcache-link-prefetch",
                                       daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, spec: StubSpec, build_dir: str, memo: dict[str, Any]) -> LinkPrefetch | None:
        """The head start for ``spec``'s build in ``build_dir`` if this user's hash ``memo`` is
        empty (a fresh host), else ``None`` (and ``None`` if the driver cannot be started)."""
        # (Where the memo cannot be kept, every build would start one and none would last.)
        if memo or not probememo.usable():
            return None
        # An empty assembler input (no compile), then the link exactly as the build's command
        # ends it; stdout carries the trace. In its own session, as the early compile is.
        # torch's libraries (extra_ldflags may link them) are pinned by torch's version, never
        # hashed by tracking: not worth hashing here (libtorch_cpu is ~430 MB).
        tdir = torch_dir()
        skip = (os.path.join(os.path.realpath(tdir), ""), os.path.join(tdir, "")) if tdir else ()
        cmd = [*buildinputs.compiler_command(), "-x", "assembler", os.devnull, "-x", "none", "-shared", "-fPIC",
               "-Wl,--as-needed", *spec.extra_ldflags, "-o", OUTPUT, "-Wl,--trace"]
        try:
            proc = subprocess.Popen(cmd, cwd=build_dir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, env=dict(os.environ, TMPDIR=build_dir),
                                    start_new_session=True)
        except OSError:
            return None
        try:
            return cls(proc, memo, skip)
        except BaseException as exc:  # no thread (a process limit): nothing else would end it
            _kill(proc)
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]  # PIPE
            if isinstance(exc, Exception):
                log.debug("stubcache: no head start for the link inputs: %r", exc)
                return None  # only a head start: never worth failing a build for
            raise

    def _run(self, memo: dict[str, Any], skip: tuple[str, ...]) -> None:
        # The link's trace (read to its end: the driver and what it ran have exited or been
        # killed), then each file the memo would keep, hashed as tracking hashes it. Best-effort:
        # nothing here may fail the build or print.
        try:
            with self.proc.stdout:  # type: ignore[union-attr]  # PIPE
                out = self.proc.stdout.read().decode("utf-8", "surrogateescape")  # type: ignore[union-attr]
            learned = self.learned
            t0 = time.perf_counter()
            for path in dict.fromkeys(kpath.tidy(p) for p in _link_inputs(out)):
                if self.stopped.is_set():
                    return
                if skip and path.startswith(skip):
                    continue
                row = _row(path, memo, self.started_ns)
                if row is not None:
                    learned[path] = row
            if learned and not self.stopped.is_set():
                tracking.remember_hashes(memo, dict(learned))
                log.debug("stubcache: hashed %d link inputs while compiling (%.1f ms), for a host with no hash memo "
                          "yet", len(learned), (time.perf_counter() - t0) * 1e3)
        except Exception as exc:  # noqa: BLE001 - a head start is never worth a traceback
            log.debug("stubcache: the head start for the link inputs stopped: %r", exc)

    def finish(self, memo: dict[str, Any]) -> None:
        """After the compile: what the head start hashed, into ``memo`` (tracking's), if its link
        has ended (the hashing left is waited for: tracking would do it otherwise); a link still
        running is stopped instead."""
        if not _ended(self.proc):
            self.stop()
            return
        _kill(self.proc)  # (the driver ended, unreaped: a program it left in its session goes too)
        self.proc.wait()
        self.thread.join(FINISH_WAIT)
        if self.thread.is_alive():  # a program that left the session holds the pipe, or a slow hash
            self.stopped.set()
        for path, (sig, digest) in list(self.learned.items()):
            memo[path] = (sig, digest)

    def stop(self) -> None:
        """End the head start: its link's whole session killed and reaped, its thread ended."""
        self.stopped.set()
        _kill(self.proc)
        self.proc.wait()
        self.thread.join(FINISH_WAIT)  # (it closes the pipe; one held by a program that left the session: let it be)


def _ended(proc: subprocess.Popen[bytes]) -> bool:
    # Whether the driver has exited, without reaping it (its pid stays the session's own).
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.returncode is None:  # (not reaped: its pid, the session's id, is still its own)
        import signal

        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass


def _link_inputs(trace: str) -> list[str]:
    # The files ``ld --trace`` names, an archive only where the link took a member from it (an
    # ``(archive)member`` line): a build's dependency file names no archive it only looked into
    # (libgcc.a, 3 MiB, for a stub that needs none of it).
    opened, used = [], set()
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith("(") and ")" in line:
            used.add(line[1:line.index(")")])
        elif line.startswith("/"):
            opened.append(line)
    return [p for p in opened if not p.endswith(".a") or p in used]


def _row(path: str, memo: dict[str, Any], started_ns: int) -> list[Any] | None:
    # [signature, sha256] of a regular file large enough for the memo and not in it by its
    # current signature, read as tracking reads it; None for anything else (a file that changed
    # while it was hashed, or lately: tracking decides about those).
    try:
        st0 = os.stat(path)
        if not stat.S_ISREG(st0.st_mode) or not tracking.HASH_MEMO_MIN_SIZE <= st0.st_size <= HASH_MAX:
            return None
        sig = signature(st0)
        known = memo.get(path)
        if known is not None and known[0] == sig:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            digest = file_sha256(fd)
            st1 = os.fstat(fd)
        finally:
            os.close(fd)
    except (OSError, ValueError):  # (ValueError: a name with a NUL in it)
        return None
    if tracking.unsettled(st0, st1, started_ns):
        return None
    return [sig, digest]
