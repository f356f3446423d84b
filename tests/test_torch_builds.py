"""torch-header builds (slow: ~40 s each on 2 cores), shared through one session fixture.

Covers torch's own ``load_inline`` usage patterns through ``stubcache.load_inline`` and the
automatic header rule for a ``TORCH_LIBRARY`` registration.
"""

from __future__ import annotations

import json

import pytest

from .conftest import CxxWrapper, run_py, spawn_py

PYBIND = """
import json, stubcache
m = stubcache.load_inline(  # torch not imported first: the drop-in must load it itself

    "sc_pybind",
    cpp_sources="int add(int a, int b) { return a + b; }\\n"
                "torch::Tensor twice(torch::Tensor x) { return x * 2; }",
    functions={"add": "Add two ints.", "twice": "Double a tensor."},
)
import torch
print(json.dumps({"add": m.add(2, 3), "twice": m.twice(torch.ones(2)).tolist(),
                  "doc": "Add two ints." in m.add.__doc__, "file": m.__file__}))
"""

OPS = """
import json, stubcache
spec = stubcache.StubSpec(
    "sc_ops",
    'TORCH_LIBRARY(stubcache_test, m) { m.def("twice(Tensor x) -> Tensor", '
    '[](const at::Tensor& x) { return x * 2; }); }',
    is_python_module=False,
)
assert spec.no_implicit_headers is None and not spec.skips_implicit_headers
entry = stubcache.StubCache().get_or_build(spec)
import torch
torch.ops.load_library(entry.path)
print(json.dumps({"twice": torch.ops.stubcache_test.twice(torch.ones(3)).tolist(),
                  "method": entry.manifest.build_method,
                  "implicit": not entry.manifest.preimage["spec"]["no_implicit_headers"]}))
"""


@pytest.fixture(scope="session")
def torch_cache(tmp_path_factory):
    """One cache root where both torch-header stubs were built concurrently, cold."""
    d = tmp_path_factory.mktemp("torch_builds")
    cxx = CxxWrapper(d)
    env = {"STUBCACHE_DIR": str(d / "cache"), "CXX": str(cxx.path)}
    procs = [spawn_py(PYBIND, env=env), spawn_py(OPS, env=env)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {"env": env, "cxx": cxx, "cold": outs}


def test_pybind_module_via_functions(torch_cache):
    cold = torch_cache["cold"][0]
    assert cold["add"] == 5 and cold["twice"] == [2.0, 2.0] and cold["doc"] is True
    assert cold["file"].startswith(torch_cache["env"]["STUBCACHE_DIR"])


def test_torch_library_registration_keeps_headers(torch_cache):
    cold = torch_cache["cold"][1]
    assert cold == {"twice": [2.0, 2.0, 2.0], "method": "load_inline", "implicit": True}


def test_torch_stubs_hit_in_a_later_process(torch_cache):
    cxx = torch_cache["cxx"]
    assert cxx.compiles() == 2
    before = cxx.compiles()
    hot = [json.loads(run_py(code, env=torch_cache["env"]).stdout.strip().splitlines()[-1])
           for code in (PYBIND, OPS)]
    assert hot == torch_cache["cold"]
    assert cxx.compiles() == before


def test_plain_stub_via_drop_in_returns_the_path(cache_root, cxx):
    import ctypes

    import stubcache

    path = stubcache.load_inline("plain_c", 'extern "C" int seven(void) { return 7; }',
                                 is_python_module=False, no_implicit_headers=True)
    assert isinstance(path, str) and path.endswith(".so") and path.startswith(str(cache_root))
    assert ctypes.CDLL(path).seven() == 7


def test_extra_cflags_and_include_paths_via_drop_in(cache_root, cxx, tmp_path):
    import ctypes

    import stubcache

    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "answer.h").write_text("static inline int answer(void) { return ANSWER_BASE + 2; }\n")
    path = stubcache.load_inline(
        "flags_inc", '#include "answer.h"\nextern "C" int get(void) { return answer(); }',
        extra_cflags=["-DANSWER_BASE=40", "-O2"], extra_include_paths=[str(inc)],
        is_python_module=False, no_implicit_headers=True)
    assert ctypes.CDLL(path).get() == 42


def test_load_over_files(cache_root, cxx, tmp_path):
    import ctypes

    import stubcache

    (tmp_path / "k.h").write_text("#define K 5\n")
    src = tmp_path / "k.cpp"
    src.write_text('#include "k.h"\nextern "C" int k(void) { return K; }\n')
    path = stubcache.load("from_files", [str(src)], is_python_module=False)
    assert ctypes.CDLL(path).k() == 5
    (tmp_path / "k.h").write_text("#define K 6\n")
    path2 = stubcache.load("from_files", [str(src)], is_python_module=False)
    assert path2 != path and ctypes.CDLL(path2).k() == 6
