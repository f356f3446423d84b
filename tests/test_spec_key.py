"""Pure tests of the spec's automatic rules and of what does and does not change the key."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stubcache import StubCache, StubSpec
from stubcache.key.fingerprint import Fingerprint
from stubcache.key.derive import diff_preimages

C_SRC = 'extern "C" int value(void) { return 1; }'


def test_automatic_rule_skips_headers_for_plain_c():
    spec = StubSpec("plain", C_SRC)
    assert spec.skips_implicit_headers
    assert spec.build_method == "direct"


@pytest.mark.parametrize("src", [
    "TORCH_LIBRARY(myops, m) { m.def(\"f(Tensor x) -> Tensor\"); }",
    "at::Tensor f(at::Tensor x) { return x; }",
    "torch::Tensor f(torch::Tensor x) { return x; }",
    "c10::optional<int> g;",
    "PYBIND11_MODULE(x, m) {}",
    "void f(py::object o) {}",
    "#include <torch/all.h>\nint x;",
    "#include \"ATen/ATen.h\"\n",
])
def test_automatic_rule_keeps_headers_when_torch_is_mentioned(src):
    spec = StubSpec("t", src)
    assert not spec.skips_implicit_headers
    assert spec.build_method == "load_inline"


def test_torch_library_registration_keeps_headers_without_explicit_include():
    spec = StubSpec("reg", 'TORCH_LIBRARY(stubcache_test, m) { m.def("noop() -> ()"); }',
                    is_python_module=False)
    assert spec.no_implicit_headers is None
    assert not spec.skips_implicit_headers


def test_functions_keep_headers():
    spec = StubSpec("f", "int add(int a, int b) { return a + b; }", functions=["add"], is_python_module=True)
    assert not spec.skips_implicit_headers


def test_explicit_setting_wins():
    assert not StubSpec("x", C_SRC, no_implicit_headers=False).skips_implicit_headers
    assert StubSpec("x", "int torch_like;", no_implicit_headers=True).skips_implicit_headers


def _key(cache, **kw):
    args = dict(name="k", cpp_sources=C_SRC)
    args.update(kw)
    return cache.key(StubSpec(**args))


def test_key_inputs_change_the_key(tmp_path, monkeypatch):
    cache = StubCache(tmp_path)
    base = _key(cache)
    assert _key(cache, extra_cflags=["-O2"]) != base
    assert _key(cache, cpp_sources=C_SRC.replace("1", "2")) != base
    assert _key(cache, extra_ldflags=["-lm"]) != base
    assert _key(cache, name="k2") != base
    assert _key(cache, no_implicit_headers=False) != base
    assert _key(cache, builder="load_inline") != base
    monkeypatch.setenv("CXX", "g++")
    assert _key(cache) != base
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert _key(cache) != base
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert _key(cache) == base


def test_each_cache_owns_its_fingerprint(tmp_path, monkeypatch):
    """The fingerprint is an object of the cache: its memos go to that cache's state/ directory,
    a read-only one writes nothing, and a changed CXX is seen without resetting anything."""
    a, b = StubCache(tmp_path / "a"), StubCache(tmp_path / "b")
    assert isinstance(a.fingerprint, Fingerprint) and a.fingerprint is not b.fingerprint
    key = a.key(StubSpec("k", C_SRC))
    assert any(p.name.startswith("fp-") for p in (tmp_path / "a").rglob("state/*.json"))
    assert not (tmp_path / "b").exists()
    state = tmp_path / "ro-state"
    state.mkdir()
    fp = Fingerprint(str(state), read_only=True).base()
    assert fp == a.fingerprint.base() and list(state.iterdir()) == []
    monkeypatch.setenv("CXX", "g++")
    assert a.key(StubSpec("k", C_SRC)) != key
    monkeypatch.delenv("CXX")
    assert a.key(StubSpec("k", C_SRC)) == key


def test_irrelevant_changes_keep_the_key(tmp_path):
    cache = StubCache(tmp_path)
    a = StubSpec("m", "int add(int a, int b);", functions={"add": "Add.", "sub": "Sub."}, is_python_module=True)
    b = StubSpec("m", "int add(int a, int b);", functions={"sub": "Sub.", "add": "Add."}, is_python_module=True)
    assert cache.key(a) == cache.key(b)
    assert _key(cache) == _key(cache)
    assert cache.key(StubSpec("k", C_SRC, extra_include_paths=None)) == cache.key(StubSpec("k", [C_SRC]))


def test_preimage_diff_names_the_field(tmp_path):
    cache = StubCache(tmp_path)
    a = cache.preimage(StubSpec("k", C_SRC))
    b = cache.preimage(StubSpec("k", C_SRC, extra_cflags=["-O2"]))
    diffs = diff_preimages(a, b)
    assert [d[0] for d in diffs] == ["spec.extra_cflags"]


@pytest.mark.parametrize("name", ["a/b", "..", "a\x00b", "with space", "ünï", "x" * 300, "", "1abc"])
def test_bad_names_are_value_errors(name):
    with pytest.raises(ValueError):
        StubSpec(name, C_SRC)


@pytest.mark.parametrize("kwargs, exc", [
    (dict(cpp_sources=b"int x;"), TypeError),
    (dict(cpp_sources=[1]), TypeError),
    (dict(extra_cflags="-O2"), TypeError),
    (dict(extra_cflags=[3]), TypeError),
    (dict(is_python_module="yes"), TypeError),
    (dict(cpp_sources="\ud800"), ValueError),  # a lone surrogate; \udcXX (a byte load() could not decode) is kept
    (dict(cpp_sources=[]), ValueError),
    (dict(functions=["not an identifier"], is_python_module=True), ValueError),
    (dict(builder="direct", cpp_sources="torch::Tensor f();"), ValueError),
])
def test_bad_options_are_clear_errors(kwargs, exc):
    args = dict(name="n", cpp_sources=C_SRC)
    args.update(kwargs)
    with pytest.raises(exc):
        StubSpec(**args)


def test_spec_json_round_trip():
    spec = StubSpec("rt", [C_SRC], extra_cflags=["-O2"], functions=None, builder="load_inline")
    assert StubSpec.from_json(spec.to_json()) == spec
    assert isinstance(spec.to_json(), str) and StubSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError):
        StubSpec.from_json({"name": "x", "cpp_sources": "int x;", "bogus": 1})


_PARTS = st.sampled_from(["#", "include", " ", "\t", "\n", "\u00a0", "<", '"', "torch/", "ATen/", "c10/",
                          "pybind11/", "caffe2/", "torch", "x", "/", "#include <torch/x.h>"])


_WS = st.text(st.sampled_from([" ", "\t", "\n", "\u00a0", "\u2003", "x"]), max_size=3)
_DIRECTIVES = st.tuples(st.sampled_from(["#", "", "x"]), _WS, st.sampled_from(["include", "includ"]), _WS,
                        st.sampled_from(["<", '"', ""]), st.sampled_from(["torch/", "ATen/", "c10", "caffe2/x"]),
                        ).map("".join)


@settings(max_examples=500, deadline=None)
@given(st.lists(_PARTS, max_size=12).map("".join) | st.text(max_size=40) | _DIRECTIVES)
def test_torch_include_rule_is_the_regex(src):
    """The torch-include rule without re answers as the regex it replaced."""
    import re

    from stubcache.key import _includes_torch_header

    regex = r'#\s*include\s*[<"](?:torch|ATen|c10|pybind11|caffe2)/'
    assert _includes_torch_header(src) == (re.search(regex, src) is not None)
