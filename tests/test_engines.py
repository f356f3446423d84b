"""Real engines' contracts with torch's loaders (docs/engines.md), in real processes under
``stubcache run``: the patterns are our own code written after SGLang's KV arena and NCCL
allocator, vLLM's NCCL allocator and DeepSpeed's JIT ops (FACTS.md's table of callers), plus the
attacks a predictable ``build_directory`` in ``/tmp`` invites.

Header-free stubs throughout (``no_implicit_headers=True``, ``is_python_module=False``): each
builds in well under a second. The module cases, which need torch's headers, are in
tests/test_engines_modules.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

import stubcache

from .conftest import REPO

IS_ROOT = os.geteuid() == 0
RUN = [sys.executable, "-m", "stubcache", "run", "--", sys.executable]

# SGLang's arena shape: one library per arena, every symbol carrying the arena's suffix, a
# static state per library. Our own code; CUDA calls are not involved.
ARENA = r'''
import ctypes, os, sys, textwrap
from torch.utils.cpp_extension import load_inline   # bound at import, as vLLM does

SRC = """
#include <stddef.h>
static long arena_state;
extern "C" long arena_set_{sfx}(long v) {{ long old = arena_state; arena_state = v; return old; }}
extern "C" long arena_get_{sfx}(void) {{ return arena_state; }}
"""

def start(n, with_pid):
    sfx = f"{os.getpid()}_{n}" if with_pid else f"{n}"
    name = f"arena_stub_{sfx}"
    d = os.path.join(os.environ["ARENA_TMP"], "arena", sfx)
    os.makedirs(d, exist_ok=True)
    load_inline(name=name, cpp_sources=[SRC.format(sfx=sfx)], is_python_module=False,
                no_implicit_headers=True, build_directory=d)          # return value ignored
    lib = ctypes.CDLL(f"{d}/{name}.so")
    return sfx, lib

with_pid = sys.argv[1] == "pid"
arenas = [start(n, with_pid) for n in range(int(sys.argv[2]))]
for n, (sfx, lib) in enumerate(arenas):
    getattr(lib, f"arena_set_{sfx}").restype = ctypes.c_long
    getattr(lib, f"arena_set_{sfx}")(ctypes.c_long(1000 + n))
ok = all(getattr(lib, f"arena_get_{sfx}")() == 1000 + n for n, (sfx, lib) in enumerate(arenas))
print("ARENAS-OK" if ok else "ARENAS-MIXED", flush=True)
'''


def _run_procs(script: str, args: list[list[str]], env: dict, under_run: bool = True) -> list[str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), **env)
    cmd = RUN if under_run else [sys.executable]
    procs = [subprocess.Popen([*cmd, "-c", script, *a], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for a in args]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"rc={p.returncode}\nstdout:\n{out}\nstderr:\n{err}"
        outs.append(out)
    return outs


@pytest.mark.parametrize("with_pid", [True, False], ids=["pid-suffix", "pid-free-suffix"])
def test_arena_pattern_under_stubcache_run(cache_root, cxx, tmp_path, with_pid):
    procs, arenas = 3, 2
    env = {"ARENA_TMP": str(tmp_path)}
    outs = _run_procs(ARENA, [["pid" if with_pid else "nopid", str(arenas)]] * procs, env)
    assert all("ARENAS-OK" in o for o in outs), outs
    # With the pid in the name each process is a new key; without it, one build per arena.
    assert cxx.compiles() == (procs * arenas if with_pid else arenas)
    cxx.reset()
    outs = _run_procs(ARENA, [["pid" if with_pid else "nopid", str(arenas)]] * procs, env)  # a restart
    assert all("ARENAS-OK" in o for o in outs), outs
    assert cxx.compiles() == (procs * arenas if with_pid else 0)


# vLLM's and SGLang's NCCL allocator shape: a fixed name, build_directory = a temp dir itself
# (sticky, world-writable like /tmp), D/lock removed before each call, the library by path.
NCCL = r'''
import ctypes, os, sys
import torch.utils.cpp_extension as cpp_ext

d = os.environ["NCCL_TMP"]
try:
    os.remove(os.path.join(d, "lock"))
except FileNotFoundError:
    pass
cpp_ext.load_inline(name="nccl_allocator_t", cpp_sources=[
    'extern "C" void* nccl_alloc_plug(long n, int dev, void* s) { static char buf[64]; return n <= 64 ? buf : 0; }'
    'extern "C" int nccl_tag(void) { return 42; }'],
    is_python_module=False, no_implicit_headers=True, build_directory=d, verbose=sys.argv[1] == "0")
path = f"{d}/nccl_allocator_t.so"
lib = ctypes.CDLL(path)
st = os.stat(path)
with open("/proc/self/maps") as fh:
    mapped = {int(line.split()[4]) for line in fh if line.rstrip().endswith("/nccl_allocator_t.so")}
print("TAG", lib.nccl_tag(), "SAME-INODE" if mapped == {st.st_ino} else f"OTHER {mapped} {st.st_ino}", flush=True)
'''


def test_nccl_allocator_pattern(cache_root, cxx, tmp_path):
    d = tmp_path / "tmp"
    d.mkdir()
    d.chmod(0o1777)
    outs = _run_procs(NCCL, [[str(i)] for i in range(3)], {"NCCL_TMP": str(d)})
    assert all("TAG 42 SAME-INODE" in o for o in outs), outs
    assert cxx.compiles() == 1
    assert os.listdir(d) == ["nccl_allocator_t.so"]  # no lock, no temp file, no sources left there


def test_library_at_build_directory_is_the_loaded_file(cache_root, tmp_path):
    """Same inode as the handle the drop-in loaded (state shared with a later dlopen by path),
    and a copy, not a link to the cache entry: the caller may rewrite what it finds there."""
    d = tmp_path / "d"
    d.mkdir()
    src = 'extern "C" int bump(void) { static int n; return ++n; }'
    ret = stubcache.load_inline("same_file", src, is_python_module=False, no_implicit_headers=True,
                                build_directory=d)  # os.PathLike
    assert ret == str(d / "same_file.so")
    lib = ctypes.CDLL(str(d / "same_file.so"))
    assert (lib.bump(), lib.bump()) == (1, 2)
    st = os.stat(d / "same_file.so")
    assert st.st_nlink == 1 and stat.S_ISREG(st.st_mode)
    entry = stubcache.StubCache().lookup(stubcache.StubSpec("same_file", src, no_implicit_headers=True))
    assert os.stat(entry.path).st_ino != st.st_ino
    # The caller removes the file: the next call puts it back (torch would rebuild it there).
    os.remove(d / "same_file.so")
    stubcache.load_inline("same_file", src, is_python_module=False, no_implicit_headers=True, build_directory=d)
    assert (d / "same_file.so").is_file()


# --- a hostile build_directory -------------------------------------------------------------------

SRC = 'extern "C" int seven(void) { return 7; }'


def _load_into(d, name="victim"):
    return stubcache.load_inline(name, SRC, is_python_module=False, no_implicit_headers=True, build_directory=d)


def test_symlink_planted_at_the_library_name_is_replaced_not_followed(cache_root, tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o1777)
    d.chmod(0o1777)
    outside = tmp_path / "precious.so"
    outside.write_bytes(b"do not touch")
    (d / "victim.so").symlink_to(outside)
    path = _load_into(str(d))
    assert outside.read_bytes() == b"do not touch"
    assert not os.path.islink(path) and ctypes.CDLL(path).seven() == 7
    assert sorted(os.listdir(d)) == ["victim.so"]


def test_build_directory_that_is_a_symlink_is_refused(cache_root, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "d"
    link.symlink_to(target)
    with pytest.raises(PermissionError, match="symbolic link"):
        _load_into(str(link))
    assert os.listdir(target) == []


def test_build_directory_writable_by_others_without_sticky_bit_is_refused(cache_root, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        _load_into(str(d))
    assert os.listdir(d) == []


def test_missing_or_non_directory_build_directory_fails_as_torch_would(cache_root, tmp_path):
    with pytest.raises(FileNotFoundError):
        _load_into(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        _load_into(str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "x"


def test_a_directory_at_the_library_name_is_a_clear_error(cache_root, tmp_path):
    d = tmp_path / "d"
    (d / "victim.so").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        _load_into(str(d))
    assert os.listdir(d) == ["victim.so"]


@pytest.fixture(scope="module")
def other_user():
    """A real user other than us (root only): created for the module if missing."""
    if not IS_ROOT or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to create a real user")
    import pwd

    name = "stubcache_engines"
    made = subprocess.run(["id", name], capture_output=True).returncode != 0
    if made:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True)
    yield pwd.getpwnam(name)
    if made:
        subprocess.run(["userdel", name], capture_output=True)


def test_build_directory_of_another_user_is_refused(cache_root, tmp_path, other_user):
    d = tmp_path / "d"
    d.mkdir()
    os.chown(d, other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(PermissionError, match=f"uid {other_user.pw_uid}"):
        _load_into(str(d))
    assert os.listdir(d) == []


def test_library_planted_by_another_user_in_a_sticky_dir_is_replaced(cache_root, tmp_path, other_user):
    # Root may replace another user's file in a sticky directory: the caller gets our library,
    # never the planted one, and the planted inode is left as it was.
    d = tmp_path / "d"
    d.mkdir()
    d.chmod(0o1777)
    planted = d / "victim.so"
    planted.write_bytes(b"planted")
    os.chown(planted, other_user.pw_uid, other_user.pw_gid)
    keep = os.open(planted, os.O_RDONLY)
    try:
        path = _load_into(str(d))
        assert os.stat(path).st_uid == os.geteuid() and ctypes.CDLL(path).seven() == 7
        assert os.pread(keep, 100, 0) == b"planted"
    finally:
        os.close(keep)


def test_library_planted_by_another_user_is_refused_for_that_user_not_root(cache_root, other_user):
    """Not root: in a sticky directory the rename over another user's file fails, and the caller
    gets a clear PermissionError (never the planted library)."""
    import tempfile

    base = tempfile.mkdtemp(dir="/tmp")  # traversable by the other user (pytest's tmp is not)
    try:
        os.chmod(base, 0o755)
        d = os.path.join(base, "d")
        os.mkdir(d)
        os.chmod(d, 0o1777)
        planted = os.path.join(d, "victim.so")
        with open(planted, "wb") as fh:
            fh.write(b"planted")  # root's file: for the other user, someone else's
        theirs = os.path.join(base, "theirs")
        os.mkdir(theirs)
        os.chown(theirs, other_user.pw_uid, other_user.pw_gid)
        code = textwrap.dedent(f"""
            import os, ctypes, subprocess, sysconfig, shlex, glob, json, tempfile, hashlib, errno, signal
            import importlib, pkgutil, filelock, stubcache, stubcache.key.fingerprint
            # The interpreter's own files are under /root (pyenv), unreadable once dropped: import
            # every module the call may reach (the size cap after a publish, too) first.
            for m in pkgutil.walk_packages(stubcache.__path__, "stubcache."):
                if not m.name.endswith("__main__"):
                    importlib.import_module(m.name)
            sysconfig.get_path("include", scheme="posix_prefix"); stubcache.key.fingerprint.torch_dir()
            os.environ.update(STUBCACHE_DIR={theirs + "/cache"!r}, HOME={theirs!r}, TMPDIR={theirs!r})
            os.setgroups([]); os.setegid({other_user.pw_gid}); os.seteuid({other_user.pw_uid})
            try:
                stubcache.load_inline("victim", {SRC!r}, is_python_module=False, no_implicit_headers=True,
                                      build_directory={d!r})
            except PermissionError as exc:
                print("REFUSED", exc)
            else:
                print("LOADED")
        """)
        proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                              capture_output=True, text=True, timeout=300)
        assert "REFUSED" in proc.stdout and "another user" in proc.stdout, proc.stdout + proc.stderr
        with open(planted, "rb") as fh:
            assert fh.read() == b"planted"
        assert os.listdir(d) == ["victim.so"]
    finally:
        shutil.rmtree(base)


# --- DeepSpeed's JIT ops: load() of files, fixed name, no build_directory ----------------------

SHM_H = "int shm_init(int size, int rank);\n"
# Two files that each keep their own static state under the same names, as DeepSpeed's
# shm_interface.cpp and shm.cpp do: one translation unit per file or they do not compile.
SHM_CPP = """#include "shm.h"
static int world_size;
static int world_rank;
static bool is_initialized;
int shm_init(int size, int rank) { world_size = size; world_rank = rank; is_initialized = true;
  return world_size * 100 + world_rank; }
"""
SHM_INTERFACE_CPP = """#include "shm.h"
#include <omp.h>
static int world_size;
static int world_rank;
static bool is_initialized;
extern "C" int ds_init(int size, int rank) { world_size = size + 1; world_rank = rank; is_initialized = true;
  return shm_init(size, rank) + world_size * 10000; }
extern "C" int ds_threads(void) { int n = 0;
#pragma omp parallel reduction(+:n)
  n += 1;
  return n; }
"""

DEEPSPEED = r'''
import ctypes, os, pathlib, sys
import torch.utils.cpp_extension as cpp_ext

src = pathlib.Path(os.environ["DS_SRC"])
lib_path = cpp_ext.load("shm_comm_t", [src / "shm_interface.cpp", src / "shm.cpp"],   # os.PathLike sources
                        extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                        is_python_module=False, verbose=sys.argv[1] == "0")
lib = ctypes.CDLL(lib_path)                                                       # the return value used
print("DS", lib.ds_init(4, int(sys.argv[1])), lib.ds_threads() >= 1, flush=True)
'''


def _deepspeed_sources(tmp_path):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "shm.h").write_text(SHM_H)
    (src / "shm.cpp").write_text(SHM_CPP)
    (src / "shm_interface.cpp").write_text(SHM_INTERFACE_CPP)
    return src


def test_deepspeed_pattern_across_processes(cache_root, cxx, tmp_path):
    src = _deepspeed_sources(tmp_path)
    env = {"DS_SRC": str(src), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext1")}
    outs = _run_procs(DEEPSPEED, [[str(r)] for r in range(3)], env)
    lines = [next(ln for ln in o.splitlines() if ln.startswith("DS ")) for o in outs]  # rank 0 is verbose
    assert sorted(ln.split()[1] for ln in lines) == ["50400", "50401", "50402"], outs
    assert all(ln.split()[2] == "True" for ln in lines)
    assert cxx.compiles() == 2  # one object per source file, once for all three ranks
    cxx.reset()
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext2")  # a new, empty torch build root: still a hit
    outs = _run_procs(DEEPSPEED, [["1"]], env)
    assert outs[0].split()[1] == "50401" and cxx.compiles() == 0
    assert not (tmp_path / "ext1").exists() and not (tmp_path / "ext2").exists()


def test_plain_torch_builds_the_deepspeed_pattern_too(tmp_path):
    """The reference: torch's own load() of the same files (so the test above asks what torch gives)."""
    src = _deepspeed_sources(tmp_path)
    outs = _run_procs(DEEPSPEED, [["2"]], {"DS_SRC": str(src), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")},
                      under_run=False)
    assert outs[0].split()[1] == "50402"


# --- flags, environment and errors as torch reads them ------------------------------------------


@pytest.mark.parametrize("builder", ["direct", "load_inline"])
def test_flags_with_spaces_or_line_breaks_are_split_into_words(cache_root, builder):
    spec = stubcache.StubSpec(f"words_{builder}", '#ifndef X\n#error no X\n#endif\nextern "C" int f(void) { return X; }',
                              extra_cflags=["-O0 -Wall", "-g\n\n", "-DX=3 -DY=4"], builder=builder)
    assert spec.extra_cflags == ("-O0", "-Wall", "-g", "-DX=3", "-DY=4")
    assert stubcache.StubCache().load(spec).f() == 3


def test_a_flag_with_quotes_stays_one_word():
    spec = stubcache.StubSpec("quoted", "int x;", extra_cflags=['-DMSG="a b"', "-DX='c d'"])
    assert spec.extra_cflags == ('-DMSG="a b"', "-DX='c d'")


def test_empty_arch_list_means_detect_as_in_torch(cache_root):
    code = ("import stubcache; print(stubcache.StubCache().key(stubcache.StubSpec('arch', "
            "'int x;', no_implicit_headers=True)))")
    keys = set()
    for value in (None, "", "  "):
        env = dict(os.environ, PYTHONPATH=str(REPO))
        env.pop("TORCH_CUDA_ARCH_LIST", None)
        if value is not None:
            env["TORCH_CUDA_ARCH_LIST"] = value
        keys.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    env["TORCH_CUDA_ARCH_LIST"] = "8.0"
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert len(keys) == 1 and other.stdout.strip() not in keys


def test_empty_cpp_sources_build_as_in_torch(cache_root):
    path = stubcache.load_inline("empty_src", [], is_python_module=False, no_implicit_headers=True)
    assert os.path.isfile(path)


def test_cuda_sources_without_cuda_home_raise_torchs_oserror(cache_root):
    import torch.utils.cpp_extension as cpp_ext

    if cpp_ext.CUDA_HOME is not None:
        pytest.skip("this torch has a CUDA_HOME")
    with pytest.raises(OSError, match="CUDA_HOME"):
        stubcache.load_inline("no_cuda", [], cuda_sources=["__global__ void k() {}"], is_python_module=False,
                              no_implicit_headers=True)


def test_failed_build_is_a_runtime_error_as_in_torch(cache_root):
    with pytest.raises(RuntimeError, match="Error building extension 'broken_t'"):
        stubcache.load_inline("broken_t", "this is not C++", is_python_module=False, no_implicit_headers=True)


def test_waiting_ranks_stay_quiet_without_a_terminal(cache_root, cxx, monkeypatch):
    """A rank waiting > 5 s for another's build prints nothing on a piped stderr (torch is
    silent there); with verbose=True it says whom it waits for (a terminal: test_dropin.py)."""
    monkeypatch.setenv("STUBCACHE_TEST_CXX_SLEEP", "14")
    code = r'''
import sys, stubcache
stubcache.load_inline("slow_wait", 'extern "C" int f(void) { return 1; }', is_python_module=False,
                      no_implicit_headers=True, verbose=sys.argv[1] == "v")
print("LOADED", flush=True)
'''
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen([sys.executable, "-c", code, "q"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    from .conftest import wait_until

    wait_until(lambda: cxx.compiles() == 1, "the holder's compile to start", proc=holder)
    quiet = subprocess.Popen([sys.executable, "-c", code, "q"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    loud = subprocess.Popen([sys.executable, "-c", code, "v"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    results = [p.communicate(timeout=120) for p in (holder, quiet, loud)]
    assert all("LOADED" in out for out, _ in results), results
    assert cxx.compiles() == 1
    assert "waiting for" not in results[1][1]
    assert "stubcache: waiting for pid" in results[2][1]


def test_common_nvcc_flags_key_the_same_whether_or_not_cpp_extension_was_imported_first(cache_root):
    """torch reads ``COMMON_NVCC_FLAGS`` at build time; the key held it only where the caller had
    imported ``torch.utils.cpp_extension`` first, so a process's second call (the build imports
    it) and an engine that imports it first got another key than a first call (found on an
    H200: tests/gpu's test_cuda_stub_tracks_no_toolkit_header)."""
    if not shutil.which("nvcc") and not os.path.isfile("/usr/local/cuda/bin/nvcc"):
        pytest.skip("needs nvcc")
    code = ("import json, sys, stubcache\n"
            "if sys.argv[1] != 'plain':\n"
            "    import torch.utils.cpp_extension as ce\n"
            "    if sys.argv[1] == 'edited':\n"
            "        ce.COMMON_NVCC_FLAGS.append('-DEDITED')\n"
            "spec = stubcache.StubSpec('nvccflags', 'int f();', cuda_sources=['__global__ void k() {}'],"
            " no_implicit_headers=True)\n"
            "cache = stubcache.StubCache()\n"
            "print(json.dumps([cache.key(spec), cache.preimage(spec)['fingerprint']['cuda']['common_nvcc_flags'],"
            " 'torch' in sys.modules]))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_CUDA_ARCH_LIST="9.0")
    out = {}
    for how in ("plain", "imported", "edited"):
        proc = subprocess.run([sys.executable, "-c", code, how], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out[how] = json.loads(proc.stdout.strip().splitlines()[-1])
    import torch.utils.cpp_extension as cpp_ext

    assert out["plain"][:2] == out["imported"][:2]
    assert out["plain"][1] == list(cpp_ext.COMMON_NVCC_FLAGS) and not out["plain"][2]  # read without importing torch
    assert out["edited"][0] != out["plain"][0] and out["edited"][1][-1] == "-DEDITED"


def test_default_nvcc_flags_read_torch_source_through_links_never_a_fifo(tmp_path):
    """The list a CUDA key holds without cpp_extension imported comes from torch's source: a
    linked file (a symlinked install) is read, a FIFO planted there is no answer and no wait."""
    import time

    from stubcache.key.fingerprint import default_nvcc_flags

    real = tmp_path / "real.py"
    real.write_text('X = 1\nCOMMON_NVCC_FLAGS = [\n    "-DA",\n    "--b",\n]\n')
    linked, fifo = tmp_path / "linked" / "utils", tmp_path / "fifo" / "utils"
    linked.mkdir(parents=True)
    fifo.mkdir(parents=True)
    (linked / "cpp_extension.py").symlink_to(real)
    os.mkfifo(fifo / "cpp_extension.py")
    assert default_nvcc_flags(str(tmp_path / "linked")) == ["-DA", "--b"]
    t0 = time.monotonic()
    assert default_nvcc_flags(str(tmp_path / "fifo")) is None and time.monotonic() - t0 < 5
    assert default_nvcc_flags(str(tmp_path / "nowhere")) is None
