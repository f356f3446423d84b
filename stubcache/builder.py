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
import threading
import time

from . import _log, buildinputs
from .errors import BuildError
from .fingerprint import torch_dir
from .spec import StubSpec


AS_NEEDED = "-Wl,--as-needed"
_torch_lock = threading.Lock()
_warned_no_implicit = False


class BuildResult:
    """What a build produced, before publish."""

    __slots__ = ("library", "module_name", "headers", "method", "seconds", "log", "inputs", "unstable")

    def __init__(self, library: str, module_name: str, headers: dict, method: str, seconds: float, log: str,
                 inputs: dict | None = None, unstable: list | None = None):
        self.library = library
        self.module_name = module_name
        self.headers = headers  # every tracked input file (headers and linker inputs): {path: sha256}
        self.method = method
        self.seconds = seconds
        self.log = log
        self.inputs = inputs  # the manifest's ``inputs`` record (signatures, shadow candidates)
        self.unstable = unstable or []  # tracked files written while the build ran


def build(spec: StubSpec, build_dir: str) -> BuildResult:
    """Build ``spec`` inside ``build_dir`` (which must be private to this build)."""
    t0 = time.perf_counter()
    started_ns = time.time_ns()
    probe = None
    try:
        if spec.build_method == "direct":
            probe = buildinputs.start_search_probe(spec, build_dir)  # runs beside the compile
            library, out, deps = _build_direct(spec, build_dir)
        else:
            library, out, deps = _build_load_inline(spec, build_dir)
    except BaseException:
        if probe is not None:
            probe.kill()
            probe.wait()
        raise
    tracked = buildinputs.tracked_inputs(spec, build_dir, deps, started_ns, probe)
    module_name = os.path.basename(library).split(".", 1)[0]
    return BuildResult(library, module_name, tracked.files, spec.build_method, time.perf_counter() - t0, out,
                       tracked.record, tracked.unstable)


# --- the direct path ------------------------------------------------------------------------


def direct_command(spec: StubSpec, source: str, output: str, depfile: str,
                   build_dir: str | None = None) -> list[str]:
    """The single compiler invocation equivalent to torch's compile + link steps (pure).
    With ``build_dir``, that directory is mapped to ``.`` in everything the library records."""
    import sysconfig

    prefix_map = buildinputs.prefix_map_flags(build_dir) if build_dir else []
    cmd = [*buildinputs.compiler_command(), *prefix_map, "-MD", "-MF", depfile, *buildinputs.assembler_dep_flags(),
           f"-DTORCH_EXTENSION_NAME={spec.name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    cmd += [f"-I{p}" for p in spec.extra_include_paths]
    system = []
    tdir = torch_dir()
    if tdir:
        system += [os.path.join(tdir, "include"), os.path.join(tdir, "include", "torch", "csrc", "api", "include")]
    system.append(sysconfig.get_path("include", scheme="posix_prefix"))
    for d in system:
        # gcc fails on an include dir it cannot search; a stub that mentions no torch/Python
        # header does not need these, so leave out what this user cannot read.
        if d and os.access(d, os.R_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
            cmd += ["-isystem", d]
    cmd += ["-fPIC", "-std=c++20", *spec.extra_cflags, source, "-shared", AS_NEEDED,
            *spec.extra_ldflags, "-o", output]
    return cmd + buildinputs.extra_link_flags()


def _build_direct(spec: StubSpec, build_dir: str) -> tuple[str, str, list[str]]:
    source = os.path.join(build_dir, "main.cpp")
    with open(source, "w", encoding="utf-8") as fh:
        fh.write("\n".join(spec.cpp_sources))
    output = os.path.join(build_dir, f"{spec.name}.so")
    # Relative names (the compiler runs in build_dir) and the prefix map keep the random staging
    # path out of the library, so two builds of one key give identical bytes.
    cmd = direct_command(spec, "main.cpp", f"{spec.name}.so", buildinputs.DEPFILE, build_dir)
    env = dict(os.environ, TMPDIR=build_dir)  # the compiler's temporary object: not under /tmp
    try:
        proc = subprocess.run(cmd, cwd=build_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False,
                              env=env)
    except OSError as exc:
        raise BuildError(f"cannot run the compiler {cmd[0]!r}: {exc}; set CXX or install a C++ compiler",
                         name=spec.name) from None
    import shlex

    out = proc.stdout.decode("utf-8", "replace")
    text = "$ " + shlex.join(cmd) + "\n" + out
    if proc.returncode != 0 or not os.path.isfile(output):
        raise BuildError(f"error building stub {spec.name!r} (exit {proc.returncode})", output=text, name=spec.name)
    deps = buildinputs.read_deps(build_dir)
    if "-Wl,--trace" in cmd:
        deps += buildinputs.trace_deps(out)
    return output, text, deps


# --- the load_inline path -------------------------------------------------------------------


def _build_load_inline(spec: StubSpec, build_dir: str) -> tuple[str, str, list[str]]:
    global _warned_no_implicit
    import glob
    import inspect

    try:
        import torch.utils.cpp_extension as cpp_ext
    except ImportError as exc:
        raise BuildError(f"building stub {spec.name!r} needs torch ({exc})", name=spec.name) from None
    kwargs = dict(
        name=spec.name,
        cpp_sources=list(spec.cpp_sources),
        cuda_sources=list(spec.cuda_sources) or None,
        functions=dict(spec.functions) if spec.functions is not None else None,
        extra_cflags=[*buildinputs.prefix_map_flags(build_dir), *buildinputs.compile_dep_flags(),
                      *spec.extra_cflags],
        extra_cuda_cflags=list(spec.extra_cuda_cflags),
        extra_ldflags=[AS_NEEDED, *spec.extra_ldflags, *buildinputs.extra_link_flags()],
        extra_include_paths=list(spec.extra_include_paths),
        build_directory=build_dir,
        verbose=False,
        with_cuda=spec.with_cuda,
        is_python_module=False,
        with_pytorch_error_handling=spec.with_pytorch_error_handling,
    )
    if spec.skips_implicit_headers:
        if "no_implicit_headers" in inspect.signature(cpp_ext.load_inline).parameters:
            kwargs["no_implicit_headers"] = True
        elif not _warned_no_implicit:
            _warned_no_implicit = True
            _log.warning("stubcache: this torch has no load_inline(no_implicit_headers=); "
                        "stubs are built with torch's implicit headers (slow). Upgrade to torch>=2.8.")
    with _torch_lock:
        # torch renames a second build of one name in a process to <name>_v1 (its in-memory
        # versioner); every stubcache build is fresh, so keep the name stable.
        versioner = getattr(cpp_ext, "JIT_EXTENSION_VERSIONER", None)
        entries = getattr(versioner, "entries", None)
        if isinstance(entries, dict):
            entries.pop(spec.name, None)
        try:
            cpp_ext.load_inline(**kwargs)
        except Exception as exc:  # torch raises RuntimeError with ninja's output, or others
            raise BuildError(f"error building stub {spec.name!r}", output=str(exc), name=spec.name) from None
    libs = [p for p in glob.glob(os.path.join(build_dir, "*.so"))]
    if len(libs) != 1:
        raise BuildError(f"torch built {len(libs)} libraries for {spec.name!r}, expected 1", name=spec.name)
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
