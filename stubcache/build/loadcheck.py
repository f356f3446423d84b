"""A library that cannot load is a failed build.

A shared library may reference a symbol nothing defines: it links (``-shared`` allows undefined
symbols), and every ``dlopen`` then fails with ``undefined symbol: g``. :func:`check_loads`
asks the dynamic loader itself, in a short-lived child, to bind every symbol of the library
now: glibc's ``ld.so`` run on the library with ``LD_TRACE_LOADED_OBJECTS`` and ``LD_BIND_NOW``
maps it and its dependencies and reports each unresolved symbol, without running any of its
code. One small exec (no Python start-up), run after the build and before the publish.

What the loading process itself provides is not an error: symbols of the Python interpreter
(an extension module leaves them undefined) and of libraries already loaded here are looked up
in this process. A dependency the loader cannot find (``libnccl.so.2`` that torch loads first,
a directory set in ``LD_LIBRARY_PATH`` only later) makes the check inconclusive, and the build
stands: whether it loads depends on the loading process, as for any program.
"""

from __future__ import annotations

import os

from ..edge.errors import BuildError
from ..hit import program_header

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    import subprocess
    from typing import Sequence

_loader: list[str | None] = []  # [path or None], found once per process
_PT_INTERP = 3


def _interpreter(exe: str) -> str | None:
    """The program interpreter (``PT_INTERP``) named by the ELF64 little-endian executable
    ``exe``, or None: the loader the kernel started this process with (reading it costs a few
    small reads; ``/proc/self/maps`` of an engine process holds thousands of lines)."""
    try:
        fd = os.open(exe, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        found = program_header(fd, _PT_INTERP)
        if found is None or not 1 < found[2] < 4096:
            return None
        path = os.fsdecode(os.pread(fd, found[2], found[0]).split(b"\0", 1)[0])
        return path if path.startswith("/") and os.path.isfile(path) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _glibc_loader(path: str | None) -> bool:
    # glibc's loader by its name and by the name of the file it links to (musl's ld-musl-*.so.1
    # is installed under glibc's name by compatibility packages).
    if path is None:
        return False
    names = (os.path.basename(path), os.path.basename(os.path.realpath(path)))
    return (all(n.startswith(("ld-linux", "ld64.so", "ld-2.")) for n in names)
            and not any("musl" in n for n in names))


def dynamic_loader() -> str | None:
    """This process's glibc dynamic loader (``ld-linux-x86-64.so.2`` …), or None (musl, other OS):
    the interpreter of ``/proc/self/exe``, else (a program started through the loader itself has
    none of its own) the loader mapped here."""
    if not _loader:
        found = _interpreter("/proc/self/exe")
        if found is None:
            found = _mapped_loader()
        _loader.append(found if _glibc_loader(found) else None)
    return _loader[0]


def _mapped_loader() -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as fh:
            for line in fh:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/") and _glibc_loader(path) and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


def unresolved_symbols(library: str, extra_dirs: Sequence[str] = ()) -> list[str] | None:
    """The symbols of ``library`` that neither its dependencies nor this process define; None
    when the loader cannot tell (no glibc loader here, a dependency it cannot find)."""
    return _finish(_start(library, extra_dirs), library)


def _start(library: str, extra_dirs: Sequence[str]) -> subprocess.Popen[bytes] | None:
    """The loader started on ``library`` (None: no glibc loader, or it cannot be run)."""
    import subprocess

    loader = dynamic_loader()
    if loader is None:
        return None
    env = dict(os.environ, LD_TRACE_LOADED_OBJECTS="1", LD_WARN="yes", LD_BIND_NOW="1")
    env.pop("LD_PRELOAD", None)
    dirs = [d for d in extra_dirs if d] + [d for d in (os.environ.get("LD_LIBRARY_PATH") or "").split(":") if d]
    if dirs:
        env["LD_LIBRARY_PATH"] = ":".join(dirs)
    try:
        return subprocess.Popen([loader, os.path.abspath(library)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.SubprocessError):
        return None


def _finish(proc: subprocess.Popen[bytes] | None, library: str) -> list[str] | None:
    """What the loader started by :func:`_start` reported (see :func:`unresolved_symbols`)."""
    import subprocess

    if proc is None:
        return None
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        stop(proc)
        return None
    except BaseException:  # interrupted while it runs: not left behind
        stop(proc)
        raise
    text = out.decode("utf-8", "replace")
    if "=> not found" in text or proc.returncode != 0:
        return None
    own = f"({os.path.abspath(library)})"
    missing = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("undefined symbol: ") and line.endswith(own):
            missing.append(line[len("undefined symbol: "):-len(own)].strip())
    if not missing:
        return []
    import ctypes

    here = ctypes.CDLL(None)  # the interpreter and what is loaded globally: what a loader here has
    out_syms = []
    for sym in missing:
        try:
            here[sym]
        except AttributeError:
            out_syms.append(sym)
    return out_syms


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """Kill and reap a child this module (or a build) started, closing its pipe."""
    if proc is not None and proc.returncode is None:
        proc.kill()
        proc.communicate()


class PendingCheck:
    """A load check running in its child while the build does other work (:func:`start_check`)."""

    __slots__ = ("library", "proc")

    def __init__(self, library: str, proc: subprocess.Popen[bytes] | None) -> None:
        self.library = library
        self.proc = proc


def start_check(library: str) -> PendingCheck:
    """Start :func:`check_loads`' loader on ``library``; :func:`finish_check` reads its answer
    (and :func:`stop` of its ``proc`` abandons it)."""
    from ..key.fingerprint import torch_dir

    tdir = torch_dir()
    return PendingCheck(library, _start(library, [os.path.join(tdir, "lib")] if tdir else []))


def finish_check(pending: PendingCheck, name: str) -> None:
    """Raise :class:`BuildError` (with the loader's words) if the library cannot load because a
    symbol it references is defined nowhere; nothing is published for such a build."""
    missing = _finish(pending.proc, pending.library)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise BuildError(f"Error building extension '{name}'",
                         output=f"the library links but cannot load: undefined symbol: {shown} "
                                f"({os.path.basename(pending.library)}); define it in the sources, or link the "
                                "library that does (extra_ldflags)", name=name)


def check_loads(library: str, name: str) -> None:
    """:func:`finish_check` of :func:`start_check`: the whole check, in one call."""
    finish_check(start_check(library), name)
