"""torch-header builds (slow: ~40 s each on 2 cores), shared through one session fixture.

Covers torch's own ``load_inline`` usage patterns through ``stubcache.load_inline`` and the
automatic header rule for a ``TORCH_LIBRARY`` registration.
"""

from __future__ import annotations

import json

import pytest

from .conftest import CxxWrapper, run_py, spawn_py

PYBIND = """
import json, warnings, stubcache
m = stubcache.load_inline(  # torch not imported first: the drop-in must load it itself

    "sc_pybind",
    cpp_sources=[
        "int add(int a, int b) { return a + b; }\\n"
        "torch::Tensor twice(torch::Tensor x) { return x * 2; }",
        # C++ autograd
        "struct Square : torch::autograd::Function<Square> {\\n"
        "  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x) {\\n"
        "    ctx->save_for_backward({x}); return x * x; }\\n"
        "  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,\\n"
        "                                                 torch::autograd::variable_list g) {\\n"
        "    return {g[0] * 2 * ctx->get_saved_variables()[0]}; } };\\n"
        "torch::Tensor square(torch::Tensor x) { return Square::apply(x); }",
        # a C++ frontend module
        "double linear_sum(int64_t n) { torch::nn::Linear lin(n, 1); torch::NoGradGuard g;\\n"
        "  lin->weight.fill_(1); lin->bias.fill_(0.5); return lin(torch::ones({1, n})).item<double>(); }",
        # TORCH_WARN reaches Python's warnings; TORCH_CHECK a RuntimeError (error handling on)
        'void warn_me() { TORCH_WARN("careful: ", 42); }',
        'void check_positive(int64_t v) { TORCH_CHECK(v > 0, "value must be positive, got ", v); }',
        # a TORCH_LIBRARY op beside the bindings, reached through torch.ops
        'TORCH_LIBRARY(sc_pybind_ops, m) { m.def("thrice(Tensor x) -> Tensor", '
        '[](const at::Tensor& x) { return x * 3; }); }',
    ],
    functions={"add": "Add two ints.", "twice": "Double a tensor.", "square": "x*x with a C++ backward.",
               "linear_sum": "A torch::nn::Linear.", "warn_me": "Warn.", "check_positive": "Check."},
)
import torch
x = torch.tensor([3.0], requires_grad=True)
m.square(x).sum().backward()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    m.warn_me()
try:
    m.check_positive(-1)
    err = None
except RuntimeError as exc:
    err = str(exc).splitlines()[0]
print(json.dumps({"add": m.add(2, 3), "twice": m.twice(torch.ones(2)).tolist(),
                  "doc": "Add two ints." in m.add.__doc__, "file": m.__file__,
                  "grad": x.grad.tolist(), "linear": m.linear_sum(4),
                  "warned": [str(w.message).splitlines()[0] for w in caught], "error": err,
                  "thrice": torch.ops.sc_pybind_ops.thrice(torch.ones(1)).tolist()}))
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


def test_autograd_frontend_warnings_errors_and_ops_through_the_drop_in(torch_cache):
    cold = torch_cache["cold"][0]
    assert cold["grad"] == [6.0]  # d(x*x)/dx at 3, through the C++ backward
    assert cold["linear"] == 4.5  # torch::nn::Linear with weights 1, bias 0.5, over 4 ones
    # TORCH_WARN became one Python warning (torch appends where it was raised)
    assert len(cold["warned"]) == 1 and cold["warned"][0].startswith("careful: 42")
    assert cold["error"] == "value must be positive, got -1"  # TORCH_CHECK, torch's error handling
    assert cold["thrice"] == [3.0]  # TORCH_LIBRARY in the same extension, via torch.ops


def test_cpp_stack_traces_name_the_real_library(torch_cache):
    # torch's symbolizer runs addr2line on the path in /proc/self/maps in a child process: the
    # error must come through whole, and the maps must name the cached file itself.
    code = PYBIND.split("import torch\n")[0] + '''
import torch
try:
    m.check_positive(-2)
except RuntimeError as exc:
    text = str(exc)
maps = [l.split()[-1] for l in open("/proc/self/maps") if "sc_pybind" in l]
print(json.dumps({"text": text, "maps": sorted(set(maps)), "file": m.__file__}))
'''
    res = json.loads(run_py(code, env=dict(torch_cache["env"], TORCH_SHOW_CPP_STACKTRACES="1"),
                            timeout=600).stdout.strip().splitlines()[-1])
    assert "value must be positive, got -2" in res["text"]
    assert res["maps"] == [res["file"]]


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
