"""Build-time side of input tracking: the flags that make compiler and linker report what they
read, and turning those reports into a :class:`~stubcache.key.tracking.Tracked` record.

Kept out of ``builder.py`` so that the two build paths only add a few flags and one call.
"""

from __future__ import annotations

import os
import sys
import shlex
import subprocess

from . import loadcheck
from ..edge import log
from ..hit.early import prefix_map_flags as prefix_map_flags  # (a start template fills in the same)
from ..hit.early import stop_session
from ..key import inputs, tracking
from ..key.flagscan import FlagScan, option_values, scan
from ..key.fingerprint import torch_dir
from ..key import StubSpec

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import Any

DEPFILE = inputs.DEPFILE
PROBE_DEPFILE = "stubcache.probe.deps"  # the search probe's prediction of DEPFILE (direct builds)
LINK_DEPFILE = inputs.LINK_DEPFILE
AS_DEPFILE = inputs.AS_DEPFILE


def compiler_command() -> list[str]:
    """``CXX`` as words (``CXX="ccache g++"`` is a wrapper and a compiler), default ``c++``."""
    words = shlex.split(os.environ.get("CXX", "c++") or "c++")
    return words or ["c++"]


# A caller's own dependency-output options (torch's build takes them; none changes the library):
# dropped from what the compiler runs with, because they narrow or move the lists tracking reads,
# whatever their place on the line. gcc and clang keep system headers out of every list once
# -MMD is given anywhere, and GNU as writes only the last --MD file named. (-M and -MM, which
# stop before compiling, are left for the compiler to fail on, as torch's build does.)
_DEP_OPTIONS = ("-MD", "-MMD", "-MP")
_DEP_OPTIONS_WITH_ARG = ("-MF", "-MT", "-MQ")
_AS_DEP_OPTION = "--MD"  # GNU as: --MD FILE


def without_dependency_output(flags: list[str] | tuple[str, ...]) -> list[str]:
    """``flags`` without their dependency-output options (see above): ``-MD``, ``-MMD``, ``-MP``,
    ``-MF``/``-MT``/``-MQ`` with their argument (joined or the next word), the same inside
    ``-Wp,`` lists, ``--MD FILE`` inside ``-Wa,`` lists, and those as ``-Xpreprocessor`` /
    ``-Xassembler`` pairs. A ``-Wp,``/``-Wa,`` list keeps its other options."""
    out: list[str] = []
    skip_x = ""  # "-Xpreprocessor"/"-Xassembler": the next such pair carries a dropped option's argument
    i = 0
    while i < len(flags):
        flag = flags[i]
        i += 1
        if flag in _DEP_OPTIONS:
            continue
        if flag in _DEP_OPTIONS_WITH_ARG:
            i += 1
            continue
        if flag.startswith(_DEP_OPTIONS_WITH_ARG):
            continue
        if flag.startswith(("-Wp,", "-Wa,")):
            kept = _without_in_list(flag[4:].split(","), preprocessor=flag[2] == "p")
            if kept:
                out.append(flag[:4] + ",".join(kept))
            continue
        if flag in ("-Xpreprocessor", "-Xassembler") and i < len(flags):
            arg = flags[i]
            i += 1
            if skip_x == flag:  # the dropped option's argument
                skip_x = ""
                continue
            kept = _without_in_list([arg], preprocessor=flag == "-Xpreprocessor")
            if not kept:
                if arg in _CC1_WITH_ARG or arg == _AS_DEP_OPTION:
                    skip_x = flag
                continue
            out += [flag, arg]
            continue
        out.append(flag)
    return out


_CC1_WITH_ARG = ("-MD", "-MMD", *_DEP_OPTIONS_WITH_ARG)  # as the compiler proper takes them (-Wp,)


def _without_in_list(words: list[str], preprocessor: bool) -> list[str]:
    # One -Wp, (cc1: -MD FILE, -MMD FILE, -MF/-MT/-MQ ARG or joined, -MP) or -Wa, (as: --MD FILE) list.
    kept: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if preprocessor:
            if word in _CC1_WITH_ARG:
                i += 1
                continue
            if word == "-MP" or word.startswith(_DEP_OPTIONS_WITH_ARG):
                continue
        elif word == _AS_DEP_OPTION:
            i += 1
            continue
        kept.append(word)
    return kept


def compile_dep_flags(compiler: dict[str, Any]) -> list[str]:
    """A full dependency list next to torch's ``-MMD`` one (``-MMD`` omits system headers).

    ``-Wp,-MD`` takes over cc1's dependency output, so ninja's own depfile is not written; the
    build directory is thrown away after one build, so ninja never needs it. ``compiler``: the
    fingerprint's record of the real compiler (:func:`compiler_facts`).
    """
    return [f"-Wp,-MD,{DEPFILE}", *assembler_dep_flags(compiler)]


def assembler_dep_flags(compiler: dict[str, Any]) -> list[str]:
    """GNU as's own dependency list (``--MD``): files read by ``.incbin``/``.include`` in inline
    assembly, which the preprocessor never sees. Only gcc with GNU as takes it (clang's
    integrated assembler rejects the flag)."""
    facts = compiler
    cc1 = (facts.get("cc1") or {}).get("path") or ""
    gas = (facts.get("as") or {}).get("version") or ""
    if os.path.basename(cc1) == "cc1plus" and "GNU assembler" in gas:
        return [f"-Wa,--MD,{AS_DEPFILE}"]
    return []


def dependency_name_flags(compiler: dict[str, Any]) -> list[str]:
    """gcc names a header found in a system directory (``-isystem``, ``CPATH``…) by its resolved
    path in the dependency list when that is shorter (``dir/inc/h.h`` for ``dir/x/../inc``, the
    link's target for a linked name), which no longer says where in the search it was found;
    ``-fno-canonical-system-headers`` keeps the name it opened. clang names them as found and
    rejects the flag."""
    cc1 = (compiler.get("cc1") or {}).get("path") or ""
    return ["-fno-canonical-system-headers"] if os.path.basename(cc1) == "cc1plus" else []


def compiler_facts() -> dict[str, Any]:
    """The fingerprint's record of the real compiler behind ``CXX``, probed now (no memo: a
    cache hands its builds its own, memoised, :meth:`~stubcache.key.fingerprint.Fingerprint.compiler_facts`)."""
    from ..key.fingerprint import Fingerprint

    return Fingerprint(None).compiler_facts()


def linker_writes_depfile(compiler: dict[str, Any]) -> bool:
    """Whether the linker the compiler driver runs accepts ``--dependency-file`` (binutils
    ≥ 2.35, lld); part of the compiler probe."""
    return bool(compiler.get("ld_depfile"))


def extra_link_flags(compiler: dict[str, Any]) -> list[str]:
    """Linker flags that make it list its inputs: ``--dependency-file``, else ``--trace``."""
    if linker_writes_depfile(compiler):
        return [f"-Wl,--dependency-file={LINK_DEPFILE}"]
    return ["-Wl,--trace"]


def trace_deps(output: str) -> list[str]:
    """Files named by ``ld --trace`` in a build's output (lines that are existing paths)."""
    out = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("(") and line.endswith(")"):  # archive members: "(lib.a)member.o"
            line = line[1:line.index(")")]
        if line.startswith("/") and os.path.isfile(line):
            out.append(line)
    return out


def read_deps(build_dir: str) -> list[str]:
    """Files named in this build's compiler and linker dependency outputs."""
    return (tracking.parse_depfile(os.path.join(build_dir, DEPFILE))
            + tracking.parse_depfile(os.path.join(build_dir, LINK_DEPFILE))
            + tracking.parse_depfile(os.path.join(build_dir, AS_DEPFILE)))


def _ninja_unescape(text: str) -> str:
    return text.replace("$ ", " ").replace("$:", ":").replace("$$", "$")


_python_include: list[str] = []


def python_include() -> str:
    """This Python's header directory (``sysconfig``'s ``posix_prefix`` include path, as torch
    passes it), looked up once per process: each lookup expands sysconfig's path templates again."""
    if not _python_include:
        import sysconfig

        _python_include.append(sysconfig.get_path("include", scheme="posix_prefix"))
    return _python_include[0]


def python_include_early() -> str:
    """:func:`python_include` if this process has looked it up, else what ``posix_prefix``'s
    template (``{installed_base}/include/python{py_version_short}{abiflags}``) makes of this
    interpreter. The first lookup initialises sysconfig's variables (~1.5 ms in an engine process),
    so the direct build starts its compiler with this and checks it against :func:`python_include`
    while the compiler runs, starting it again on a difference."""
    if _python_include:
        return _python_include[0]
    return os.path.join(os.path.normpath(sys.base_prefix), "include",
                        f"python{sys.version_info[0]}.{sys.version_info[1]}{getattr(sys, 'abiflags', '')}")


def _compile_flags(spec: StubSpec, build_dir: str) -> list[str]:
    """The flags the compile step used, read back from torch's ``build.ninja`` when there is one."""
    flags: list[str] = []
    try:
        with open(os.path.join(build_dir, "build.ninja"), encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(("cflags =", "post_cflags =")):
                    flags += shlex.split(_ninja_unescape(line.split("=", 1)[1].strip()))
    except OSError:
        flags = [f"-I{p}" for p in spec.extra_include_paths]
        tdir = torch_dir()
        if tdir:
            flags += ["-isystem", os.path.join(tdir, "include"),
                      "-isystem", os.path.join(tdir, "include", "torch", "csrc", "api", "include")]
        flags += ["-isystem", python_include(), "-std=c++20",
                  *spec.extra_cflags]
        # The direct path compiles and links in one command: ldflags' -I dirs search too.
        flags += scan(spec.extra_ldflags).search
    return [f for f in without_dependency_output(flags) if not f.startswith(("-Wp,-M", "-M"))]


def start_search_probe(spec: StubSpec, build_dir: str, compiler: dict[str, Any] | None = None
                       ) -> subprocess.Popen[bytes] | None:
    """Start asking the compiler for its include search order (``-E -v``), to run beside the
    compile; :func:`tracked_inputs` collects it. With ``compiler`` (a direct build's: the
    fingerprint's record), it also preprocesses the build's ``main.cpp`` as the compile does and
    writes the files that reads to :data:`PROBE_DEPFILE`: the headers the compile is predicted to
    list, which :func:`pretrack` tracks while the compiler still runs."""
    extra: list[str] = []
    source = None
    if compiler is not None:
        source = "main.cpp"
        # The direct command compiles and links in one: what extra_ldflags say to the
        # preprocessor (-D, -include, -fopenmp, -std=) counts, after extra_cflags, as there.
        extra = [f"-DTORCH_EXTENSION_NAME={spec.name}", "-DTORCH_API_INCLUDE_EXTENSION_H", "-fPIC",
                 *without_dependency_output(spec.extra_ldflags), *dependency_name_flags(compiler), "-M", "-MF",
                 PROBE_DEPFILE]
    try:
        return tracking.start_search_path([*compiler_command(), *_compile_flags(spec, build_dir), *extra], build_dir,
                                          source)
    except OSError:
        return None


def unit_deps(spec: StubSpec, build_dir: str, sources: list[str], compiler: dict[str, Any],
              jobs: int | None = None) -> list[str]:
    """Every file the C++ translation units of a separate-units build read, system headers
    included: what torch's ``-MMD`` lists (read back through ``ninja -t deps``) leave out once a
    header is found in a system directory (``-isystem``, ``CPATH``, ``/usr/include``). One
    ``-Wp,-MD`` file would be overwritten by each compile, so each C++ source in ``build_dir``
    is preprocessed again, after the build, with the flags of torch's ``build.ninja`` and ``-M``
    (``jobs`` at a time, default the CPU count). A unit whose list cannot be had counts as
    :data:`~stubcache.key.tracking.UNEXPRESSED`: the library is then not published. CUDA units
    keep their ``-MMD`` lists (the CUDA toolkit is pinned by nvcc's identity in the key)."""
    cmd = [*compiler_command(), *_compile_flags(spec, build_dir), *dependency_name_flags(compiler)]
    units = [(f"stubcache.unit{i}.deps", os.path.basename(src)) for i, src in enumerate(sources) if src.endswith(".cpp")]
    jobs = max(1, jobs or os.cpu_count() or 1)
    out: list[str] = []
    running: list[tuple[str, str, subprocess.Popen[bytes]]] = []
    try:
        while units or running:
            while units and len(running) < jobs:
                depfile, source = units.pop(0)
                # (the language as torch's compile had it: its .cpp name, or a -x among the flags)
                running.append((depfile, source, tracking.start_search_path([*cmd, "-M", "-MF", depfile], build_dir,
                                                                            source, language=None)))
            depfile, source, proc = running[0]
            try:
                said, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                stop_session(proc)
                said = b"(no answer in 120 s)"
            running.pop(0)  # (only now: an interrupted wait leaves it to the cleanup below)
            listed = tracking.parse_depfile(os.path.join(build_dir, depfile)) if proc.returncode == 0 else []
            if not listed:
                lines = [ln for ln in said.decode("utf-8", "replace").splitlines() if "error:" in ln]
                log.warning("stubcache: %s: the headers its unit %s read could not be listed (preprocessing it "
                            "again with -M exited %s%s); the library is used but not published", spec.name,
                            source, proc.returncode, f": {lines[0].strip()}" if lines else "")
                listed = [tracking.UNEXPRESSED]
            out += listed
    except OSError:
        out.append(tracking.UNEXPRESSED)
    finally:
        for _, _, proc in running:
            stop_session(proc)  # (its preprocessor holds the pipe)
    return out


class PreTracked:
    """A direct build's inputs as tracked while its compiler ran (:func:`pretrack`): the search
    order its probe reported, and the tracker holding the ``predicted`` headers (``None``:
    none could be tracked early)."""

    __slots__ = ("search", "tracker", "predicted")

    def __init__(self, search: tracking.SearchPath | None, tracker: tracking.Tracker | None,
                 predicted: list[str]) -> None:
        self.search = search
        self.tracker = tracker
        self.predicted = predicted


def pretrack(spec: StubSpec, build_dir: str, probe: subprocess.Popen[bytes], started_ns: int,
             compiler: dict[str, Any], remembered: dict[str, Any] | None) -> PreTracked:
    """Collect the search probe that :func:`start_search_probe` started with ``compiler`` and
    track the files its preprocessing read, settled (``__has_include`` names resolved, shadow
    candidates found), while the compiler still runs: :func:`tracked_inputs` carries on from
    there if the compile's own dependency list begins with those files, else starts afresh."""
    try:
        search = tracking.finish_search_path(probe)
    except (OSError, subprocess.SubprocessError):
        return PreTracked(None, None, [])
    path = os.path.join(build_dir, PROBE_DEPFILE)
    predicted = tracking.parse_depfile(path) if probe.returncode == 0 else []
    if not predicted or tracking.UNEXPRESSED in predicted:
        return PreTracked(search, None, [])
    tracker = _tracker(spec, build_dir, search, started_ns, compiler, remembered)
    tracker.add_deps(predicted)
    tracker.settle()
    log.debug("stubcache: %s: %d inputs tracked while the compiler runs", spec.name, len(predicted))
    return PreTracked(search, tracker, predicted)


def _tracker(spec: StubSpec, build_dir: str, search: tracking.SearchPath | None, started_ns: int,
             facts: dict[str, Any], remembered: dict[str, Any] | None) -> tracking.Tracker:
    pinned = tracking.pinned_prefixes([*(facts.get("own_dirs") or []), *(facts.get("stdlib_dirs") or [])],
                                    torch_dir(), python_include())
    if spec.effective_with_cuda:
        home = _cuda_home()
        if home:  # the CUDA toolkit is pinned by the nvcc identity in the fingerprint
            pinned += tracking.pinned_prefixes([home], None, None)
    probes = tracking.has_include_names(spec.cpp_sources + spec.cuda_sources)
    return tracking.Tracker(build_dir, pinned, search, started_ns, probes, remembered)


def tracked_inputs(spec: StubSpec, build_dir: str, deps: list[str], started_ns: int,
                   probe: subprocess.Popen[bytes] | None = None,
                   compiler: dict[str, Any] | None = None,
                   remembered: dict[str, Any] | None = None, pre: PreTracked | None = None) -> tracking.Tracked:
    """Hash what the build read (see :mod:`stubcache.key.inputs`); ``remembered``: the hash memo
    if read already (:func:`stubcache.key.tracking.hash_memo`); ``pre``: what :func:`pretrack`
    tracked while the compiler ran (its probe collected: ``probe`` is then ``None``)."""
    if not deps and not tracking.files_named_by_flags(spec.extra_cflags + spec.extra_ldflags):
        loadcheck.stop(probe)  # reaps it and closes its pipe
        return tracking.Tracked({}, {}, [])
    cmd = compiler_command()
    if pre is not None:
        search = pre.search
    else:
        try:
            if probe is None:
                probe = tracking.start_search_path([*cmd, *_compile_flags(spec, build_dir)], build_dir)
            search = tracking.finish_search_path(probe)
        except (OSError, subprocess.SubprocessError):
            search = None
    facts = compiler if compiler is not None else compiler_facts()
    ran = compiler_that_ran(search, facts, bool(spec.tool_flags))
    named = tracking.files_named_by_flags(spec.extra_cflags + spec.extra_cuda_cflags + spec.extra_ldflags)
    both = scan(spec.extra_cflags, spec.extra_ldflags)
    named += _found_in_b_dirs(both)
    startfile_dirs = _startfile_dirs(both.tool_flags, facts)
    specs_read, specs_watch = tracking.specs_files(_specs_names([*spec.extra_cflags, *spec.extra_ldflags]),
                                                   startfile_dirs)
    named += specs_read
    tracker = pre.tracker if pre is not None else None
    if tracker is not None and pre is not None and deps[:len(pre.predicted)] == pre.predicted:
        tracker.recheck()  # (what it tracked before the compiler ended: unchanged since?)
        tracker.add_deps([*deps[len(pre.predicted):], *named])
    else:
        if tracker is not None:
            log.debug("stubcache: %s: the compile read other files than predicted: tracked again", spec.name)
        tracker = _tracker(spec, build_dir, search, started_ns, facts, remembered)
        tracker.add_deps([*deps, *named])
    # The link step's -L/-l (through -Wl, too): on the direct path that is the one command.
    link = both if spec.build_method == "direct" else scan(spec.extra_ldflags)
    dep_paths = [os.path.join(build_dir, d) for d in deps]
    # What the linker scripts read hand the linker; the files they INCLUDE are found along the
    # -L list as ld found them (its dependency list names them as written) and tracked.
    scripts = tracking.script_names(dep_paths, [*link.lib_dirs, *startfile_dirs])
    tracker.add_deps(scripts.included)
    tracked = tracker.result()
    pinned = tracker.pinned
    # (-l names in the linker scripts read are looked up along the same path; their files in
    # the script's own directory first)
    libs = tracking.library_candidates(dep_paths, link.lib_dirs, [*link.lib_names, *(n for _, n in scripts.pairs)],
                                       os.environ.get("LIBRARY_PATH"))
    libs += tracking.script_dir_candidates(scripts.pairs, dep_paths) + scripts.watch
    # What the driver found along its own list (start files, the libraries it adds, specs files)
    libs += tracking.search_list_candidates(dep_paths, startfile_dirs) + specs_watch
    # (.include/.incbin names GNU as found along its own -I list)
    libs += tracking.prefix_list_candidates(dep_paths, tracking.assembler_include_dirs(
        [*spec.extra_cflags, *spec.extra_ldflags] if spec.build_method == "direct" else list(spec.extra_cflags)))
    if libs:
        tracked.record["shadows"] = tracking.file_candidates(libs, pinned, tracked.record.get("shadows") or {},
                                                          started_ns, tracked.unstable)
    if ran:
        tracked.unstable.append(ran)
    return tracked


def _startfile_dirs(tool_flags: tuple[str, ...], facts: dict[str, Any]) -> list[str]:
    """Where gcc's driver looks for start files and specs files, as far as a build can tell: the
    ``-B`` directories, then ``LIBRARY_PATH``'s and its probed ``libraries:`` list (which holds
    those with its multiarch suffixes; the bare ones first, so that they are watched either way)."""
    library_path = [d for d in os.environ.get("LIBRARY_PATH", "").split(":") if os.path.isabs(d)]
    return [*option_values(tool_flags, "-B"), *library_path, *(facts.get("library_dirs") or [])]


def _specs_names(flags: list[str]) -> list[str]:
    """The specs files ``-specs=FILE`` (``--specs=``, ``-specs FILE``) flags name, in order."""
    names = []
    for i, f in enumerate(flags):
        name, eq, value = f.partition("=")
        if name in ("-specs", "--specs"):
            if eq:
                names.append(value)
            elif i + 1 < len(flags):
                names.append(flags[i + 1])
    return names


def _found_in_b_dirs(found: FlagScan) -> list[str]:
    """Files named relatively by flags (``-specs=my.specs``) that gcc looks up in the ``-B``
    directories, where they exist now."""
    bdirs = option_values(found.tool_flags, "-B")
    return [p for f in found.files if not os.path.isabs(f) for d in bdirs if os.path.isabs(d)
            for p in [os.path.join(d, f)] if os.path.isfile(p)]


def compiler_that_ran(search: tracking.SearchPath | None, facts: dict[str, Any], own_tools: bool) -> str | None:
    """A line saying which compiler answered the build's search probe (run through the same
    ``CXX``, wrapper and environment as the build), if it is not the one the fingerprint names;
    None when they agree or the probe did not say. A mismatch means the key was computed for
    another compiler (a wrapper setting stubcache does not read): such a build is not published.
    ``own_tools``: the spec's flags choose the compiler proper (``-B``), so only the version
    line is compared."""
    if search is None:
        return None
    want_cc1 = (facts.get("cc1") or {}).get("path")
    want_version = facts.get("driver_version")
    if search.driver_version and want_version and search.driver_version != want_version:
        return f"the compiler that ran ({search.driver_version}), not the one the key names ({want_version})"
    if not own_tools and search.cc1 and want_cc1 and search.cc1 != want_cc1:
        return f"the compiler that ran ({search.cc1}), not the one the key names ({want_cc1})"
    return None


def _cuda_home() -> str | None:
    """The CUDA toolkit torch would use: ``CUDA_HOME``/``CUDA_PATH``, else nvcc's parent."""
    from ..key.toolchain import which

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return "/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else None
