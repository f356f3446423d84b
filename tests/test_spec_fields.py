"""The spec's field table (stubcache.key.FIELDS) and everything derived from it.

The literal keys, canonical forms, JSON texts and error messages below were taken from the code
before the table existed (commit 46350cd, one explicit line per field in six places). Keys of
existing caches depend on them: a change here is a cache-wide miss, so a test that fails here
means the refactor drifted, not that the literals need updating.
"""

from __future__ import annotations

import copy
import inspect
import json
import pickle
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stubcache
from stubcache import StubSpec
from stubcache.dropin import compat
from stubcache.build.builder import load_inline_kwargs
from stubcache.key.derive import base_key
from stubcache.key import FIELD_NAMES, FIELDS, PASS, REQUIRED, REWRITE, _is_c_name, spec_from_canonical

C_SRC = 'extern "C" int value(void) { return 1; }'
# A fixed fingerprint, so that the key depends on the spec alone (the real one is per machine).
FP = {"format": 1, "torch": "2.13.0+cpu", "compiler": {"path": "/usr/bin/c++", "version": "12"}}

SPECS = {
    "plain": dict(name="plain", cpp_sources=C_SRC),
    "rich": dict(name="rich", cpp_sources=["int add(int a, int b) { return a + b; }", "int sub(int a, int b);"],
                 functions={"sub": "Subtract.", "add": "Add."}, extra_cflags=[" -O2 ", "-DX=1"],
                 extra_ldflags=["-lm"], extra_include_paths=["/opt/inc", "/usr/local/include"],
                 is_python_module=True, with_pytorch_error_handling=False),
    "cuda": dict(name="cu", cpp_sources="void launch();", cuda_sources=["__global__ void k() {}"],
                 extra_cuda_cflags=["-O3"], builder="load_inline"),
    "forced": dict(name="forced", cpp_sources="int torch_like = 1; // at::x", no_implicit_headers=True,
                   with_cuda=False, functions=None, is_python_module=True, with_pytorch_error_handling=False),
    "torchy": dict(name="torchy", cpp_sources="TORCH_LIBRARY(x, m) {}", functions=["f", "g"]),
    "tools": dict(name="tools", cpp_sources=C_SRC, extra_cflags=["-march=native", "-fuse-ld=lld", "-B", "/opt/bin"],
                  extra_ldflags=["--ld-path=/usr/bin/ld"]),
    "text": dict(name="text", cpp_sources=["// \u00fcn\u00ef \u2713 \udcff\n" + C_SRC]),  # \udcff: a byte load() kept
}

KEYS = {
    "plain": "7ab6ff51e0274acb69956e2e3dee405d",
    "rich": "7577744557f68203ef8508c9a908cf89",
    "cuda": "1cbfc6cfdc749b1f8d6b395d0a2829d8",
    "forced": "e3610e30456bd8a08f54d0b339012519",
    "torchy": "1a6e10c8aaef93e47c33959b98ed027e",
    "tools": "897f5cee9cf921426e5b72e474183014",
    "text": "2c51d290f95796e5be65f40b070f497c",
}

CANONICAL = {
    "plain": {"name": "plain", "cpp_sources": ['extern "C" int value(void) { return 1; }'], "cuda_sources": [],
              "functions": None, "extra_cflags": [], "extra_cuda_cflags": [], "extra_ldflags": [],
              "extra_include_paths": [], "with_cuda": False, "is_python_module": None,
              "with_pytorch_error_handling": None, "no_implicit_headers": True, "build_method": "direct", "separate_units": False},
    "rich": {"name": "rich", "cpp_sources": ["int add(int a, int b) { return a + b; }", "int sub(int a, int b);"],
             "cuda_sources": [], "functions": [["add", "Add."], ["sub", "Subtract."]],
             "extra_cflags": ["-O2", "-DX=1"], "extra_cuda_cflags": [], "extra_ldflags": ["-lm"],
             "extra_include_paths": ["/opt/inc", "/usr/local/include"], "with_cuda": False,
             "is_python_module": True, "with_pytorch_error_handling": False, "no_implicit_headers": False,
             "build_method": "load_inline", "separate_units": False},
    "torchy": {"name": "torchy", "cpp_sources": ["TORCH_LIBRARY(x, m) {}"], "cuda_sources": [],
               "functions": [["f", "f"], ["g", "g"]], "extra_cflags": [], "extra_cuda_cflags": [],
               "extra_ldflags": [], "extra_include_paths": [], "with_cuda": False, "is_python_module": False,
               "with_pytorch_error_handling": True, "no_implicit_headers": False, "build_method": "load_inline",
               "separate_units": False},
}

TO_JSON = {
    "plain": '{"builder": null, "cpp_sources": ["extern \\"C\\" int value(void) { return 1; }"], "cuda_sources": [], '
             '"extra_cflags": [], "extra_cuda_cflags": [], "extra_include_paths": [], "extra_ldflags": [], '
             '"functions": null, "is_python_module": false, "name": "plain", "no_implicit_headers": null, '
             '"separate_units": false, "with_cuda": null, "with_pytorch_error_handling": true}',
    "rich": '{"builder": null, "cpp_sources": ["int add(int a, int b) { return a + b; }", "int sub(int a, int b);"], '
            '"cuda_sources": [], "extra_cflags": ["-O2", "-DX=1"], "extra_cuda_cflags": [], '
            '"extra_include_paths": ["/opt/inc", "/usr/local/include"], "extra_ldflags": ["-lm"], '
            '"functions": {"add": "Add.", "sub": "Subtract."}, "is_python_module": true, "name": "rich", '
            '"no_implicit_headers": null, "separate_units": false, "with_cuda": null, "with_pytorch_error_handling": false}',
}


@pytest.mark.parametrize("label", sorted(SPECS))
def test_keys_are_pinned(label):
    spec = StubSpec(**SPECS[label])
    assert base_key(spec.canonical(), FP) == KEYS[label]
    assert base_key(StubSpec.from_json(spec.to_json()).canonical(), FP) == KEYS[label]


@pytest.mark.parametrize("label", sorted(CANONICAL))
def test_canonical_form_is_pinned(label):
    canonical = StubSpec(**SPECS[label]).canonical()
    assert canonical == CANONICAL[label]
    assert list(canonical) == list(CANONICAL[label])  # `explain --format json` prints it in this order


@pytest.mark.parametrize("label", sorted(TO_JSON))
def test_to_json_and_to_dict_are_pinned(label):
    spec = StubSpec(**SPECS[label])
    assert spec.to_json() == TO_JSON[label]
    data = spec.to_dict()
    assert list(data) == [f.name for f in FIELDS]
    assert data == json.loads(TO_JSON[label])
    assert StubSpec.from_dict(data) == spec and StubSpec.from_dict(data).to_dict() == data


def test_constructor_signature_is_the_table():
    """The constructor spells its parameters out (for callers and type checkers); they must be the
    table's, in order, with its defaults."""
    params = list(inspect.signature(StubSpec).parameters.values())
    assert [p.name for p in params] == [f.name for f in FIELDS]
    for p, f in zip(params, FIELDS):
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert (p.default is inspect.Parameter.empty) if f.default is REQUIRED else (p.default == f.default), f.name
    assert FIELD_NAMES <= set(StubSpec.__slots__) and FIELD_NAMES == set(StubSpec("n", C_SRC).to_dict())
    assert [f.key_name for f in FIELDS] == list(StubSpec("n", C_SRC).canonical())


def test_class_annotations_are_the_table():
    """StubSpec declares its slots' types for type checkers (mypy cannot see the slots made from
    the table): the fields' must be the table's, in order, then the private slots'."""
    names = list(StubSpec.__annotations__)
    assert names[:len(FIELDS)] == [f.name for f in FIELDS]
    assert set(names) == set(StubSpec.__slots__) and len(names) == len(StubSpec.__slots__)


def test_from_dict_knows_the_fields_from_the_table():
    full = {f.name: f.default for f in FIELDS if f.default is not REQUIRED}
    assert StubSpec.from_dict(dict(full, name="n", cpp_sources=C_SRC)) == StubSpec("n", C_SRC)
    with pytest.raises(ValueError, match=r"^unknown spec field\(s\): bogus, zz$"):
        StubSpec.from_dict({"name": "x", "cpp_sources": C_SRC, "zz": 2, "bogus": 1})
    with pytest.raises(ValueError, match=r"^unknown spec field\(s\): build_method$"):  # a key name, not a field
        StubSpec.from_json(json.dumps({"name": "x", "cpp_sources": C_SRC, "build_method": "direct"}))
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'name'"):
        StubSpec.from_dict({"cpp_sources": C_SRC})
    with pytest.raises(TypeError, match=r"^a spec must be a JSON object, got list$"):
        StubSpec.from_json("[1]")


def test_spec_stays_immutable_and_replace_copies():
    spec = StubSpec("imm", C_SRC, extra_cflags=["-O2"])
    key = base_key(spec.canonical(), FP)
    for field in FIELD_NAMES:
        with pytest.raises(AttributeError, match=rf"^StubSpec is immutable: cannot set '{field}'; build a new"):
            setattr(spec, field, getattr(spec, field))
        with pytest.raises(AttributeError, match=rf"^StubSpec is immutable: cannot delete '{field}'$"):
            delattr(spec, field)
    changed = spec.replace(extra_cflags=["-O3"], name="imm2")
    assert (changed.name, changed.extra_cflags) == ("imm2", ("-O3",))
    assert (spec.name, spec.extra_cflags) == ("imm", ("-O2",)) and base_key(spec.canonical(), FP) == key
    with pytest.raises(ValueError, match=r"^unknown spec field\(s\): bogus$"):
        spec.replace(bogus=1)
    for clone in (copy.copy(spec), copy.deepcopy(spec), pickle.loads(pickle.dumps(spec))):
        assert clone == spec and clone.to_dict() == spec.to_dict() and clone is not spec


def test_a_default_argument_and_the_same_value_passed_give_equal_specs():
    """Defaults skip their check (the stored value is computed once): passing them explicitly,
    or an equal value, must give the same spec."""
    explicit = StubSpec("d", C_SRC, **{f.name: f.default for f in FIELDS[2:]})
    assert explicit.to_dict() == StubSpec("d", C_SRC).to_dict()
    assert StubSpec("d", C_SRC, extra_cflags=[], cuda_sources=[], extra_include_paths=[]).to_dict() == \
        StubSpec("d", C_SRC).to_dict()


# (arguments, exception, message): messages as the pre-table code gave them, in its check order.
BAD = [
    (dict(name=3), TypeError, "name must be str, got int"),
    (dict(name="a b"), ValueError, "invalid stub name 'a b': use 1-100 characters from [A-Za-z0-9_], not "
                                   "starting with a digit (it becomes a C identifier and a file name)"),
    (dict(cpp_sources=b"int x;"), TypeError, "cpp_sources must be str or a list of str, not bytes; decode it first"),
    (dict(cpp_sources=[1]), TypeError, "cpp_sources must contain only str, got int"),
    (dict(cpp_sources=5), TypeError, "cpp_sources must be str or a list of str, got int"),
    (dict(cpp_sources="a\x00b"), ValueError, "cpp_sources contains a NUL character"),
    (dict(cpp_sources="\ud800"), ValueError, "cpp_sources is not valid UTF-8 text (surrogates not allowed at 0)"),
    (dict(cpp_sources=["ok", "\u00e9\ud800"]), ValueError,
     "cpp_sources is not valid UTF-8 text (surrogates not allowed at 1)"),
    (dict(cpp_sources=[]), ValueError, "a stub needs at least one of cpp_sources or cuda_sources"),
    (dict(cuda_sources=7), TypeError, "cuda_sources must be str or a list of str, got int"),
    (dict(functions=5), TypeError, "functions must be a list of names or a dict name->docstring, got int"),
    (dict(functions=["a b"]), ValueError, "function name 'a b' is not a C identifier"),
    (dict(functions={"f": 1}), TypeError, "functions must map str names to str docstrings"),
    (dict(functions=["f", "f"]), ValueError, "functions lists a name twice"),
    (dict(functions={"f": "\x00"}), ValueError, "functions docstring contains a NUL character"),
    (dict(extra_cflags="-O2"), TypeError,
     "extra_cflags must be a list of str, got a single str '-O2'; wrap it in a list"),
    (dict(extra_cflags=[3]), TypeError, "extra_cflags must contain only str, got int"),
    (dict(extra_ldflags=b"x"), TypeError, "extra_ldflags must be str or a list of str, not bytes; decode it first"),
    (dict(extra_include_paths="/x"), TypeError,
     "extra_include_paths must be a list of str, got a single str '/x'; wrap it in a list"),
    (dict(extra_cuda_cflags={"a": 1}), TypeError, "extra_cuda_cflags must be str or a list of str, got dict"),
    (dict(with_cuda=1), TypeError, "with_cuda must be True, False or None, got int"),
    (dict(is_python_module="yes"), TypeError, "is_python_module must be True or False, got str"),
    (dict(with_pytorch_error_handling=None), TypeError,
     "with_pytorch_error_handling must be True or False, got NoneType"),
    (dict(no_implicit_headers=0), TypeError, "no_implicit_headers must be True, False or None, got int"),
    (dict(builder="ninja"), ValueError, "builder must be None, 'direct' or 'load_inline', got 'ninja'"),
    (dict(cpp_sources="torch::Tensor f();", builder="direct"), ValueError,
     "stub 'n' cannot take the direct build path: it needs torch headers, a Python module or CUDA"),
    (dict(builder="direct", is_python_module=True), ValueError,
     "stub 'n' cannot take the direct build path: it needs torch headers, a Python module or CUDA"),
    (dict(name="bad name", cpp_sources=5, functions=5), ValueError,  # the first field's error wins
     "invalid stub name 'bad name': use 1-100 characters from [A-Za-z0-9_], not starting with a digit "
     "(it becomes a C identifier and a file name)"),
    (dict(extra_cflags=[3], with_cuda=1), TypeError, "extra_cflags must contain only str, got int"),
]


@pytest.mark.parametrize("kwargs, exc, message", BAD)
def test_bad_input_gives_the_same_error(kwargs, exc, message):
    args = dict(name="n", cpp_sources="int x;")
    args.update(kwargs)
    with pytest.raises(exc) as info:
        StubSpec(**args)
    assert type(info.value) is exc and str(info.value) == message


@pytest.mark.parametrize("label", sorted(SPECS))
def test_spec_from_canonical_inverts_the_key_rules(label):
    spec = StubSpec(**SPECS[label])
    back = spec_from_canonical(json.loads(json.dumps(spec.canonical())))  # as read from a manifest
    assert back.canonical() == spec.canonical()


@pytest.mark.parametrize("data, exc", [([1], TypeError), ("x", TypeError), ({"cpp_sources": ["x"]}, KeyError),
                                       ({"name": "n", "cpp_sources": ["x"], "build_method": "ninja"}, ValueError)])
def test_spec_from_canonical_refuses_what_is_not_a_canonical_form(data, exc):
    # audit.rebuild_entry reports these three types as "pre-image is not a spec"
    with pytest.raises(exc):
        spec_from_canonical(data)


def test_builder_hands_torch_every_field_the_table_maps(tmp_path):
    spec = StubSpec(**SPECS["rich"])
    kwargs = load_inline_kwargs(spec, str(tmp_path), verbose=True)
    data = spec.to_dict()
    for f in FIELDS:
        if f.torch == PASS:
            assert kwargs[f.name] == data[f.name], f.name
        elif f.torch == REWRITE and f.name != "no_implicit_headers":  # set by the caller, per torch version
            assert f.name in kwargs, f.name
        else:
            assert f.name not in kwargs, f.name
    assert kwargs["is_python_module"] is False and kwargs["extra_include_paths"] == []
    assert kwargs["cpp_sources"] == list(spec.cpp_sources) and kwargs["cuda_sources"] is None
    cflags = kwargs["extra_cflags"]
    at = cflags.index("-I/opt/inc")
    assert cflags[at:at + 4] == ["-I/opt/inc", "-I/usr/local/include", "-O2", "-DX=1"]
    # the build's own dependency flags come last, after the caller's (the last one given wins)
    assert cflags[at + 4].startswith("-Wp,-MD,") and all(f.startswith(("-Wp,", "-Wa,")) for f in cflags[at + 4:])
    assert kwargs["extra_ldflags"][:2] == ["-Wl,--as-needed", "-lm"]
    assert (kwargs["build_directory"], kwargs["verbose"]) == (str(tmp_path), True)
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    params = inspect.signature(cpp_extension.load_inline).parameters
    assert set(kwargs) <= set(params)
    assert {f.name for f in FIELDS if f.torch} <= set(params)


def test_dropin_forwards_every_torch_field(monkeypatch):
    """The drop-in's full path takes each field the table marks as a load_inline parameter from
    the argument of the same name, and each one is in its per-call memo key."""
    seen = []

    class Unpublished:
        published = False

    def capture(spec, verbose, name=None, call=None, build_directory=None, since=None, begun=None):
        seen.append((spec, call))
        return Unpublished(), None

    monkeypatch.setattr(compat, "_get_and_import", capture)
    args = dict(cpp_sources=[C_SRC], cuda_sources=["__global__ void k() {}"], functions={"value": "Doc."},
                extra_cflags=["-O1"], extra_cuda_cflags=["-O2"], extra_ldflags=["-lm"],
                extra_include_paths=["/opt/inc"], with_cuda=False, is_python_module=False,
                with_pytorch_error_handling=False, no_implicit_headers=True)
    forwarded = [f.name for f in FIELDS if f.torch and f.name != "name"]
    assert sorted(args) == sorted(forwarded)

    def full_path(*a, **k):  # what stubcache.load_inline hands to the full path, with no record to leave
        bound = inspect.signature(stubcache.load_inline).bind(*a, **k)
        bound.apply_defaults()
        return compat.load_inline_recording(None, dict(bound.arguments))

    full_path("fwd_probe", **args)
    spec, call = seen[-1]
    assert spec.to_dict() == StubSpec("fwd_probe", builder=None, **args).to_dict()
    assert len(call) == len(forwarded)
    # torch's default no_implicit_headers=False keeps the headers (the spec's None would decide)
    full_path("fwd_probe2", C_SRC, is_python_module=False)
    assert seen[-1][0].no_implicit_headers is False


_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}\Z")  # the rule names and function names had to match


@settings(max_examples=3000, deadline=None)
@given(st.one_of(st.text(max_size=102), st.text("aZ_09é\u0131\u212a\n", max_size=102),
                 st.from_regex(_NAME_RE, fullmatch=True)))
def test_names_follow_the_regex_they_replaced(text):
    assert _is_c_name(text) == bool(_NAME_RE.match(text))
