"""Builds one spec in its own private staging directory.

Two paths, recorded in the key and the manifest:

* ``load_inline``: torch's own ``load_inline`` with ``build_directory`` = the private staging
  directory (so no two builds ever share ``main.cpp``) and ``is_python_module=False`` (torch
  builds the same binary either way; we import the published copy ourselves).
* ``direct``: for a plain C/C++ library that needs neither torch headers nor a Python module
  nor CUDA, one compiler invocation with the flags torch would use. It does not import torch.

Both link with ``-Wl,--as-needed`` so a stub that does not use torch does not need libtorch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from ..edge import fsroot, log, progress
from . import buildinputs, loadcheck, prefetch
from ..edge.errors import BuildError
from ..hit.early import DIR_SLOT, NAME_SLOT, stop_session
from ..key.fingerprint import torch_dir
from ..key import tracking
from ..key import FIELDS, PASS, StubSpec

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any, Callable, Iterable


AS_NEEDED = "-Wl,--as-needed"
_torch_lock = threading.Lock()
_warned_no_implicit = False


class BuildResult:
    """What a build produced, before publish."""

    __slots__ = ("library", "module_name", "headers", "method", "seconds", "log", "inputs", "unstable")

    def __init__(self, library: str, module_name: str, headers: dict[str, Any], method: str, seconds: float, log: str,
                 inputs: dict[str, Any] | None = None, unstable: list[Any] | None = None):
        self.library = library
        self.module_name = module_name
        self.headers = headers  # every tracked input file (headers and linker inputs): {path: sha256}
        self.method = method
        self.seconds = seconds
        self.log = log
        self.inputs = inputs  # the manifest's ``inputs`` record (signatures, shadow candidates)
        self.unstable = unstable or []  # tracked files written while the build ran


def build(spec: StubSpec, build_dir: str, compiler: dict[str, Any] | None = None,
          meanwhile: Callable[[], None] | None = None, started: Started | None = None) -> BuildResult:
    """Build ``spec`` inside ``build_dir`` (which must be private to this build). ``compiler``:
    the fingerprint's record of the real compiler (a cache passes its own; probed if omitted).
    ``meanwhile``: the caller's work that need not delay the compiler (it must not raise), run
    while the compiler runs on the direct path, before the build on the others. ``started``: a
    compile :func:`start_direct` began in ``build_dir`` before the key was known; it is this
    build if its command is the one this build runs, else stopped. Either way this build owns it."""
    if compiler is None:
        compiler = buildinputs.compiler_facts()
    # An input that changed after this is taken for one that changed during the build: an
    # earlier compile's start counts from when it began (and so does the build's time).
    started_ns = time.time_ns() if started is None else started.started_ns
    t0 = time.perf_counter() - (time.time_ns() - started_ns) / 1e9
    probe = memo = pre = None
    if spec.build_method == "direct":
        library, out, deps, probe, memo, pre = _build_direct(spec, build_dir, compiler, meanwhile, started, started_ns)
    else:
        if started is not None:
            started.stop()
        log.debug("stubcache: %s: compiling (%s build)", spec.name, spec.build_method)
        if meanwhile is not None:
            meanwhile()
        if spec.separate_units and len(spec.cpp_sources) + len(spec.cuda_sources) > 1:
            library, out, deps = _build_units(spec, build_dir, compiler)
        else:
            library, out, deps = _build_load_inline(spec, build_dir, compiler)
    t1 = time.perf_counter()
    log.debug("stubcache: %s: compiled in %.1f ms", spec.name, (t1 - t0) * 1e3)
    # The load check's loader runs in its child while the inputs are tracked here.
    check = loadcheck.start_check(library)
    try:
        tracked = buildinputs.tracked_inputs(spec, build_dir, deps, started_ns, probe, compiler, memo, pre)
    except BaseException:
        loadcheck.stop(check.proc)
        loadcheck.stop(probe)  # not read yet if tracking stopped first
        raise
    loadcheck.finish_check(check, spec.name)  # links but cannot load: a failed build, not an entry
    log.debug("stubcache: %s: inputs tracked and load checked in %.1f ms", spec.name, (time.perf_counter() - t1) * 1e3)
    module_name = os.path.basename(library).split(".", 1)[0]
    return BuildResult(library, module_name, tracked.files, spec.build_method, time.perf_counter() - t0, out,
                       tracked.record, tracked.unstable)


# --- the direct path ------------------------------------------------------------------------


def direct_command(spec: StubSpec, source: str, output: str, depfile: str,
                   build_dir: str | None = None, compiler: dict[str, Any] | None = None,
                   python_include: str | None = None) -> list[str]:
    """The single compiler invocation equivalent to torch's compile + link steps (pure, given
    ``compiler``, the fingerprint's record of the real compiler; probed if omitted).
    With ``build_dir``, that directory is mapped to ``.`` in everything the library records.
    ``python_include``: Python's header directory (default: :func:`buildinputs.python_include`)."""
    if compiler is None:
        compiler = buildinputs.compiler_facts()
    prefix_map = buildinputs.prefix_map_flags(build_dir) if build_dir else []
    cmd = [*buildinputs.compiler_command(), *prefix_map, f"-DTORCH_EXTENSION_NAME={spec.name}",
           "-DTORCH_API_INCLUDE_EXTENSION_H"]
    cmd += [f"-I{p}" for p in spec.extra_include_paths]
    system = []
    tdir = torch_dir()
    if tdir:
        system += [os.path.join(tdir, "include"), os.path.join(tdir, "include", "torch", "csrc", "api", "include")]
    system.append(python_include or buildinputs.python_include())
    for d in system:
        # gcc fails on an include dir it cannot search; a stub that mentions no torch/Python
        # header does not need these, so leave out what this user cannot read.
        if d and os.access(d, os.R_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            cmd += ["-isystem", d]
    # The caller's dependency-output options are dropped (buildinputs.without_dependency_output),
    # and the build's own come after the caller's flags, where the last one given wins (a
    # caller's -fcanonical-system-headers).
    cmd += ["-fPIC", "-std=c++20", *buildinputs.without_dependency_output(spec.extra_cflags), source, "-shared",
            AS_NEEDED, *buildinputs.without_dependency_output(spec.extra_ldflags),
            "-MD", "-MF", depfile, *buildinputs.dependency_name_flags(compiler), *buildinputs.assembler_dep_flags(compiler),
            "-o", output]
    return cmd + buildinputs.extra_link_flags(compiler)


def start_template(compiler: dict[str, Any]) -> list[str]:
    """The direct command of a stub with no flags, its name and build directory left as the
    slots of :mod:`stubcache.hit.early` (a start template's command: pure, given ``compiler``)."""
    # (DIR_SLOT is no path, so its real path is itself: its prefix map is the one PREFIX_SLOT word)
    return _command_in(StubSpec(NAME_SLOT, "", no_implicit_headers=True), DIR_SLOT, compiler,
                       buildinputs.python_include_early())


class Started:
    """A direct compile begun by :func:`start_direct` before its build was decided on: ``cmd``
    run in ``build_dir`` (in its own session: :meth:`stop` ends the driver and every program it
    started) since ``started_ns``; ``staging``: the caller's directory around ``build_dir``;
    ``origin``: when it began, as the build's log line says (also the compact path's, begun
    before the lookup: :mod:`stubcache.hit.early`)."""

    __slots__ = ("proc", "cmd", "build_dir", "started_ns", "staging", "origin")

    def __init__(self, proc: subprocess.Popen[bytes], cmd: list[str], build_dir: str, started_ns: int,
                 staging: str | None = None, origin: str = "started while the toolchain was probed") -> None:
        self.proc = proc
        self.cmd = cmd
        self.build_dir = build_dir
        self.started_ns = started_ns
        self.staging = staging
        self.origin = origin

    def stop(self) -> None:
        """Kill the compile (the driver's whole session, so no cc1plus, as or ld it started keeps
        writing in ``build_dir``) and reap it."""
        stop_session(self.proc)


def start_direct(spec: StubSpec, build_dir: str, compiler: dict[str, Any]) -> Started:
    """Begin ``spec``'s direct compile in ``build_dir`` with ``compiler``'s command facts (a
    probe's early answers: see ``probing`` in :meth:`stubcache.key.fingerprint.Fingerprint.base`)
    before the key is known; :func:`build` later takes it over or stops it."""
    started_ns = time.time_ns()
    cmd = _direct_setup(spec, build_dir, compiler, buildinputs.python_include_early())
    return Started(_spawn_compiler(spec, cmd, build_dir, own_session=True), cmd, build_dir, started_ns)


def _direct_setup(spec: StubSpec, build_dir: str, compiler: dict[str, Any], python_include: str) -> list[str]:
    # main.cpp written in build_dir, and the command that compiles and links it there.
    source = os.path.join(build_dir, "main.cpp")
    with open(source, "w", encoding="utf-8", errors="surrogateescape") as fh:
        fh.write("\n".join(spec.cpp_sources))  # surrogates: the undecodable bytes of a load()ed file
    return _command_in(spec, build_dir, compiler, python_include)


def _command_in(spec: StubSpec, build_dir: str, compiler: dict[str, Any], python_include: str | None = None) -> list[str]:
    # The direct command run in build_dir. Relative names (the compiler runs there) and the prefix
    # map keep the random staging path out of the library, so two builds of one key give
    # identical bytes.
    return direct_command(spec, "main.cpp", f"{spec.name}.so", buildinputs.DEPFILE, build_dir, compiler, python_include)


def _build_direct(spec: StubSpec, build_dir: str, compiler: dict[str, Any], meanwhile: Callable[[], None] | None = None,
                  started: Started | None = None, started_ns: int | None = None
                  ) -> tuple[str, str, list[str], subprocess.Popen[bytes] | None, dict[str, Any] | None,
                             buildinputs.PreTracked | None]:
    """The one compiler call (or ``started``'s, see :func:`build`); also the include search probe,
    this user's hash memo and the headers the compile is predicted to read, started, read and
    tracked while the compiler runs (:func:`stubcache.build.buildinputs.tracked_inputs` takes
    them: the probe, or what :func:`~stubcache.build.buildinputs.pretrack` made of it)."""
    output = os.path.join(build_dir, f"{spec.name}.so")
    early = buildinputs.python_include_early()
    if started is not None and started.build_dir == build_dir and started.cmd == _command_in(spec, build_dir, compiler, early):
        cmd, proc, stop = started.cmd, started.proc, started.stop
        log.debug("stubcache: %s: compiling (direct build, %s)", spec.name, started.origin)
    else:
        if started is not None:
            started.stop()
            if started.build_dir == build_dir:  # its outputs (library, dependency lists) are not this build's
                _empty(build_dir)
        log.debug("stubcache: %s: compiling (direct build)", spec.name)
        cmd = _direct_setup(spec, build_dir, compiler, early)
        proc = _spawn_compiler(spec, cmd, build_dir)
        stop = None
    probe = head_start = pre = None
    # A compile still running gains from a prediction of its headers (an early one may be done).
    predicting = proc.poll() is None
    try:
        # Off the compile's path: the compiler is already at work (this process only waits for it).
        probe = buildinputs.start_search_probe(spec, build_dir, compiler if predicting else None)  # (python_include())
        if buildinputs.python_include() != early:
            # The template guessed wrong: build again with sysconfig's answer once this compile
            # has ended (a killed driver would leave its cc1plus, as or ld writing here).
            proc.communicate()
            cmd = _command_in(spec, build_dir, compiler)
            proc, stop = _spawn_compiler(spec, cmd, build_dir), None
        memo = tracking.hash_memo()
        if proc.poll() is None:  # (an early compile may be done already: then no head start)
            head_start = prefetch.LinkPrefetch.start(spec, build_dir, memo)  # a fresh host's link inputs
        if meanwhile is not None:
            meanwhile()
        if probe is not None and predicting and started_ns is not None:
            try:
                pre = buildinputs.pretrack(spec, build_dir, probe, started_ns, compiler, memo)
            except Exception as exc:  # noqa: BLE001 - only a head start: the inputs are tracked after the compile
                log.debug("stubcache: %s: no early tracking: %r", spec.name, exc)
                stop_session(probe)
            probe = None
        stdout, _ = proc.communicate()
        if head_start is not None:
            head_start.finish(memo)
            head_start = None
        out = (stdout or b"").decode("utf-8", "replace")
        text = _command_line(cmd) + out
        if proc.returncode != 0 or not os.path.isfile(output):
            raise BuildError(f"Error building extension '{spec.name}'", output=text, name=spec.name)
        deps = buildinputs.read_deps(build_dir)
        if "-Wl,--trace" in cmd:
            deps += buildinputs.trace_deps(out)
    except BaseException:
        if stop is not None:
            stop()
        loadcheck.stop(proc)
        if probe is not None and predicting:
            stop_session(probe)  # (its preprocessor, which holds the pipe, too)
        else:
            loadcheck.stop(probe)  # reaps it and closes its pipe (a leaked pipe per failed build)
        if head_start is not None:
            head_start.stop()
        raise
    return output, text, deps, probe, memo, pre


def _empty(directory: str) -> None:
    # Remove everything in ``directory`` (a build's private directory), never following a link.
    for name in os.listdir(directory):
        fsroot.rmtree(os.path.join(directory, name))


def _spawn_compiler(spec: StubSpec, cmd: list[str], build_dir: str, own_session: bool = False
                    ) -> subprocess.Popen[bytes]:
    env = dict(os.environ, TMPDIR=build_dir)  # the compiler's temporary object: not under /tmp
    verbose = progress.verbose()
    if verbose:  # as torch's verbose build: the command and the compiler's output, live, on fd 1
        progress.echo(_command_line(cmd))
    try:
        # An argument list, never a shell: no flag is ever interpreted by one.
        return subprocess.Popen(cmd, cwd=build_dir, stdout=1 if verbose else subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=own_session)
    except OSError as exc:
        raise BuildError(f"Error building extension '{spec.name}': cannot run the compiler {cmd[0]!r}: "
                         f"{exc}; set CXX or install a C++ compiler", name=spec.name) from None


def _command_line(cmd: list[str]) -> str:
    import shlex

    return "$ " + shlex.join(cmd) + "\n"


# --- the load_inline path -------------------------------------------------------------------


def ninja_safe_flags(flags: Iterable[str], field: str) -> list[str]:
    """Flags as torch must write them into ``build.ninja``, whose commands run through
    ``/bin/sh``: each flag one shell word (quoted when it holds anything but plain characters,
    so the shell hands the compiler exactly the flag), ``$`` escaped for ninja. torch itself
    writes ``extra_cflags``/``extra_ldflags`` unquoted (``"; cmd"`` would run ``cmd``)."""
    import shlex

    out = []
    for flag in flags:
        if "\n" in flag or "\r" in flag:
            raise ValueError(f"{field} contains a line break ({flag!r}); no build file can hold it")
        out.append(shlex.quote(flag).replace("$", "$$"))
    return out


def _inline_sources(sources: Iterable[str], build_dir: str, stem: str) -> list[str]:
    """torch writes sources as strict UTF-8 text; a source holding undecodable bytes (surrogate
    escapes from ``load()`` of a non-UTF-8 file) is written byte for byte beside it and included."""
    out = []
    for i, src in enumerate(sources):
        try:
            src.encode("utf-8")
        except UnicodeEncodeError:
            fname = f"{stem}{i}.inc"
            with open(os.path.join(build_dir, fname), "wb") as fh:
                fh.write(src.encode("utf-8", "surrogateescape"))
            src = f'#include "{fname}"'
        out.append(src)
    return out


def load_inline_kwargs(spec: StubSpec, build_dir: str, verbose: bool = False, compiler: dict[str, Any] | None = None) -> dict[str, Any]:
    """The arguments torch's ``load_inline`` gets for ``spec``, all but ``no_implicit_headers``
    (which depends on the installed torch): each field that ``spec.FIELDS`` marks ``PASS`` as its
    JSON value, the ``REWRITE`` ones as set here. Writes a source holding undecodable bytes
    into ``build_dir`` (see :func:`_inline_sources`). ``compiler``: the fingerprint's record of
    the real compiler (probed if omitted)."""
    if compiler is None:
        compiler = buildinputs.compiler_facts()
    data = spec.to_dict()
    kwargs = {f.name: data[f.name] for f in FIELDS if f.torch == PASS}
    includes = [f"-I{p}" for p in spec.extra_include_paths]
    kwargs.update(
        cpp_sources=_inline_sources(spec.cpp_sources, build_dir, "cpp_source"),
        cuda_sources=_inline_sources(spec.cuda_sources, build_dir, "cuda_source") or None,
        # Every flag shell-quoted for build.ninja (see ninja_safe_flags). Include paths go in as
        # -I flags: torch shell-quotes extra_include_paths but does not escape `$` (or refuse line
        # breaks) for ninja. -I dirs are searched before torch's -isystem ones wherever they
        # appear, as torch's own -I would be.
        # (the dependency lists' flags after the caller's: see direct_command)
        extra_cflags=ninja_safe_flags([*buildinputs.prefix_map_flags(build_dir), *includes,
                                       *buildinputs.without_dependency_output(spec.extra_cflags),
                                       *buildinputs.compile_dep_flags(compiler)], "extra_cflags"),
        extra_cuda_cflags=ninja_safe_flags([*includes, *spec.extra_cuda_cflags], "extra_cuda_cflags"),
        extra_ldflags=[AS_NEEDED, *ninja_safe_flags([*buildinputs.without_dependency_output(spec.extra_ldflags),
                                                     *buildinputs.extra_link_flags(compiler)],
                                                    "extra_ldflags")],
        extra_include_paths=[],
        build_directory=build_dir,
        verbose=verbose,
        is_python_module=False,  # torch builds the same binary either way; the drop-in imports it
    )
    return kwargs


def load_kwargs(spec: StubSpec, build_dir: str, verbose: bool = False, compiler: dict[str, Any] | None = None) -> dict[str, Any]:
    """The arguments torch's ``load`` gets for a spec of separate translation units: each source
    written to its own file in ``build_dir`` (``src<i>.cpp``/``.cu``, bytes as given), flags as
    for :func:`load_inline_kwargs`. torch's ``build.ninja`` then has one compile per file, with
    the same flags, and one link, as for the caller's own files.

    The full dependency list (``-Wp,-MD``) is left out here: one file name for every compile
    would be overwritten by each. torch's ``-MMD`` lists, read back through ``ninja -t deps``,
    name the files each object read outside the system directories, and each C++ unit is
    preprocessed again after the build for the rest (:func:`~stubcache.build.buildinputs.unit_deps`)."""
    kwargs = load_inline_kwargs(spec, build_dir, verbose, compiler)
    full_deps = set(ninja_safe_flags(buildinputs.compile_dep_flags(compiler or buildinputs.compiler_facts()), ""))
    sources: list[str] = []
    for ext, texts in ((".cpp", spec.cpp_sources), (".cu", spec.cuda_sources)):
        for text in texts:
            path = os.path.join(build_dir, f"src{len(sources)}{ext}")
            with open(path, "wb") as fh:
                fh.write(text.encode("utf-8", "surrogateescape"))
            sources.append(path)
    return dict(
        name=spec.name, sources=sources,
        extra_cflags=[f for f in kwargs["extra_cflags"] if f not in full_deps],
        extra_cuda_cflags=kwargs["extra_cuda_cflags"], extra_ldflags=kwargs["extra_ldflags"],
        extra_include_paths=[], build_directory=build_dir, verbose=verbose, with_cuda=spec.with_cuda,
        is_python_module=False,
    )


def _build_units(spec: StubSpec, build_dir: str, compiler: dict[str, Any]) -> tuple[str, str, list[str]]:
    kwargs = load_kwargs(spec, build_dir, progress.verbose(), compiler)
    library, out, deps = _run_torch("load", spec, build_dir, kwargs)
    return library, out, deps + buildinputs.unit_deps(spec, build_dir, kwargs["sources"], compiler)


def _build_load_inline(spec: StubSpec, build_dir: str, compiler: dict[str, Any]) -> tuple[str, str, list[str]]:
    global _warned_no_implicit
    import inspect

    from .torchjit import torch_original

    try:
        load_inline = torch_original("load_inline")  # never the module attribute: it may be patched
    except ImportError as exc:
        raise BuildError(f"Error building extension '{spec.name}': it needs torch ({exc})", name=spec.name) from None
    kwargs = load_inline_kwargs(spec, build_dir, progress.verbose(), compiler)
    if spec.skips_implicit_headers:
        if "no_implicit_headers" in inspect.signature(load_inline).parameters:
            kwargs["no_implicit_headers"] = True
        elif not _warned_no_implicit:
            _warned_no_implicit = True
            log.warning("this torch has no load_inline(no_implicit_headers=); "
                         "stubs are built with torch's implicit headers (slow). Upgrade to torch>=2.8.")
    return _run_torch("load_inline", spec, build_dir, kwargs)


def _run_torch(which: str, spec: StubSpec, build_dir: str, kwargs: dict[str, Any]) -> tuple[str, str, list[str]]:
    """Run torch's own ``load_inline`` or ``load`` with ``kwargs``; torch's failure as a BuildError."""
    import glob

    from .torchjit import torch_original

    try:
        torch_fn = torch_original(which)  # never the module attribute: it may be patched
    except ImportError as exc:
        raise BuildError(f"Error building extension '{spec.name}': it needs torch ({exc})", name=spec.name) from None
    prefix = f"Error building extension '{spec.name}'"
    with _torch_lock:
        live = sys.modules.get("torch.utils.cpp_extension")
        if live is not None and torch_fn.__globals__ is not vars(live):
            # torch's function from a private copy of its module (torchjit._fresh_module): the
            # caller's in-place edits of COMMON_NVCC_FLAGS are on the real module's list
            torch_fn.__globals__["COMMON_NVCC_FLAGS"] = list(getattr(live, "COMMON_NVCC_FLAGS", []))
        # torch renames a second build of one name in a process to <name>_v1 (its in-memory
        # versioner); the drop-ins version names themselves, so keep torch's stable here.
        versioner = torch_fn.__globals__.get("JIT_EXTENSION_VERSIONER")
        entries = getattr(versioner, "entries", None)
        if isinstance(entries, dict):
            entries.pop(spec.name, None)
        try:
            torch_fn(**kwargs)
        except OSError:
            raise  # torch's own for a missing CUDA_HOME (or ninja, or a compiler it cannot run)
        except Exception as exc:  # torch raises RuntimeError with ninja's output, or others
            text = str(exc)
            if text.startswith(prefix):
                text = text[len(prefix):].lstrip(":").lstrip(" ")
                raise BuildError(prefix, output=text, name=spec.name) from None
            raise BuildError(f"{prefix}: {text}", name=spec.name) from None
    libs = [p for p in glob.glob(os.path.join(build_dir, "*.so"))]
    if len(libs) != 1:
        raise BuildError(f"{prefix}: torch built {len(libs)} libraries, expected 1", name=spec.name)
    deps = _ninja_deps(build_dir) + buildinputs.read_deps(build_dir)
    try:
        with open(os.path.join(build_dir, "build.ninja"), encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    return libs[0], text, deps


def _ninja_deps(build_dir: str) -> list[str]:
    import shutil

    ninja = shutil.which("ninja")
    if not ninja:
        return []
    proc = subprocess.run([ninja, "-C", build_dir, "-t", "deps"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, check=False)
    return [ln.strip() for ln in proc.stdout.decode("utf-8", "surrogateescape").splitlines()
            if ln.startswith((" ", "\t")) and ln.strip()]
