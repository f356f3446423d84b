"""Probing the toolchain for the fingerprint: torch's version and C++ ABI, the compiler behind
``CXX`` (through any wrapper) with its assembler and linker, what ``-march=native`` means here,
the tools ``-fuse-ld=``/``-B`` select, the visible GPUs' architectures.

Each probe is slow (a subprocess, a scan of libc10) and deterministic, so its result is memoised
on disk under the cache's ``state/`` (:func:`memo`). Only a :class:`~stubcache.key.fingerprint.Fingerprint`
whose whole-fingerprint memo misses imports this module: a hit never does.
"""

from __future__ import annotations

import os
import stat
import sys

from hashlib import sha256
from ..hit import ANY_PTH, KNOWN_PTH, path_sig
from .inputs import dir_sig, recordable
from .memofile import load_json, write_json

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any, Callable, Sequence


_VERSION_LINE = r"^(__version__|cuda|hip|git_version|debug)\s*(?::[^=]*)?=\s*(.+?)\s*$"


def which(command: str) -> str | None:
    """``shutil.which`` for executables, without importing shutil."""
    if os.sep in command:
        return command if os.path.isfile(command) and os.access(command, os.X_OK) else None
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        cand = os.path.join(d or ".", command)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def torch_facts(tdir: str | None, memo: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    if tdir is None:
        return {"version": None}
    import re

    facts: dict[str, Any] = {}
    try:
        with open(os.path.join(tdir, "version.py"), encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    for field, raw in re.findall(_VERSION_LINE, text, re.M):
        raw = raw.strip()
        value: Any = raw
        if raw == "None":
            value = None
        elif raw in ("True", "False"):
            value = raw == "True"
        elif raw[:1] in "'\"" and raw[-1:] == raw[:1]:
            value = raw[1:-1]
        facts["version" if field == "__version__" else field] = value
    facts.setdefault("version", None)
    facts["cxx11_abi"] = _cxx11_abi(tdir, memo)
    return facts


def _cxx11_abi(tdir: str, memo: Callable[..., dict[str, Any]]) -> int | None:
    """torch's ``_GLIBCXX_USE_CXX11_ABI``, read from libc10's symbols and remembered on disk."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and hasattr(torch_mod, "_C"):
        return int(bool(getattr(torch_mod._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    lib = os.path.join(tdir, "lib", "libc10.so")
    try:
        st = os.stat(lib)
    except OSError:
        return None
    memo_key = f"abi:{lib}:{st.st_size}:{st.st_mtime_ns}"

    def compute() -> dict[str, Any]:
        with open(lib, "rb") as fh:
            data = fh.read()
        return {"abi": 1 if b"__cxx11" in data else 0}

    abi: int | None = memo(memo_key, compute).get("abi")
    return abi


def _read_memo(path: str, memo_key: str) -> Any:
    try:
        data = load_json(path)
        if data.get("memo_key") == memo_key:
            return data["value"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


MEMO_LOCK_WAIT = 90.0  # seconds; longer than the probe's own 60 s timeout


def _memo_wait() -> float:
    """The memo lock's bound: ``STUBCACHE_LOCK_TIMEOUT`` when smaller than ``MEMO_LOCK_WAIT``
    (a group member holding the lock costs at most that, then we compute it ourselves)."""
    from ..storage.locking import lock_timeout_from_env

    try:
        return min(MEMO_LOCK_WAIT, lock_timeout_from_env())
    except ValueError:
        return MEMO_LOCK_WAIT


def memo(state_dir: str | None, memo_key: str, compute: Callable[[], dict[str, Any]],
         valid: Callable[[dict[str, Any]], bool] | None = None, read_only: bool = False,
         hold: Callable[[int, Callable[[], None]], bool] | None = None) -> dict[str, Any]:
    """A tiny on-disk memo for expensive, deterministic toolchain facts (``read_only``: use one
    that is there, write none).

    On a miss, one process computes under a ``flock`` on ``<memo>.lock`` while the others wait
    and read its result: a herd starting on a cold host runs ``c++ --version`` once, not N times.
    ``hold``: offered the lock's descriptor and the write of the answer when this process
    computed it; if it returns True it has taken both (it writes, then closes the lock, when it
    lets go), and the processes waiting for the answer wait until then.
    """
    name = sha256(memo_key.encode()).hexdigest()[:32] + ".json"
    path = os.path.join(state_dir, name) if state_dir else None
    if path is None:
        return compute()
    value: dict[str, Any] | None = _read_memo(path, memo_key)
    if value is not None and (valid is None or valid(value)):
        return value
    if read_only:
        return _host_answer(memo_key, compute, valid, keep=False)
    from ..edge import fsroot
    from ..storage import locking

    try:
        with fsroot.Dir(state_dir) as sfd:  # type: ignore[arg-type]  # a state_dir: path is not None
            # A group-writable (shared) state directory gets a group-usable lock file.
            lock_fd = locking.open_lock_at(sfd, name + ".lock", shared=bool(os.fstat(sfd).st_mode & 0o020))
    except OSError:
        lock_fd = -1  # read-only root or another user's lock file: compute without sharing
    held = False
    try:
        if lock_fd >= 0 and locking.wait_flock(lock_fd, locking.EX, _memo_wait()):
            value = _read_memo(path, memo_key)
            if value is not None and (valid is None or valid(value)):
                return value
        elif lock_fd >= 0:
            from ..edge import log

            log.warning("stubcache: the toolchain memo lock %s.lock is held by %s past %.0fs; probing "
                         "without it", path, locking.describe_holders(lock_fd), _memo_wait())
        value = _host_answer(memo_key, compute, valid)
        record = {"memo_key": memo_key, "value": value}
        held = lock_fd >= 0 and hold is not None and hold(lock_fd, lambda: write_json(path, record))
        if not held:
            write_json(path, record)
        return value
    finally:
        if lock_fd >= 0 and not held:
            os.close(lock_fd)


def _host_answer(memo_key: str, compute: Callable[[], dict[str, Any]],
                 valid: Callable[[dict[str, Any]], bool] | None = None, keep: bool = True) -> dict[str, Any]:
    """The answer this user's probe memo keeps for ``memo_key`` (:mod:`stubcache.key.probememo`), if
    it is still valid; else ``compute()``, kept there for the next root (unless not ``keep``)."""
    from . import probememo

    value: dict[str, Any] | None = probememo.read(memo_key)
    try:
        if value is not None and (valid is None or valid(value)):
            return value
    except (TypeError, ValueError, AttributeError, KeyError):
        pass  # not an answer a probe gives: probe again
    value = compute()
    if keep:
        probememo.write(memo_key, value)
    return value


def compiler_identity(command: str, memo: Callable[..., dict[str, Any]],
                      early: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """See :meth:`Fingerprint.compiler_identity` (``memo``: its on-disk memo; ``early``: see
    :func:`_probe_answers`)."""
    import shlex

    try:
        words = shlex.split(command) or [command]
    except ValueError:
        words = [command]
    found = which(words[0])
    if found is None:
        ident: dict[str, Any] = {"command": command, "path": None, "version": None}
    else:
        path = os.path.realpath(found)
        st = os.stat(path)
        driver = wrapped_driver(words, found)
        dsig = path_sig(driver) if driver else None
        # A wrapper finds the real compiler on PATH, so PATH is part of what this memo means.
        # The program is named by its inode and change time too: the answer is kept per user
        # across roots (probememo), and a program replaced by one of the same size and mtime
        # (`cp -p`, `touch -r`, an `mv` over it) must be probed again.
        memo_key = (f"cc6:{command}:{found}:{path}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:"
                    f"{st.st_ctime_ns}:{os.environ.get('PATH', '')}:"
                    f"{driver and os.path.realpath(driver)}:{dsig}:{_tool_env()}")
        wrapper = is_wrapper(found)
        if wrapper:  # its settings choose the compiler it runs (CCACHE_COMPILER, ccache.conf, a prefix)
            memo_key += f":{wrapper_config()}"

        def compute() -> dict[str, Any]:
            import threading
            import time

            from ..edge import log

            t0 = time.perf_counter()
            # The program named by CXX itself (a script in front of the compiler may add flags),
            # hashed on a thread while the driver is probed.
            own: list[str | None] = []
            hashing = threading.Thread(target=lambda: own.append(_file_sha256(path)))
            hashing.start()
            try:
                value = _probe_compiler([found, *words[1:]], early)
            finally:
                hashing.join()
            value["sha256"] = own[0] if own else None
            tool = _tool(driver) if driver else None
            if tool:
                value["real"]["driver"] = tool
                value["validators"].append([tool["path"], path_sig(driver)])  # type: ignore[arg-type]  # a tool: a driver
            if wrapper:
                # A prefix command (CCACHE_PREFIX, prefix_command) runs in front of the compiler
                # and may add flags: identified by content, like a script named by CXX.
                prefixes: list[dict[str, Any]] = [{"path": p, "sha256": _file_sha256(p)} for p in wrapper_prefixes()]
                if prefixes:
                    value["real"]["wrapper_prefix"] = prefixes
                    value["validators"] += [[p["path"], path_sig(p["path"])] for p in prefixes]
            log.debug("stubcache: probed the compiler %s in %.1f ms", path, (time.perf_counter() - t0) * 1e3)
            return value

        value = memo(memo_key, compute, valid=_compiler_answer_holds)
        ident = {"command": command, "path": path, "sha256": value.get("sha256"), "version": value["version"],
                 "real": value.get("real")}
    return ident


# Variables that change which programs the driver runs (or with what options), so what a
# compiler probe found holds only for their values.
TOOL_ENV_VARS = ("COMPILER_PATH", "GCC_EXEC_PREFIX", "CCC_OVERRIDE_OPTIONS")


def _tool_env() -> list[Any]:
    return [os.environ.get(v) for v in TOOL_ENV_VARS]


WRAPPERS = ("ccache", "sccache", "buildcache")
WRAPPER_ENV_PREFIXES = ("CCACHE_", "SCCACHE_", "BUILDCACHE_")


def is_wrapper(found: str) -> bool:
    """Whether the program ``found`` on ``PATH`` is a known compiler cache (or a masquerade link to one)."""
    return os.path.basename(os.path.realpath(found)) in WRAPPERS


def wrapper_config_files() -> list[str]:
    """The files a compiler cache reads its settings from (ccache: ``CCACHE_CONFIGPATH``, else
    ``$CCACHE_DIR/ccache.conf``, ``~/.ccache/ccache.conf`` or the XDG one, and the system-wide
    file; sccache's and buildcache's config), whether or not they exist now."""
    env = os.environ
    home = os.path.expanduser("~")
    xdg = env.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    out = [env.get("CCACHE_CONFIGPATH"), env.get("CCACHE_DIR") and os.path.join(env["CCACHE_DIR"], "ccache.conf"),
           os.path.join(home, ".ccache", "ccache.conf"), os.path.join(xdg, "ccache", "ccache.conf"),
           "/etc/ccache.conf", "/usr/local/etc/ccache.conf",
           env.get("SCCACHE_CONF"), os.path.join(xdg, "sccache", "config"),
           env.get("BUILDCACHE_DIR") and os.path.join(env["BUILDCACHE_DIR"], "config.json"),
           os.path.join(home, ".buildcache", "config.json")]
    return list(dict.fromkeys(p for p in out if p))


def wrapper_config() -> list[Any]:
    """What a compiler cache reads to choose and run the compiler: its environment variables
    and its config files (by stat signature, absent ones too): the probe memo's validity."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(WRAPPER_ENV_PREFIXES))
    return [env, [[f, path_sig(f)] for f in wrapper_config_files()]]


def _ccache_setting(name: str, env_name: str) -> str | None:
    """A ccache setting: the variable ``env_name``, else ``name = value`` in its config files."""
    value = os.environ.get(env_name)
    if value is not None:
        return value
    for path in wrapper_config_files():
        if os.path.basename(path) != "ccache.conf":
            continue
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    key, eq, val = line.partition("=")
                    if eq and key.strip() == name:
                        return val.strip()
        except OSError:
            continue
    return None


def wrapper_prefixes() -> list[str]:
    """The programs ccache runs in front of the compiler (``CCACHE_PREFIX``/``prefix_command``,
    ``CCACHE_PREFIX_CPP``/``prefix_command_cpp``: lists of words), resolved."""
    import shlex

    out = []
    for name, env_name in (("prefix_command", "CCACHE_PREFIX"), ("prefix_command_cpp", "CCACHE_PREFIX_CPP")):
        try:
            words = shlex.split(_ccache_setting(name, env_name) or "")
        except ValueError:
            words = []
        for w in words:
            found = which(w)
            if found and os.path.realpath(found) not in out:
                out.append(os.path.realpath(found))
    return out


def wrapped_driver(words: list[str], found: str) -> str | None:
    """The compiler a known wrapper will run, found the way the wrapper finds it: ccache's
    ``compiler`` setting (``CCACHE_COMPILER``, ``compiler =`` in ccache.conf), else the next word
    of ``CXX="ccache g++"``, or for a masquerade link (``/usr/lib/ccache/c++``) the first
    program of that name on ``PATH`` that is not the wrapper itself."""
    if not is_wrapper(found):
        return None
    if os.path.basename(os.path.realpath(found)) == "ccache":
        forced = _ccache_setting("compiler", "CCACHE_COMPILER")
        if forced and forced != "auto":
            return which(forced)
    if len(words) > 1:
        return which(words[1])
    name = os.path.basename(found)
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        cand = os.path.join(d or ".", name)
        if (os.path.isfile(cand) and os.access(cand, os.X_OK)
                and os.path.basename(os.path.realpath(cand)) not in WRAPPERS):
            return cand
    return None


def _run_text(cmd: list[str]) -> str:
    return _run_all([cmd])[0]


def _run_all(cmds: list[list[str]], env: dict[str, Any] | None = None) -> list[str]:
    """Run commands concurrently; each one's stdout+stderr text (``<failed: …>`` if it could not
    run). A cold host probes its compiler once; running the probes side by side keeps that short."""
    return [_finish(p) for p in _start_all(cmds, env)]


def _start_all(cmds: list[list[str]], env: dict[str, Any] | None = None) -> list[Any]:
    """Start commands side by side (stdout+stderr to one pipe); :func:`_finish` reads each."""
    import subprocess

    procs: list[Any] = []
    for cmd in cmds:
        try:
            # Each in its own process group: a probe that is killed takes what it started along
            # (a wrapper's compiler, a script's sleep), which would otherwise hold the pipe open.
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True))
        except OSError as exc:
            procs.append(f"<failed: {exc}>")
    return procs


def _finish(p: Any) -> str:
    """The text of a command :func:`_start_all` started (``<failed: …>`` if it could not run or
    ran past a minute)."""
    import subprocess

    if isinstance(p, str):
        return p
    try:
        return str(p.communicate(timeout=60)[0].decode("utf-8", "surrogateescape"))  # paths are bytes
    except subprocess.TimeoutExpired as exc:
        _kill(p)
        return f"<failed: {exc}>"


def _kill(p: Any) -> None:
    """Kill a probe :func:`_start_all` started, with its process group, and reap it."""
    import signal

    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        p.kill()
    p.communicate()


def _file_sha256(path: str) -> str | None:
    try:
        h = sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def _resolve_tool(path: str | None) -> str | None:
    if not path or path.startswith("<failed") or "\0" in path:
        return None
    if os.sep not in path:
        path = which(path)
    return os.path.realpath(path) if path else None


def libraries_dirs(text: str) -> list[str]:
    """The directories a driver searches for start files (``crti.o``…) and hands the linker as
    ``-L`` after the caller's (its ``-print-search-dirs`` ``libraries:`` line: ``-B``,
    ``GCC_EXEC_PREFIX`` and ``LIBRARY_PATH`` directories among its own), as given."""
    for line in text.splitlines():
        if line.startswith("libraries: "):
            return [d for d in line[len("libraries: "):].lstrip("=").split(os.pathsep) if d]
    return []


def programs_dirs(text: str) -> list[str]:
    """The directories a driver searches for the programs it runs (its ``-print-search-dirs``
    ``programs:`` line: ``-B`` and ``COMPILER_PATH`` directories, then its own), as given."""
    for line in text.splitlines():
        if line.startswith("programs: "):
            return [d for d in line[len("programs: "):].lstrip("=").split(os.pathsep) if d]
    return []


# Programs a driver looks up in its program directories (-B, COMPILER_PATH, its own) before PATH,
# and gcc's linker plugin, which it finds there too and hands ld to load (-plugin).
WATCHED_PROGRAMS = ("as", "ld", "collect2", "cc1plus", "cc1", "lto-wrapper", "liblto_plugin.so")


def linker_plugin(programs: list[str], cc1: str | None) -> str | None:
    """The linker plugin gcc's driver hands ld (``-plugin``, which ld loads and which may add to
    the link): the first readable ``liblto_plugin.so`` in its program directories (``programs``,
    as :func:`programs_dirs` gives them), by real path; ``None`` for another driver (``cc1``:
    the compiler proper it runs) or where there is none."""
    if not cc1 or os.path.basename(cc1) != "cc1plus":
        return None
    for d in programs:
        path = os.path.join(d, "liblto_plugin.so")
        if os.access(path, os.R_OK) and os.path.isfile(path):
            return os.path.realpath(path)
    return None


def search_validators(programs: list[str], answers: list[str]) -> list[list[Any]]:
    """Validators for where the driver looked for its programs: each of :data:`WATCHED_PROGRAMS`
    in each of its ``programs`` directories (one installed there later is run instead), and for a
    program it answered by bare name (found in none of them: it runs the one ``PATH`` finds) that
    name in each ``PATH`` directory up to the one that has it (a relative entry is checked
    relative to the process that checks, as the driver's search would be). Names, not the
    directories' own signatures: a log written into a working directory on ``PATH`` is no
    reason to probe again."""
    bare = [a for a in answers if a and os.sep not in a and not a.startswith("<failed")]
    names = list(dict.fromkeys([*WATCHED_PROGRAMS, *bare]))
    paths = [os.path.join(d, n) for d in programs for n in names]
    path_dirs = [d or "." for d in os.environ.get("PATH", os.defpath).split(os.pathsep)]
    for name in bare:
        found = which(name)
        for d in path_dirs:
            paths.append(os.path.join(d, name))
            if found is not None and os.path.dirname(found) == d:
                break
    return [[p, path_sig(p)] for p in dict.fromkeys(paths)]


def _tool(path: str) -> dict[str, Any] | None:
    """A program by resolved path, SHA-256 and first line of ``--version``."""
    real = _resolve_tool(path)
    if real is None:
        return None
    lines = _run_text([real, "--version"]).strip().splitlines()
    return {"path": real, "sha256": _file_sha256(real), "version": lines[0] if lines else ""}


def _probe_compiler(cmd: list[str], early: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the driver (through whatever wraps it) to learn which programs it really runs."""
    import threading

    from .tracking import OWN_DIR_PROBES

    # The default search list, without the include-path variables (they are user directories).
    plain_env = {k: v for k, v in os.environ.items() if k not in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")}
    # The assembler's and linker's own probes, for the ones on PATH (where gcc and clang mostly
    # name them): started with the driver's rather than once it has named them, a round of
    # spawns later (a fresh host's early compile waits for them); read only if it names those.
    guess = (_resolve_tool("as"), _resolve_tool("ld"))
    procs: list[Any] = []
    ahead: list[Any] = []
    # The binaries are hashed on threads (hashlib releases the GIL), each as soon as its path is
    # known (cc1plus, ~35 MB, is a fresh host's longest step), while the other probes run.
    sums: dict[str, str | None] = {}
    threads: list[threading.Thread] = []

    def hash_on_thread(path: str | None) -> None:
        if path and path not in sums:
            sums[path] = None
            t = threading.Thread(target=lambda: sums.__setitem__(path, _file_sha256(path)))
            t.start()
            threads.append(t)

    try:
        procs += _start_all(
            [[*cmd, "--version"], [*cmd, "-###", "-x", "c++", "-c", os.devnull, "-o", os.devnull],
             [*cmd, "-print-prog-name=as"], [*cmd, "-print-prog-name=ld"]], env=plain_env)
        ahead += _start_all(_tool_runs(*guess))
        procs += _start_all(
            [[*cmd, "-x", "c++", "-E", "-v", os.devnull, "-o", os.devnull]]
            + [[*cmd, probe] for probe in OWN_DIR_PROBES] + [[*cmd, "-print-search-dirs"]], env=plain_env)
        return _probe_answers(procs, hash_on_thread, sums, threads, early, (guess, ahead))
    finally:
        for p in procs + ahead:  # every probe waited for, also when reading one raised
            if not isinstance(p, str) and p.returncode is None:  # not read and reaped by _finish
                _kill(p)
        for t in threads:
            t.join()


def _tool_runs(as_path: str | None, ld_path: str | None) -> list[list[str]]:
    """The assembler's and linker's own probes (what :func:`_probe_answers` reads of them)."""
    runs = [[as_path, "--version"]] if as_path else []
    return runs + ([[ld_path, "--version"], [ld_path, "--help"]] if ld_path else [])


def _probe_answers(procs: list[Any], hash_on_thread: Callable[[str | None], None], sums: dict[str, str | None],
                   threads: list[Any], early: Callable[[dict[str, Any]], None] | None = None,
                   ahead: tuple[tuple[str | None, str | None], list[Any]] | None = None) -> dict[str, Any]:
    """The answers of :func:`_probe_compiler`'s driver probes ``procs`` (started), the assembler's
    and linker's own probes and the binaries' hashes (``hash_on_thread`` fills ``sums``).
    ``early`` is handed the facts a build command needs (the compiler proper's path, the
    assembler's version, whether the linker writes a dependency file: the fields of the record's
    ``real`` that :mod:`stubcache.build.buildinputs` reads) as soon as they are known, before the
    slower answers and the hashes (cc1plus, ~35 MB, is a fresh host's longest step); it must not
    raise. ``ahead``: the assembler and linker guessed, and their probes (:func:`_tool_runs`)
    started already; read if the driver names those two, else left for the caller to end."""
    import shlex

    from .tracking import compiler_dirs_from, parse_search_path

    started = list(procs)
    trace = _finish(started[1])
    cc1 = None
    for line in trace.splitlines():
        if line.startswith(" ") and "-###" not in line:
            try:
                first = shlex.split(line)[0]
            except (ValueError, IndexError):
                continue
            if os.path.isabs(first) and "\0" not in first:
                cc1 = os.path.realpath(first)
                break
    # The binaries' hashes, on threads; where a compile is to start early, once it has: on two
    # cores, cc1plus's hash (~35 ms) slowed the probes that compile waits for.
    deferred: list[str | None] = []
    hash_binary = hash_on_thread if early is None else deferred.append
    hash_binary(cc1)
    as_name, ld_name = _finish(started[2]).strip(), _finish(started[3]).strip()
    as_path, ld_path = _resolve_tool(as_name), _resolve_tool(ld_name)
    hash_binary(as_path)
    hash_binary(ld_path)
    if ahead is not None and ahead[0] == (as_path, ld_path):
        later = ahead[1]
    else:
        later = _start_all(_tool_runs(as_path, ld_path))
        procs += later  # (waited for by the caller's cleanup too)
    texts = [_finish(p) for p in later]

    def first_line(text: str) -> str:
        lines = text.strip().splitlines()
        return lines[0] if lines else ""

    as_version = first_line(texts.pop(0)) if as_path else None
    ld_version, ld_depfile = (first_line(texts[0]), "--dependency-file" in texts[1]) if ld_path else (None, False)
    if early is not None:
        early({"cc1": {"path": cc1} if cc1 else None, "as": {"path": as_path, "version": as_version} if as_path else None,
               "ld_depfile": ld_depfile})
        for path in deferred:
            hash_on_thread(path)
    version, defaults, *own, search_dirs = [_finish(p) for p in (started[0], *started[4:])]
    for t in threads:
        t.join()
    real: dict[str, Any] = {}
    if cc1:
        real["cc1"] = {"path": cc1, "sha256": sums.get(cc1)}  # cc1plus has no --version of its own
    for line in trace.splitlines():
        if " version " in line and not line.startswith(" "):
            real["driver_version"] = line.strip()
            break
    real["as"] = {"path": as_path, "sha256": sums.get(as_path), "version": as_version} if as_path else None
    real["ld"] = {"path": ld_path, "sha256": sums.get(ld_path), "version": ld_version} if ld_path else None
    real["ld_depfile"] = ld_depfile
    plugin = linker_plugin(programs_dirs(search_dirs), cc1)
    if plugin:
        real["lto_plugin"] = {"path": plugin, "sha256": _file_sha256(plugin)}
    real["library_dirs"] = libraries_dirs(search_dirs)
    # The compiler's own directories: their files are pinned by its version (see inputs.py).
    real["own_dirs"] = compiler_dirs_from(own)
    # Its C++ standard library headers (libstdc++'s /usr/include/c++/<v>, libc++'s
    # include/c++/v1): default search directories with a c++ component.
    real["stdlib_dirs"] = [d for d in parse_search_path(defaults).dirs if "/c++/" in d + "/"]
    validators = []
    for tool in real.values():
        if isinstance(tool, dict) and tool.get("path"):
            validators.append([tool["path"], path_sig(tool["path"])])
    # Where the driver looked for as and ld: a program that appears earlier there is run instead.
    validators += search_validators(programs_dirs(search_dirs), [as_name, ld_name])
    return {"version": version.strip(), "real": real, "validators": validators}


def _compiler_answer_holds(value: dict[str, Any]) -> bool:
    """A compiler probe's kept answer still holds: it has the shape :func:`compiler_identity`
    reads (a memo file of the user's own may still be damaged) and its tools are unchanged."""
    return (isinstance(value, dict) and "version" in value and isinstance(value.get("real"), dict)
            and isinstance(value.get("validators"), list) and _real_tools_unchanged(value))


def _real_tools_unchanged(value: dict[str, Any]) -> bool:
    try:
        return all(path_sig(p) == sig for p, sig in value.get("validators", []))
    except (TypeError, ValueError):
        return False


def _boot_id() -> str:
    """This boot's id, for memos that hold only until a reboot; without one, this process's pid
    (the memo then holds for this process only)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return str(os.getpid())


def native_target(cxx: str, native: tuple[Any, ...], ident: dict[str, Any], memo: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """See :meth:`Fingerprint.native_target`."""
    memo_key = f"native:{ident.get('path')}:{ident.get('version')}:{native}:{_boot_id()}"

    def compute() -> dict[str, Any]:
        import shlex

        words = shlex.split(cxx) or [cxx]
        out = _run_text([*words, *native, "-Q", "--help=target"])
        resolved = sorted({ln.split()[0].rstrip("=") + "=" + ln.split()[-1] for ln in out.splitlines()
                           if ln.strip().startswith("-m") and len(ln.split()) >= 2})
        march = [r for r in resolved if r.startswith(("-march=", "-mtune=", "-mcpu="))]
        if not march:  # clang has no -Q --help=target: its driver names the CPU and features in -###
            resolved = _cc1_target([*words, *native, "-###", "-x", "c++", "-c", os.devnull, "-o", os.devnull])
            march = [r for r in resolved if r.startswith(("-target-cpu=", "-tune-cpu="))]
        return {"flags": list(native), "target": march,
                "options_sha256": sha256("\n".join(resolved).encode()).hexdigest()}

    return memo(memo_key, compute)


def _cc1_target(cmd: list[str]) -> list[str]:
    """The target a clang driver resolved (``-target-cpu``, ``-tune-cpu``, every
    ``-target-feature``) from its ``-###`` line for the compiler proper, as ``-opt=value``."""
    import shlex

    for line in _run_text(cmd).splitlines():
        if '"-cc1"' not in line:
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            return []
        pairs = zip(words, words[1:])
        return sorted({f"{a}={b}" for a, b in pairs if a in ("-target-cpu", "-tune-cpu", "-target-feature")})
    return []


def _clang_linker(output: str) -> str | None:
    """The program of the link line in a clang driver's ``-###`` output (its last command line
    that is not a ``-cc1`` one), or ``None``."""
    import shlex

    found = None
    for line in output.splitlines():
        if not line.startswith(' "') or '"-cc1' in line:
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        if words:
            found = words[0]
    return found


def flag_tools(cxx: str, flags: tuple[Any, ...], ident: dict[str, Any], memo: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """See :meth:`Fingerprint.flag_tools`."""
    memo_key = (f"tools4:{ident.get('path')}:{ident.get('version')}:{flags}:{os.environ.get('PATH', '')}:"
                f"{_tool_env()}")

    def compute() -> dict[str, Any]:
        import shlex

        words = shlex.split(cxx) or [cxx]
        cmds = [[*words, *flags, f"-print-prog-name={prog}"] for prog in ("cc1plus", "as", "ld")]
        cmds.append([*words, *flags, "-print-search-dirs"])
        clang = "clang" in str(ident.get("version") or "").lower()
        if clang:
            # clang answers -print-prog-name=ld without -fuse-ld= and -B (gcc's driver heeds
            # them): the linker it would run is the program of its -### link line.
            cmds.append([*words, *flags, "-###", "-shared", "-x", "none", os.devnull, "-o", os.devnull])
        names = _run_all(cmds)
        linker = _clang_linker(names.pop()) if clang else None
        dirs = programs_dirs(names.pop())
        searched = search_validators(dirs, [n.strip() for n in names])
        if linker:
            names[2] = linker
        value: dict[str, Any] = {"flags": list(flags), "validators": []}
        for prog, name in zip(("cc1plus", "as", "ld"), names):
            tool = _tool(name.strip())
            value[prog] = tool
            if tool:
                value["validators"].append([tool["path"], path_sig(tool["path"])])
        plugin = linker_plugin(dirs, (value["cc1plus"] or {}).get("path"))
        value["lto_plugin"] = {"path": plugin, "sha256": _file_sha256(plugin)} if plugin else None
        if plugin:
            value["validators"].append([plugin, path_sig(plugin)])
        value["validators"] += searched  # where it looked (-B directories first)
        return value

    value = memo(memo_key, compute, valid=_real_tools_unchanged)
    return {k: v for k, v in value.items() if k != "validators"}


def libc() -> str:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or "unknown"
    except (ValueError, OSError, AttributeError):
        return "unknown"


# The names whose appearance in a directory on the import path can change which torch is found:
# ``torch`` as a package or namespace directory, a source, sourceless or extension module; and
# ``sitecustomize``/``usercustomize``, which ``site`` imports from the import path at start-up
# (an import hook installed there can redirect ``torch``).
_SHADOW_STEMS = ("torch", "sitecustomize", "usercustomize")
_STARTUP_STEMS = ("sitecustomize", "usercustomize")  # what start-up imports from anywhere on the path


def import_shadow_names(extension_suffixes: Sequence[str]) -> list[str]:
    """The names :data:`_SHADOW_STEMS` can take in a directory on ``sys.path``, given
    ``importlib.machinery.EXTENSION_SUFFIXES``."""
    return [name for stem in _SHADOW_STEMS
            for name in (stem, stem + ".py", stem + ".pyc", *(stem + s for s in extension_suffixes))]


def site_directories() -> list[str] | None:
    """The directories whose ``.pth`` files ``site`` processes for this interpreter (its site and
    user site directories), or ``None`` if ``site`` cannot say (then every import path entry is
    checked by mtime). Imports ``site`` (already imported unless Python runs with ``-S``)."""
    try:
        import site

        dirs = [*site.getsitepackages(), site.getusersitepackages()]
    except (AttributeError, TypeError, OSError):  # an old virtualenv's own site.py lacks them
        return None
    return [d for d in dirs if type(d) is str]


def import_path_checks(entries: Sequence[object], sites: Sequence[str] | None, tdir: str | None,
                       names: Sequence[str]) -> tuple[list[str], dict[str, list[Any]]]:
    """How the whole-fingerprint memo (and a hit record through it) checks that ``tdir`` is still
    the torch found on the import path ``entries`` (``sys.path``): each entry up to the one
    holding torch, as one of

    - a *shadow* ``{directory: [signature, names]}`` (the shape of an entry's shadowing headers,
      checked by :func:`stubcache.key.inputs.still_valid` and by the hit record): a plain
      directory, where ``site`` processes no ``.pth`` file. It holds at the cost of one ``stat``
      while the directory is unchanged, and once it changed (an engine writing a log into its
      script directory) while none of ``names`` exists there and it is still a directory;
    - a *validator* (a path checked by its stat signature, mtime included): a site directory of
      ``sites`` (a new ``.pth`` there can add an import hook), a directory holding a ``.pth``
      file now (``site.addsitedir`` may have been called on it), a file (a zip archive), an
      absent entry (it may appear as either), an entry that is not a ``str``; every entry if
      ``sites`` is ``None``.

    Every directory row also watches for a ``.pth`` file appearing (:data:`~stubcache.hit.ANY_PTH`:
    ``site.addsitedir`` may be called on any directory); the ``.pth`` files there already (a
    checkpoint named ``model.pth``) are allowed in the row (:data:`~stubcache.hit.KNOWN_PTH`)
    and are validators themselves (one rewritten in place changes no directory). The entries
    after torch's are checked too, for what start-up processes (``.pth`` files,
    ``sitecustomize``/``usercustomize``); a directory met twice keeps everything either occurrence
    watches. A name that exists already (a namespace ``torch/`` that loses to the installed
    package, a ``sitecustomize.py``) is a validator itself: it can change without its directory
    changing. A relative entry (``''`` under ``python -c``) is recorded as given (``''`` as ``.``),
    so it is checked where the checking process stands; its ``torch`` is always a validator and
    it never ends the watch for ``torch`` (another working directory may hold none, or another).
    An entry that does not exist because a file stands in its path (``deps.zip/lib``) adds that
    file's validator; an entry that is not a ``str`` is skipped, as the import system skips it.

    Stats the entries; depends on nothing else."""
    known: set[str] = set()
    for d in sites or ():
        known.update((os.path.abspath(d), os.path.realpath(d)))
    parent = os.path.dirname(tdir) if tdir else None
    own = os.path.realpath(tdir) if tdir else None
    startup = [n for n in names if n.split(".", 1)[0] in _STARTUP_STEMS]
    validators: list[str] = []
    shadows: dict[str, list[Any]] = {}
    after = False  # past torch's entry
    for entry in entries:
        if type(entry) is not str or "\0" in entry:
            continue
        relative = not os.path.isabs(entry)
        path = os.path.abspath(entry or ".")
        where = (entry or ".") if relative else path
        watched = startup if after else list(names)
        pths = _pth_files(path)  # None: not a directory that can be listed
        if sites is not None and pths is not None and path not in known and os.path.realpath(path) not in known:
            row = shadows.setdefault(where, [recordable(dir_sig(path)), []])
            row[1] = list(dict.fromkeys([*row[1], *watched, ANY_PTH, *(KNOWN_PTH + p for p in pths)]))
        else:
            validators.append(where)
            if pths is None:
                validators += _file_in_path(path)
        validators += [os.path.join(where, p) for p in pths or ()]
        for name in watched:
            there = os.path.join(path, name)
            if os.path.lexists(there) and (relative or os.path.realpath(there) != own):
                validators.append(os.path.join(where, name))
        if parent and path == parent and not relative:
            after = True
    return list(dict.fromkeys(validators)), shadows


def _pth_files(path: str) -> list[str] | None:
    # The .pth files in directory ``path`` (sorted), or None if it is not a directory that can be listed.
    try:
        with os.scandir(path) as it:
            return sorted(e.name for e in it if e.name.endswith(".pth"))
    except OSError:  # not a directory, absent, unreadable
        return None


def _file_in_path(path: str) -> list[str]:
    # For an entry that is not a directory: the file standing in its path, if any (the nearest
    # existing ancestor when that is not a directory: a zip archive the entry points into).
    probe = path
    while True:
        up = os.path.dirname(probe)
        if up == probe:
            return []
        probe = up
        try:
            st = os.stat(probe)
        except OSError:
            continue
        return [] if stat.S_ISDIR(st.st_mode) else [probe]


def memo_checks(fp: dict[str, Any], env: dict[str, Any], tdir: str | None,
                held: Sequence[Any] = ()) -> dict[str, Any]:
    """What the whole-fingerprint memo ``fp`` (for the key variables ``env`` and the torch in
    ``tdir``) holds under: ``validators`` (path, stat signature) and ``shadows`` (see
    :func:`import_path_checks`). ``held``: the compiler probe's own validators (path, signature
    when probed), which the memo keeps as they are."""
    import importlib.machinery

    # The import path up to torch's directory: a torch installed earlier on it must be noticed.
    paths, shadows = import_path_checks(sys.path, site_directories(), tdir,
                                        import_shadow_names(importlib.machinery.EXTENSION_SUFFIXES))
    if tdir:
        paths += [os.path.join(tdir, "version.py"), os.path.join(tdir, "lib", "libc10.so")]
    words = env.get("CXX", "c++").split() or ["c++"]
    command = words[0]
    found = which(command)
    driver = wrapped_driver(words, found) if found else None
    if found and (os.sep not in command or driver):
        for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
            paths.append(d or ".")
            if os.path.dirname(found) == (d or ".") and not driver:
                break  # behind a wrapper every PATH directory matters: it searches them all
    if found:
        paths += [found, fp["cxx"]["path"] or found]
    if driver:
        paths.append(driver)
    if found and is_wrapper(found):  # its settings choose the compiler it runs
        paths += wrapper_config_files() + wrapper_prefixes()
    for tool in (fp["cxx"].get("real") or {}).values():
        if isinstance(tool, dict) and tool.get("path"):
            paths.append(tool["path"])  # the compiler behind a wrapper, its assembler and linker
    # Once each: PATH may name a directory twice, and a found compiler is often its real file.
    rows = {p: path_sig(p) for p in dict.fromkeys(paths)}
    absent = []
    for row in held:
        if not (isinstance(row, list) and len(row) == 2 and type(row[0]) is str):
            continue
        path, sig = row
        if sig is None and not os.path.lexists(path):
            absent.append(path)  # a program that must stay absent (search_validators)
        else:
            rows[path] = sig  # as probed: a change since then must not be blessed here
    if absent:
        from .tracking import file_candidates

        # Watched as shadow rows, as a header's candidates are: one stat while unchanged.
        file_candidates(absent, (), shadows)
    return {"validators": [[p, sig] for p, sig in rows.items()], "shadows": shadows}


def python_facts() -> dict[str, Any]:
    import importlib.machinery

    return {
        "version": "%d.%d.%d" % sys.version_info[:3],
        "implementation": sys.implementation.cache_tag,
        "abiflags": getattr(sys, "abiflags", ""),
        "ext_suffix": importlib.machinery.EXTENSION_SUFFIXES[0],
    }


def nvcc_command() -> str:
    """The nvcc that torch would use."""
    nvcc = os.environ.get("PYTORCH_NVCC")
    if not nvcc:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if home:
            nvcc = os.path.join(home, "bin", "nvcc")
        else:
            nvcc = which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return nvcc


def visible_cuda_archs(memo: Callable[..., dict[str, Any]]) -> list[str] | None:
    """Compute capabilities (``"9.0"``) of the GPUs this process sees, as torch's
    ``_get_cuda_arch_flags`` would list them; memoised per boot, GPU set and
    ``CUDA_VISIBLE_DEVICES`` (asking the driver costs a ``cuInit``)."""
    try:
        gpus = sorted(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        gpus = []
    memo_key = f"cudaarch:{_boot_id()}:{gpus}:{os.environ.get('CUDA_VISIBLE_DEVICES')}"

    def compute() -> dict[str, Any]:
        return {"archs": _query_cuda_archs()}

    archs: list[str] | None = memo(memo_key, compute).get("archs")
    return archs


def _query_cuda_archs() -> list[str] | None:
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    out = set()
    for i in range(count.value):
        dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(dev), i) != 0:
            return None
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
        if (cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0
                or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0):
            return None
        out.add(f"{major.value}.{minor.value}")
    return sorted(out)


