"""Everything besides the spec that changes the binary: torch, compiler, Python, platform, env.

A :class:`Fingerprint` belongs to one cache (its ``state/`` directory holds the on-disk memos)
and computes each part at most once (per compiler, per environment), without importing torch:
torch's version comes from ``torch/version.py`` found with ``importlib.util.find_spec``, and the
compiler's ``--version`` output is remembered on disk keyed by the compiler's resolved path,
size and mtime, so a hit in a fresh process starts no subprocess. The module holds no state:
only constants and pure functions. This module is what a hit needs (the environment, the
whole-fingerprint memo); how each fact is probed on a miss is in :mod:`stubcache.key.toolchain`.
"""

from __future__ import annotations

import os
import sys
import threading

from ..edge import cjson
from hashlib import sha256
from ..hit import KEY_ENV_VARS as KEY_ENV_VARS, path_sig, torch_is
from .memofile import load_json, write_json

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (hit path)
if TYPE_CHECKING:
    from typing import Any, Callable, Protocol

    class ProbeHooks(Protocol):
        """What a caller of :meth:`Fingerprint.base` that may start a build during a compiler
        probe hands it (``stubcache.cache.core.Speculation``)."""

        def start(self, facts: dict[str, Any]) -> None: ...  # the facts a build command needs, early

        def hold(self, fd: int, write: Callable[[], None]) -> bool: ...  # a probe's memo lock and write

        def defer(self, write: Callable[[], None]) -> bool: ...  # the whole-fingerprint memo's write

FORMAT_VERSION = 6  # 2: real compiler, tracked inputs, needless fields nulled; 3: records without the holes of 2;
#                    4: separate_units in the spec; 5: shadow rows record what the compiler passed over;
#                    6: a caller's dependency-output flags no longer narrow the tracked headers; the
#                    libraries linker scripts name have shadow rows; gcc's linker plugin in the key;
#                    start files and the driver's libraries have shadow rows along its own list; specs
#                    files as gcc finds them and what they %include; GNU as's -I search watched

# KEY_ENV_VARS (stubcache.hit's, imported above): the environment variables that can change a
# build's output; a hit record and a start template hold their values (docs/cache.md's table).
# gcc takes the source character set from the locale; the usual UTF-8 and C locales all read
# sources the same way, so only other values split the key.
_LOCALE_VARS = ("LC_ALL", "LC_CTYPE", "LANG")


def _neutral_locale(value: str) -> bool:
    v = value.lower().replace("-", "")
    return v in ("", "c", "posix") or v.endswith((".utf8", ".utf8@euro"))

# CPython's raw bytes mapping behind os.environ: one dict lookup per variable (37 of them:
# ~2 us per call) against ~29 us through os.environ.get, whose misses raise and catch KeyError.
# Read on every get_or_build; other Pythons take the os.environ path.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS_RAW = tuple(os.environ.encodekey(k) for k in KEY_ENV_VARS) if _ENV_DATA is not None else ()


def env_snapshot() -> tuple[Any, ...]:
    """The key environment variables' raw values: a few dict lookups, cheap enough for every call."""
    if _ENV_DATA is not None:
        get = _ENV_DATA.get
        return tuple([get(k) for k in _ENV_KEYS_RAW])
    return tuple([os.environ.get(k) for k in KEY_ENV_VARS])


def env_from_snapshot(snap: tuple[Any, ...]) -> dict[str, str]:
    out = {}
    for name, raw in zip(KEY_ENV_VARS, snap):
        if raw is not None:
            value = os.environ.decodevalue(raw) if _ENV_DATA is not None else raw
            if name in _LOCALE_VARS and _neutral_locale(value):
                continue
            if name == "TORCH_CUDA_ARCH_LIST" and not value.strip():
                continue  # torch reads "" as unset ("detect"): cuda() then keys the detected archs
            out[name] = value
    return out


_DEFAULT_NVCC: dict[Any, list[str] | None] = {}


def default_nvcc_flags(directory: str | None) -> list[str] | None:
    """``COMMON_NVCC_FLAGS`` as torch's ``cpp_extension`` module (under torch's ``directory``)
    defines it, read from its source without importing torch (a literal list there); None if it
    cannot be read so. Remembered per file signature."""
    if not directory:
        return None
    from ..edge import fsroot

    path = os.path.join(directory, "utils", "cpp_extension.py")
    try:  # (links followed, as the import system follows them; never blocking on a FIFO, size-capped)
        fd = fsroot.open_regular(None, path, follow=True)
        try:
            st = os.fstat(fd)
            sig = (path, st.st_ino, st.st_size, st.st_mtime_ns)
            if sig in _DEFAULT_NVCC:
                return _DEFAULT_NVCC[sig]
            text = fsroot.read_fd(fd, 16 << 20, path).decode("utf-8", "replace")
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
    import ast

    value: Any = None
    start = text.find("\nCOMMON_NVCC_FLAGS = [")
    if start >= 0:
        end = text.find("\n]", start)
        try:
            value = ast.literal_eval(text[start + len("\nCOMMON_NVCC_FLAGS = "):end + 2])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = None
    flags = [str(f) for f in value] if isinstance(value, list) and all(type(f) is str for f in value) else None
    _DEFAULT_NVCC[sig] = flags
    return flags


def torch_dir() -> str | None:
    """The installed torch package directory, found without importing torch (looked up on each
    call; :meth:`Fingerprint.torch_dir` remembers it)."""
    mod = sys.modules.get("torch")
    if mod is not None and getattr(mod, "__file__", None):
        return os.path.dirname(mod.__file__)  # type: ignore[type-var]  # a str: checked above
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


# --- whole-fingerprint memo -------------------------------------------------------------------
# A fresh process's first hit spends most of its time here (find_spec, reading version.py,
# realpath, two memo files). This memo stores the finished fingerprint with the stat
# signatures of everything it was derived from, and is used only if all of them still match:
# torch's version.py and libc10, the compiler as found on PATH and its real file, every PATH
# directory searched before it (a compiler added earlier on PATH changes that directory's mtime),
# and the import path up to torch: its site directories, files and absent entries by mtime, its
# plain directories as shadows (unchanged, or none of the names that would hold another torch
# there; toolchain.import_path_checks), so that an engine writing into its script directory
# keeps the memo. MEMO_LAYOUT names the memo's form: a stubcache that checks no shadows never
# reads one that has them.
MEMO_LAYOUT = 4  # 4: signatures hold the ctime; 3: shadows may name hit.ANY_PTH; 2: "shadows" (plain import path directories)


def fast_memo_path(state_dir: str, env: dict[str, Any]) -> str:
    # A compiler cache's own variables (CCACHE_COMPILER, CCACHE_PREFIX, …) choose the compiler
    # it runs: a fingerprint holds only for their values.
    wrapper_env = sorted([(k, v) for k, v in os.environ.items() if k.startswith(("CCACHE_", "SCCACHE_", "BUILDCACHE_"))])
    # HOME and XDG_CONFIG_HOME name the config files a compiler cache reads (~/.ccache/ccache.conf,
    # ...; toolchain.wrapper_config_files): its `compiler =` holds only for them.
    homes = [os.environ.get("HOME"), os.environ.get("XDG_CONFIG_HOME")]
    path = [p if type(p) is str else repr(p) for p in sys.path]  # a program may append a pathlib.Path
    ident = cjson.dumps([FORMAT_VERSION, MEMO_LAYOUT, sys.executable, path, os.environ.get("PATH", ""), env, homes]
                        + ([wrapper_env] if wrapper_env else []), separators=(",", ":"))
    return os.path.join(state_dir, "fp-" + sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()[:32]
                        + ".json")


def _fast_memo_get(state_dir: str | None, env: dict[str, Any]) -> dict[str, Any] | None:
    if not state_dir:
        return None
    try:
        data = load_json(fast_memo_path(state_dir, env))
        for path, sig in data["validators"]:
            if path_sig(path) != sig:
                return None
        if data["shadows"]:
            from .inputs import still_valid

            if not still_valid({}, {"shadows": data["shadows"]}):  # as an entry's shadowing headers
                return None
        if not torch_is(data["torch_dir"]):
            return None
        fp = data["fp"]
        return fp if fp.get("env") == env and fp.get("format") == FORMAT_VERSION else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class Fingerprint:
    """The toolchain fingerprint of one cache: torch, C++ compiler, Python, platform, the key
    environment variables and the format, plus the parts only some specs need (CUDA, ``-march=native``
    targets, the tools that ``-fuse-ld=``/``-B`` select).

    Each part is computed once per compiler and environment and kept here; the slow facts (a
    compiler probe, libc10's ABI, the whole fingerprint) are also memoised on disk in
    ``state_dir`` (the cache root's ``state/``), so a fresh process's first hit reads one small
    file. With ``read_only`` nothing is written there (``prune --dry-run``). A
    :class:`~stubcache.StubCache` owns one; thread-safe.
    """

    def __init__(self, state_dir: str | None, *, read_only: bool = False) -> None:
        self.state_dir = state_dir
        self.read_only = read_only
        self._lock = threading.Lock()
        # (environment snapshot, fingerprint computed from exactly that snapshot), replaced as
        # one object so a thread can never pair a new environment with an old fingerprint.
        self._current: tuple[Any, dict[str, Any]] | None = None
        self._compilers: dict[str, dict[str, Any]] = {}
        # command -> the compiler probe's own validators (its tools, where the driver looked for
        # them): the whole-fingerprint memo holds only while they do.
        self._identity_validators: dict[str, list[Any]] = {}
        self._natives: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._flag_tools: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._torch_dir: str | None = None
        self._local = threading.local()  # .hooks: this thread's ProbeHooks while base() computes

    def __repr__(self) -> str:
        return f"Fingerprint({self.state_dir!r}{', read_only=True' if self.read_only else ''})"

    def _once(self, table: dict[Any, dict[str, Any]], key: Any, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``table[key]``, computed by ``compute`` the first time (outside the lock: a probe runs
        subprocesses; two threads may both compute, and both get the same answer)."""
        with self._lock:
            cached = table.get(key)
        if cached is not None:
            return cached
        value = compute()
        with self._lock:
            return table.setdefault(key, value)

    def _memo(self, memo_key: str, compute: Callable[[], dict[str, Any]], valid: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        from .toolchain import memo

        hooks = getattr(self._local, "hooks", None)
        return memo(self.state_dir, memo_key, compute, valid, self.read_only, hooks.hold if hooks else None)

    def base(self, probing: Callable[[], ProbeHooks | None] | None = None) -> dict[str, Any]:
        """The fingerprint every key includes (torch, C++ compiler, Python, platform, env, format).
        Costs one environment snapshot when nothing changed; if ``CXX``, ``TORCH_CUDA_ARCH_LIST``
        or another key variable changed since, it is recomputed: builds read the live
        environment, so the key must too.

        ``probing`` is asked, only when the fingerprint must be computed, for the hooks of a
        caller that may start its build while the compiler is probed: ``start`` is handed the
        facts a build command needs as soon as the probe knows them
        (:func:`stubcache.key.toolchain._probe_answers`; not called when the answers come from a
        memo), ``hold`` each toolchain memo lock this thread takes with the write of its answer
        (:func:`stubcache.key.toolchain.memo`), ``defer`` the write of the whole-fingerprint memo:
        what they take is written when the caller lets go."""
        snap = env_snapshot()
        current = self._current
        if current is not None and current[0] == snap:
            return current[1]
        env = env_from_snapshot(snap)  # the values of this snapshot, not a later re-read
        fp = _fast_memo_get(self.state_dir, env)
        if fp is None:
            self._local.hooks = probing() if probing is not None else None
            try:
                fp = self._compute(env)
            finally:
                self._local.hooks = None
        self._current = (snap, fp)
        return fp

    def _compute(self, env: dict[str, Any]) -> dict[str, Any]:
        # The whole fingerprint, probed (or from the probes' memos), and its memo written.
        from . import toolchain

        fp = {
            "format": FORMAT_VERSION,
            "torch": toolchain.torch_facts(self.torch_dir(), self._memo),
            "cxx": self.compiler_identity(env.get("CXX", "c++")),
            "python": toolchain.python_facts(),
            "platform": {"system": sys.platform, "machine": os.uname().machine, "libc": toolchain.libc()},
            "env": env,
        }
        if self.state_dir and not self.read_only and os.path.isdir(self.state_dir):
            held = self._identity_validators.get(env.get("CXX", "c++"), [])
            path = fast_memo_path(self.state_dir, env)
            record = {"fp": fp, "torch_dir": self.torch_dir(), **toolchain.memo_checks(fp, env, self.torch_dir(), held)}
            hooks = self._local.hooks
            if hooks is None or not hooks.defer(lambda: write_json(path, record)):
                write_json(path, record)
        return fp

    def torch_dir(self) -> str | None:
        """The installed torch package directory (see :func:`torch_dir`), remembered once found."""
        if self._torch_dir is None:
            self._torch_dir = torch_dir()
        return self._torch_dir

    def compiler_identity(self, command: str) -> dict[str, Any]:
        """Who compiles when ``command`` (``CXX``) runs, memoised here and on disk.

        ``path``/``version``: the command as found on ``PATH`` (resolved) and its ``--version``.
        ``real``: the compiler proper and the assembler and linker that the driver runs, found by
        asking the driver itself (``-###``, ``-print-prog-name``) through any wrapper: a ccache or
        sccache masquerade directory, ``CXX="ccache g++"``, or a script. Each is named by resolved
        path, version line and SHA-256, so switching the compiler behind a wrapper changes the key.
        """
        from . import toolchain

        def compute() -> dict[str, Any]:
            held: list[Any] = []

            def memo(memo_key: str, answer: Callable[[], dict[str, Any]],
                     valid: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
                value = self._memo(memo_key, answer, valid)
                if isinstance(value.get("validators"), list):
                    held.extend(value["validators"])
                return value

            hooks = getattr(self._local, "hooks", None)
            ident = toolchain.compiler_identity(command, memo, hooks.start if hooks else None)
            with self._lock:
                self._identity_validators[command] = held
            return ident

        return self._once(self._compilers, command, compute)

    def compiler_facts(self) -> dict[str, Any]:
        """The probed record of the real compiler behind ``CXX`` (``cc1``, ``as``, ``ld``, its own
        and standard-library directories): what a build needs to list its inputs."""
        return (self.base().get("cxx") or {}).get("real") or {}

    def cuda(self) -> dict[str, Any]:
        """Extra fingerprint for specs with CUDA sources: the nvcc that torch would use, and the
        visible GPUs' architectures when ``TORCH_CUDA_ARCH_LIST`` is unset (torch then compiles
        for those: two GPU models must not share a binary)."""
        from .toolchain import nvcc_command, visible_cuda_archs

        fp: dict[str, Any] = {"nvcc": self.compiler_identity(nvcc_command())}
        # torch reads this list at build time and callers edit it in place: the key holds what
        # the build will use, the live list where the module is loaded, else the one it starts
        # with (the same key whether or not the caller imported it first).
        cpp_ext = sys.modules.get("torch.utils.cpp_extension")
        if cpp_ext is not None:
            fp["common_nvcc_flags"] = [str(f) for f in getattr(cpp_ext, "COMMON_NVCC_FLAGS", ())]
        else:
            fp["common_nvcc_flags"] = default_nvcc_flags(self.torch_dir())
        if not os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
            fp["visible_archs"] = visible_cuda_archs(self._memo)
        return fp

    def native_target(self, flags: tuple[Any, ...]) -> dict[str, Any]:
        """What ``-march=native``/``-mtune=native``/``-mcpu=native`` mean on this CPU: the
        compiler's resolved target options (``-Q --help=target``), memoised per compiler, flags
        and boot."""
        from . import toolchain

        native = tuple(f for f in flags if f.endswith("=native"))
        cxx = os.environ.get("CXX", "c++")
        return self._once(self._natives, (cxx, native), lambda: toolchain.native_target(
            cxx, native, self.compiler_identity(cxx), self._memo))

    def flag_tools(self, flags: tuple[Any, ...]) -> dict[str, Any]:
        """The compiler proper, assembler and linker that the driver runs with ``flags``
        (``-fuse-ld=gold``, ``-B DIR``), each by resolved path, SHA-256 and version: the probed
        default ones in the base fingerprint are not the ones such a build uses. Memoised per
        compiler, flags and ``PATH``; re-probed when a found program's file changes."""
        from . import toolchain

        cxx = os.environ.get("CXX", "c++")
        return self._once(self._flag_tools, (cxx, flags), lambda: toolchain.flag_tools(
            cxx, flags, self.compiler_identity(cxx), self._memo))
