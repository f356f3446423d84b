"""Everything besides the spec that changes the binary: torch, compiler, Python, platform, env.

Computed at most once per process (per compiler), without importing torch: torch's version comes
from ``torch/version.py`` found with ``importlib.util.find_spec``, and the compiler's ``--version``
output is remembered on disk keyed by the compiler's resolved path, size and mtime, so a hit in a
fresh process starts no subprocess.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import threading
from typing import Any

FORMAT_VERSION = 3  # 2: real compiler, tracked inputs, needless fields nulled; 3: records without the holes of 2

# Environment variables that torch's cpp_extension, the compiler drivers (gcc, clang, nvcc) or
# the linker read when forming or running build commands and that can change the output; the
# table in docs/cache.md says what each one does. MAX_JOBS, TMPDIR and the diagnostics-only
# variables are not here: they do not change the library.
KEY_ENV_VARS = (
    "CXX", "CC", "CUDA_HOME", "CUDA_PATH", "CUDA_INC_PATH", "CUDNN_HOME", "CUDNN_PATH",
    "ROCM_HOME", "ROCM_PATH", "HIP_HOME", "PYTORCH_ROCM_ARCH", "TORCH_CUDA_ARCH_LIST",
    "TORCH_XPU_ARCH_LIST", "PYTORCH_NVCC", "NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN",
    "TORCH_EXTENSION_SKIP_NVCC_GEN_DEPENDENCIES", "TORCH_NO_COMPILER_WRAPPER",
    "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "GCC_EXEC_PREFIX",
    "COMPILER_PATH", "SOURCE_DATE_EPOCH", "CCC_OVERRIDE_OPTIONS", "LD_RUN_PATH", "GNUTARGET",
    "LDEMULATION", "LC_ALL", "LC_CTYPE", "LANG",
)
# gcc takes the source character set from the locale; the usual UTF-8 and C locales all read
# sources the same way, so only other values split the key.
_LOCALE_VARS = ("LC_ALL", "LC_CTYPE", "LANG")


def _neutral_locale(value: str) -> bool:
    v = value.lower().replace("-", "")
    return v in ("", "c", "posix") or v.endswith((".utf8", ".utf8@euro"))

_lock = threading.Lock()
# (environment snapshot, fingerprint computed from exactly that snapshot), replaced as one
# object so a thread can never pair a new environment with an old fingerprint.
_state: tuple | None = None
_ENV_DATA = getattr(os.environ, "_data", None)  # CPython: the raw bytes mapping behind os.environ
_ENV_KEYS_RAW = tuple(os.environ.encodekey(k) for k in KEY_ENV_VARS) if _ENV_DATA is not None else ()


def _env_snapshot() -> tuple:
    """The key environment variables' raw values: a few dict lookups, cheap enough for every call."""
    if _ENV_DATA is not None:
        get = _ENV_DATA.get
        return tuple([get(k) for k in _ENV_KEYS_RAW])
    return tuple([os.environ.get(k) for k in KEY_ENV_VARS])


def _env_from_snapshot(snap: tuple) -> dict[str, str]:
    out = {}
    for name, raw in zip(KEY_ENV_VARS, snap):
        if raw is not None:
            value = os.environ.decodevalue(raw) if _ENV_DATA is not None else raw
            if name in _LOCALE_VARS and _neutral_locale(value):
                continue
            out[name] = value
    return out
_compilers: dict[str, dict[str, Any]] = {}
_natives: dict[tuple, dict[str, Any]] = {}
_torch_dir: str | None = None


def torch_dir() -> str | None:
    """The installed torch package directory, found without importing torch."""
    global _torch_dir
    if _torch_dir is None:
        mod = sys.modules.get("torch")
        if mod is not None and getattr(mod, "__file__", None):
            _torch_dir = os.path.dirname(mod.__file__)
        else:
            spec = importlib.util.find_spec("torch")
            if spec is None or not spec.submodule_search_locations:
                return None
            _torch_dir = list(spec.submodule_search_locations)[0]
    return _torch_dir


_VERSION_LINE = re.compile(r"^(__version__|cuda|hip|git_version|debug)\s*(?::[^=]*)?=\s*(.+?)\s*$", re.M)


def _torch_facts(state_dir: str | None) -> dict[str, Any]:
    tdir = torch_dir()
    if tdir is None:
        return {"version": None}
    facts: dict[str, Any] = {}
    try:
        with open(os.path.join(tdir, "version.py"), encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    for field, raw in _VERSION_LINE.findall(text):
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
    facts["cxx11_abi"] = _cxx11_abi(tdir, state_dir)
    return facts


def _cxx11_abi(tdir: str, state_dir: str | None) -> int | None:
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

    def compute() -> dict:
        with open(lib, "rb") as fh:
            data = fh.read()
        return {"abi": 1 if b"__cxx11" in data else 0}

    return _memo(state_dir, memo_key, compute).get("abi")


def _write_json(path: str, data: dict) -> None:
    """Best-effort atomic write of a memo (readers see the old file or the new one)."""
    from . import fsroot, locking

    try:
        parent, name = os.path.split(path)
        with fsroot.Dir(parent) as dfd:  # never through a planted link (O_EXCL temp, dir fd)
            locking.write_file(dfd, name, json.dumps(data).encode(), mode=0o644)
    except (OSError, ValueError):
        pass


def _load_json(path: str):
    """A memo's JSON: a regular file only, size-capped (a FIFO planted in state/ cannot hang a start)."""
    from . import fsroot

    try:
        return json.loads(fsroot.read_at(None, path, fsroot.SMALL_CAP * 16))
    except RecursionError:
        raise ValueError("nests too deeply") from None


def _read_memo(path: str, memo_key: str):
    try:
        data = _load_json(path)
        if data.get("memo_key") == memo_key:
            return data["value"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


_read_only = False  # set by read_only(): compute what is missing, write nothing


class read_only:
    """Context manager: compute the fingerprint without writing any memo (``prune --dry-run``)."""

    def __enter__(self) -> None:
        global _read_only
        self._old, _read_only = _read_only, True

    def __exit__(self, *exc: object) -> None:
        global _read_only
        _read_only = self._old


MEMO_LOCK_WAIT = 90.0  # seconds; longer than the probe's own 60 s timeout


def _memo_wait() -> float:
    """The memo lock's bound: ``STUBCACHE_LOCK_TIMEOUT`` when smaller than ``MEMO_LOCK_WAIT``
    (a group member holding the lock costs at most that, then we compute it ourselves)."""
    from .locking import lock_timeout_from_env

    try:
        return min(MEMO_LOCK_WAIT, lock_timeout_from_env())
    except ValueError:
        return MEMO_LOCK_WAIT


def _memo(state_dir: str | None, memo_key: str, compute, valid=None) -> dict:
    """A tiny on-disk memo for expensive, deterministic toolchain facts.

    On a miss, one process computes under a ``flock`` on ``<memo>.lock`` while the others wait
    and read its result: a herd starting on a cold host runs ``c++ --version`` once, not N times.
    """
    name = hashlib.sha256(memo_key.encode()).hexdigest()[:32] + ".json"
    path = os.path.join(state_dir, name) if state_dir else None
    if path is None:
        return compute()
    value = _read_memo(path, memo_key)
    if value is not None and (valid is None or valid(value)):
        return value
    if _read_only:
        return compute()
    from . import fsroot, locking

    try:
        with fsroot.Dir(state_dir) as sfd:
            # A group-writable (shared) state directory gets a group-usable lock file.
            lock_fd = locking.open_lock_at(sfd, name + ".lock", shared=bool(os.fstat(sfd).st_mode & 0o020))
    except OSError:
        lock_fd = -1  # read-only root or another user's lock file: compute without sharing
    try:
        if lock_fd >= 0 and locking.wait_flock(lock_fd, locking.EX, _memo_wait()):
            value = _read_memo(path, memo_key)
            if value is not None and (valid is None or valid(value)):
                return value
        elif lock_fd >= 0:
            from . import _log

            _log.warning("stubcache: the toolchain memo lock %s.lock is held by %s past %.0fs; probing "
                         "without it", path, locking.describe_holders(lock_fd), _memo_wait())
        value = compute()
        _write_json(path, {"memo_key": memo_key, "value": value})
        return value
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)


def which(command: str) -> str | None:
    """``shutil.which`` for executables, without importing shutil on the hit path."""
    if os.sep in command:
        return command if os.path.isfile(command) and os.access(command, os.X_OK) else None
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        cand = os.path.join(d or ".", command)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def compiler_identity(command: str, state_dir: str | None) -> dict[str, Any]:
    """Who compiles when ``command`` (``CXX``) runs, memoised on disk.

    ``path``/``version``: the command as found on ``PATH`` (resolved) and its ``--version``.
    ``real``: the compiler proper and the assembler and linker that the driver runs, found by
    asking the driver itself (``-###``, ``-print-prog-name``) through any wrapper: a ccache or
    sccache masquerade directory, ``CXX="ccache g++"``, or a script. Each is named by resolved
    path, version line and SHA-256, so switching the compiler behind a wrapper changes the key.
    """
    with _lock:
        cached = _compilers.get(command)
    if cached is not None:
        return cached
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
        dsig = _sig(driver) if driver else None
        # A wrapper finds the real compiler on PATH, so PATH is part of what this memo means.
        memo_key = (f"cc4:{command}:{found}:{path}:{st.st_size}:{st.st_mtime_ns}:{os.environ.get('PATH', '')}:"
                    f"{driver and os.path.realpath(driver)}:{dsig}:{_tool_env()}")

        def compute() -> dict:
            value = _probe_compiler([found, *words[1:]])
            # The program named by CXX itself: a script in front of the compiler may add flags.
            value["sha256"] = _file_sha256(path)
            tool = _tool(driver) if driver else None
            if tool:
                value["real"]["driver"] = tool
                value["validators"].append([tool["path"], _sig(driver)])
            return value

        value = _memo(state_dir, memo_key, compute, valid=_real_tools_unchanged)
        ident = {"command": command, "path": path, "sha256": value.get("sha256"), "version": value["version"],
                 "real": value.get("real")}
    with _lock:
        _compilers[command] = ident
    return ident


# Variables that change which programs the driver runs (or with what options), so what a
# compiler probe found holds only for their values.
TOOL_ENV_VARS = ("COMPILER_PATH", "GCC_EXEC_PREFIX", "CCC_OVERRIDE_OPTIONS")


def _tool_env() -> list:
    return [os.environ.get(v) for v in TOOL_ENV_VARS]


WRAPPERS = ("ccache", "sccache", "buildcache")


def wrapped_driver(words: list[str], found: str) -> str | None:
    """The compiler a known wrapper will run, found the way the wrapper finds it: the next word
    of ``CXX="ccache g++"``, or for a masquerade link (``/usr/lib/ccache/c++``) the first
    program of that name on ``PATH`` that is not the wrapper itself."""
    if os.path.basename(os.path.realpath(found)) not in WRAPPERS:
        return None
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


def _run_all(cmds: list[list[str]], env: dict | None = None) -> list[str]:
    """Run commands concurrently; each one's stdout+stderr text (``<failed: …>`` if it could not
    run). A cold host probes its compiler once; running the probes side by side keeps that short."""
    import subprocess

    procs: list = []
    for cmd in cmds:
        try:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env))
        except OSError as exc:
            procs.append(f"<failed: {exc}>")
    out = []
    for p in procs:
        if isinstance(p, str):
            out.append(p)
            continue
        try:
            out.append(p.communicate(timeout=60)[0].decode("utf-8", "replace"))
        except subprocess.TimeoutExpired as exc:
            p.kill()
            p.communicate()
            out.append(f"<failed: {exc}>")
    return out


def _file_sha256(path: str) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def _resolve_tool(path: str | None) -> str | None:
    if not path or path.startswith("<failed"):
        return None
    if os.sep not in path:
        path = which(path)
    return os.path.realpath(path) if path else None


def _tool(path: str) -> dict | None:
    """A program by resolved path, SHA-256 and first line of ``--version``."""
    real = _resolve_tool(path)
    if real is None:
        return None
    lines = _run_text([real, "--version"]).strip().splitlines()
    return {"path": real, "sha256": _file_sha256(real), "version": lines[0] if lines else ""}


def _probe_compiler(cmd: list[str]) -> dict:
    """Run the driver (through whatever wraps it) to learn which programs it really runs."""
    import shlex
    import threading

    from .inputs import OWN_DIR_PROBES, compiler_dirs_from, parse_search_path

    # The default search list, without the include-path variables (they are user directories).
    plain_env = {k: v for k, v in os.environ.items() if k not in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")}
    version, trace, as_name, ld_name, defaults, *own = _run_all(
        [[*cmd, "--version"], [*cmd, "-###", "-x", "c++", "-c", os.devnull, "-o", os.devnull],
         [*cmd, "-print-prog-name=as"], [*cmd, "-print-prog-name=ld"],
         [*cmd, "-x", "c++", "-E", "-v", os.devnull, "-o", os.devnull]]
        + [[*cmd, probe] for probe in OWN_DIR_PROBES], env=plain_env)
    cc1 = None
    for line in trace.splitlines():
        if line.startswith(" ") and "-###" not in line:
            try:
                first = shlex.split(line)[0]
            except (ValueError, IndexError):
                continue
            if os.path.isabs(first):
                cc1 = os.path.realpath(first)
                break
    as_path, ld_path = _resolve_tool(as_name.strip()), _resolve_tool(ld_name.strip())
    # The three binaries are hashed on threads (hashlib releases the GIL) while the assembler
    # and linker report their versions.
    tools = [t for t in (cc1, as_path, ld_path) if t]
    sums: dict[str, str | None] = {}
    threads = [threading.Thread(target=lambda t=t: sums.__setitem__(t, _file_sha256(t))) for t in tools]
    for t in threads:
        t.start()
    runs = [[as_path, "--version"]] if as_path else []
    runs += [[ld_path, "--version"], [ld_path, "--help"]] if ld_path else []
    texts = _run_all(runs)
    for t in threads:
        t.join()
    real: dict[str, Any] = {}
    if cc1:
        real["cc1"] = {"path": cc1, "sha256": sums.get(cc1)}  # cc1plus has no --version of its own
    for line in trace.splitlines():
        if " version " in line and not line.startswith(" "):
            real["driver_version"] = line.strip()
            break

    def first_line(text: str) -> str:
        lines = text.strip().splitlines()
        return lines[0] if lines else ""

    real["as"] = {"path": as_path, "sha256": sums.get(as_path), "version": first_line(texts.pop(0))} if as_path else None
    real["ld"] = None
    real["ld_depfile"] = False
    if ld_path:
        real["ld"] = {"path": ld_path, "sha256": sums.get(ld_path), "version": first_line(texts[0])}
        real["ld_depfile"] = "--dependency-file" in texts[1]
    # The compiler's own directories: their files are pinned by its version (see inputs.py).
    real["own_dirs"] = compiler_dirs_from(own)
    # Its C++ standard library headers (libstdc++'s /usr/include/c++/<v>, libc++'s
    # include/c++/v1): default search directories with a c++ component.
    real["stdlib_dirs"] = [d for d in parse_search_path(defaults).dirs if "/c++/" in d + "/"]
    validators = []
    for tool in real.values():
        if isinstance(tool, dict) and tool.get("path"):
            validators.append([tool["path"], _sig(tool["path"])])
    return {"version": version.strip(), "real": real, "validators": validators}


def _real_tools_unchanged(value: dict) -> bool:
    try:
        return all(_sig(p) == sig for p, sig in value.get("validators", []))
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


def native_target(flags: tuple, state_dir: str | None) -> dict[str, Any]:
    """What ``-march=native``/``-mtune=native``/``-mcpu=native`` mean on this CPU: the compiler's
    resolved target options (``-Q --help=target``), memoised per compiler, flags and boot."""
    native = tuple(f for f in flags if f.endswith("=native"))
    cxx = os.environ.get("CXX", "c++")
    with _lock:
        cached = _natives.get((cxx, native))
    if cached is not None:
        return cached
    ident = compiler_identity(cxx, state_dir)
    memo_key = f"native:{ident.get('path')}:{ident.get('version')}:{native}:{_boot_id()}"

    def compute() -> dict:
        import shlex

        words = shlex.split(cxx) or [cxx]
        out = _run_text([*words, *native, "-Q", "--help=target"])
        resolved = sorted({ln.split()[0].rstrip("=") + "=" + ln.split()[-1] for ln in out.splitlines()
                           if ln.strip().startswith("-m") and len(ln.split()) >= 2})
        march = [r for r in resolved if r.startswith(("-march=", "-mtune=", "-mcpu="))]
        return {"flags": list(native), "target": march,
                "options_sha256": hashlib.sha256("\n".join(resolved).encode()).hexdigest()}

    value = _memo(state_dir, memo_key, compute)
    with _lock:
        _natives[(cxx, native)] = value
    return value


_flag_tools: dict[tuple, dict[str, Any]] = {}


def flag_tools(flags: tuple, state_dir: str | None) -> dict[str, Any]:
    """The compiler proper, assembler and linker that the driver runs with ``flags`` (``-fuse-ld=gold``,
    ``-B DIR``), each by resolved path, SHA-256 and version: the probed default ones in the
    fingerprint are not the ones such a build uses. Memoised per compiler, flags and ``PATH``;
    re-probed when a found program's file changes."""
    cxx = os.environ.get("CXX", "c++")
    with _lock:
        cached = _flag_tools.get((cxx, flags))
    if cached is not None:
        return cached
    ident = compiler_identity(cxx, state_dir)
    memo_key = (f"tools:{ident.get('path')}:{ident.get('version')}:{flags}:{os.environ.get('PATH', '')}:"
                f"{_tool_env()}")

    def compute() -> dict:
        import shlex

        words = shlex.split(cxx) or [cxx]
        names = _run_all([[*words, *flags, f"-print-prog-name={prog}"] for prog in ("cc1plus", "as", "ld")])
        value: dict[str, Any] = {"flags": list(flags), "validators": []}
        for prog, name in zip(("cc1plus", "as", "ld"), names):
            tool = _tool(name.strip())
            value[prog] = tool
            if tool:
                value["validators"].append([tool["path"], _sig(tool["path"])])
        return value

    value = _memo(state_dir, memo_key, compute, valid=_real_tools_unchanged)
    value = {k: v for k, v in value.items() if k != "validators"}
    with _lock:
        _flag_tools[(cxx, flags)] = value
    return value


def _libc() -> str:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or "unknown"
    except (ValueError, OSError, AttributeError):
        return "unknown"


def base_fingerprint(state_dir: str | None) -> dict[str, Any]:
    """The process-wide fingerprint (torch, C++ compiler, Python, platform, env, format)."""
    global _state
    snap = _env_snapshot()
    state = _state
    if state is not None and state[0] == snap:
        return state[1]
    env = _env_from_snapshot(snap)  # the values of this snapshot, not a later re-read
    # First call, or the process changed CXX/TORCH_CUDA_ARCH_LIST/...: builds read the live
    # environment, so the key must too (the compiler identity stays memoised per CXX value).
    fp = _fast_memo_get(state_dir, env)
    if fp is None:
        fp = _compute(state_dir, env)
        _fast_memo_put(state_dir, env, fp)
    _state = (snap, fp)
    return fp


# --- whole-fingerprint memo -------------------------------------------------------------------
# A fresh process's first hit spends most of its time here (find_spec, reading version.py,
# realpath, two memo files). This memo stores the finished fingerprint with the stat
# signatures of everything it was derived from, and is used only if all of them still match:
# torch's version.py and libc10, the compiler as found on PATH and its real file, and every PATH
# directory searched before it (a compiler added earlier on PATH changes that directory's mtime).


def _sig(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _fast_memo_path(state_dir: str, env: dict) -> str:
    ident = json.dumps([FORMAT_VERSION, sys.executable, sys.path, os.environ.get("PATH", ""), env],
                       separators=(",", ":"))
    return os.path.join(state_dir, "fp-" + hashlib.sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()[:32]
                        + ".json")


def _validators(fp: dict, env: dict) -> list:
    paths = []
    tdir = torch_dir()
    # The import path up to torch's directory: installing a torch earlier on it changes one of
    # these directories' mtimes.
    parent = os.path.dirname(tdir) if tdir else None
    for entry in sys.path:
        paths.append(os.path.abspath(entry or "."))
        if parent and os.path.abspath(entry or ".") == parent:
            break
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
    for tool in (fp["cxx"].get("real") or {}).values():
        if isinstance(tool, dict) and tool.get("path"):
            paths.append(tool["path"])  # the compiler behind a wrapper, its assembler and linker
    return [[p, _sig(p)] for p in paths]


def _fast_memo_get(state_dir: str | None, env: dict) -> dict | None:
    if not state_dir:
        return None
    try:
        data = _load_json(_fast_memo_path(state_dir, env))
        for path, sig in data["validators"]:
            if _sig(path) != sig:
                return None
        fp = data["fp"]
        return fp if fp.get("env") == env and fp.get("format") == FORMAT_VERSION else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _fast_memo_put(state_dir: str | None, env: dict, fp: dict) -> None:
    if not state_dir or _read_only or not os.path.isdir(state_dir):
        return
    _write_json(_fast_memo_path(state_dir, env), {"fp": fp, "validators": _validators(fp, env)})


def _compute(state_dir: str | None, env: dict) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "torch": _torch_facts(state_dir),
        "cxx": compiler_identity(env.get("CXX", "c++"), state_dir),
        "python": {
            "version": "%d.%d.%d" % sys.version_info[:3],
            "implementation": sys.implementation.cache_tag,
            "abiflags": getattr(sys, "abiflags", ""),
            "ext_suffix": importlib.machinery.EXTENSION_SUFFIXES[0],
        },
        "platform": {"system": sys.platform, "machine": os.uname().machine, "libc": _libc()},
        "env": env,
    }


def cuda_fingerprint(state_dir: str | None) -> dict[str, Any]:
    """Extra fingerprint for specs with CUDA sources: the nvcc that torch would use."""
    nvcc = os.environ.get("PYTORCH_NVCC")
    if not nvcc:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if home:
            nvcc = os.path.join(home, "bin", "nvcc")
        else:
            nvcc = which("nvcc") or "/usr/local/cuda/bin/nvcc"
    fp: dict[str, Any] = {"nvcc": compiler_identity(nvcc, state_dir)}
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # torch then compiles for the visible GPUs' architectures: two GPU models must not
        # share a binary.
        fp["visible_archs"] = visible_cuda_archs(state_dir)
    return fp


def visible_cuda_archs(state_dir: str | None) -> list[str] | None:
    """Compute capabilities (``"9.0"``) of the GPUs this process sees, as torch's
    ``_get_cuda_arch_flags`` would list them; memoised per boot, GPU set and
    ``CUDA_VISIBLE_DEVICES`` (asking the driver costs a ``cuInit``)."""
    try:
        gpus = sorted(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        gpus = []
    memo_key = f"cudaarch:{_boot_id()}:{gpus}:{os.environ.get('CUDA_VISIBLE_DEVICES')}"

    def compute() -> dict:
        return {"archs": _query_cuda_archs()}

    return _memo(state_dir, memo_key, compute).get("archs")


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


def reset_for_tests() -> None:
    """Forget the per-process fingerprint (tests change ``CXX`` within one process)."""
    global _state, _torch_dir
    with _lock:
        _state = None
        _torch_dir = None
        _compilers.clear()
        _natives.clear()
        _flag_tools.clear()
