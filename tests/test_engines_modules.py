"""Engines' contracts that need a Python extension module (torch's headers, ~40 s a build): the
import-by-name pattern after ``load()`` (Megatron's fused kernels, transformers' kernels,
nvdiffrast, stylegan3), a module in a ``build_directory``, and ``TORCH_WARN`` reaching
``warnings.catch_warnings`` as with torch. One session-scoped fixture builds both modules once
into a shared cache; every test then loads them in fresh processes under ``stubcache run``
(hits: no compile)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import REPO, CxxWrapper

RUN = [sys.executable, "-m", "stubcache", "run", "--", sys.executable]

# Two files with the same static names (one translation unit each), bindings by hand as
# Megatron's and DeepSpeed's ops write them; TORCH_WARN through torch's error handling wrapper.
INTERFACE = r"""
#include <torch/extension.h>
static int world_size;
int shm_init(int size);
int comm_init(int size) { world_size = size + 1; return shm_init(size) + world_size * 100; }
void comm_warn() { TORCH_WARN("comm warns once"); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("comm_init", &comm_init);
  m.def("comm_warn", torch::wrap_pybind_function(comm_warn));
}
"""
SHM = "static int world_size;\nint shm_init(int size) { world_size = size; return world_size; }\n"
# torch's own JIT test shape: TORCH_WARN in a load_inline function, with_pytorch_error_handling.
WARN_SRC = r"""
#include <torch/extension.h>
int warn_twice(int x) { TORCH_WARN("inline warns"); return x * 2; }
"""

LOAD_MOD = r'''
import os, sys, warnings
import torch.utils.cpp_extension as cpp_ext
src = os.environ["MOD_SRC"]
mod = cpp_ext.load("comm_mod_t", [os.path.join(src, "interface.cpp"), os.path.join(src, "shm.cpp")])
'''
LOAD_WARN = r'''
import warnings
from torch.utils.cpp_extension import load_inline
mod = load_inline("warn_mod_t", [WARN_SRC], functions=["warn_twice"], with_pytorch_error_handling=True)
'''


def _child(code: str, env: dict) -> str:
    full = dict(os.environ, PYTHONPATH=str(REPO), **env)
    proc = subprocess.run([*RUN, "-c", code], env=full, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="session")
def module_cache(tmp_path_factory):
    """A cache holding both modules, built by two processes at once (one compile each)."""
    base = tmp_path_factory.mktemp("engines_modules")
    src = base / "src"
    src.mkdir()
    (src / "interface.cpp").write_text(INTERFACE)
    (src / "shm.cpp").write_text(SHM)
    cxx = CxxWrapper(base)
    env = {"STUBCACHE_DIR": str(base / "cache"), "MOD_SRC": str(src), "CXX": str(cxx.path),
           "TORCH_EXTENSIONS_DIR": str(base / "torch_ext")}
    full = dict(os.environ, PYTHONPATH=str(REPO), **env)
    procs = [subprocess.Popen([*RUN, "-c", code], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for code in (LOAD_MOD, f"WARN_SRC = {WARN_SRC!r}\n" + LOAD_WARN)]
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, out + err
    built = cxx.compiles()
    return env, cxx, built, base


def test_modules_built_once_each(module_cache):
    env, cxx, built, _ = module_cache
    assert built == 3  # interface.cpp, shm.cpp (one object each) and warn_mod_t's main.cpp


def test_import_by_name_after_load(module_cache):
    env, cxx, _, _ = module_cache
    cxx.reset()
    out = _child(LOAD_MOD + r'''
import comm_mod_t                                    # by name, as Megatron's callers do
assert comm_mod_t is mod and sys.modules["comm_mod_t"] is mod
assert os.path.isfile(mod.__file__) and mod.__file__.endswith("comm_mod_t.so")
comm_mod_t.flag = "set"                              # callers set attributes on it
import torch
torch.ops.load_library(mod.__file__)                 # and load it by its __file__
print("INIT", comm_mod_t.comm_init(4), sys.modules["comm_mod_t"].flag)
''', env)
    assert "INIT 504 set" in out and cxx.compiles() == 0


def test_module_in_a_build_directory_is_the_loaded_file(module_cache, tmp_path):
    env, cxx, _, _ = module_cache
    d = tmp_path / "bd"
    d.mkdir()
    out = _child(LOAD_MOD.replace('"shm.cpp")])', f'"shm.cpp")], build_directory={str(d)!r})') + r'''
st = os.stat(mod.__file__)
with open("/proc/self/maps") as fh:
    inodes = {int(ln.split()[4]) for ln in fh if ln.rstrip().endswith("/comm_mod_t.so")}
print("FILE", mod.__file__, inodes == {st.st_ino}, mod.comm_init(1))
''', env)
    assert f"FILE {d}/comm_mod_t.so True 201" in out
    assert os.listdir(d) == ["comm_mod_t.so"]


def test_torch_warn_is_recorded_by_catch_warnings(module_cache):
    env, cxx, _, _ = module_cache
    cxx.reset()
    out = _child(f"WARN_SRC = {WARN_SRC!r}\n" + LOAD_WARN + r'''
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    value = mod.warn_twice(21)
print("WARNED", value, len(w), [str(x.message) for x in w])
''', env)
    assert "WARNED 42 1" in out and "inline warns" in out and cxx.compiles() == 0


def test_torch_warn_through_wrapped_pybind_function(module_cache):
    env, _, _, _ = module_cache
    out = _child(LOAD_MOD + r'''
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    mod.comm_warn()
print("WARNED", len(w), [str(x.message) for x in w])
''', env)
    assert "WARNED 1" in out and "comm warns once" in out
