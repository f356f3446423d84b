"""A miss's compile begun by the compact path before the full path is imported
(stubcache.hit.early), in real processes with the real compiler: a new plain stub in a root that
has built starts compiling before its lookup and that compile is the build; one the lookup does
not need, or whose command is not the build's, is stopped with every program it started; a
start template is trusted as a hit record is, and read only where a miss may build."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import run_py

CALL = """
import ctypes, logging, os, stubcache
%s
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("%%(message)s"))
logging.getLogger("stubcache").addHandler(handler)
logging.getLogger("stubcache").setLevel(logging.DEBUG)
path = stubcache.load_inline(%r, 'extern "C" int v(void) { return %s; }', is_python_module=False,
                             no_implicit_headers=True%s)
print(ctypes.CDLL(path).v())
"""
EARLY = "compiling (direct build, started before the lookup)"
# The sleep's argument names this test process's sleepers: CI runs two test sessions side by side.
SLEEP = f"47.{os.getpid() % 10000:04d}1"


# Holds the full path back until the compile the compact path began has started (the CXX wrapper
# made STUBCACHE_TEST_CXX_MARK): whatever the full path then does to it, it had begun.
AFTER_THE_START = """
import time
from stubcache.dropin import compat
_full_path = compat.load_inline_recording
def _after_the_start(*a, **k):
    t = time.monotonic()
    while not os.path.exists(os.environ["STUBCACHE_TEST_CXX_MARK"]) and time.monotonic() - t < 60:
        time.sleep(0.01)
    return _full_path(*a, **k)
compat.load_inline_recording = _after_the_start
"""


def _call(name: str, value: int, extra: str = "", env: dict | None = None, check: bool = True, pre: str = ""):
    return run_py(CALL % (pre, name, value, extra), env=env, check=check)


def _template(root: Path) -> Path:
    (path,) = (root / "v1" / "state").glob("start-*.json")
    return path


def _staging(root: Path) -> list[str]:
    d = root / "v1" / "staging"
    return sorted(os.listdir(d)) if d.exists() else []


def _sleepers() -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline[:1] == [b"sleep"] and SLEEP.encode() in cmdline:
            found.append(int(pid))
    return found


def test_a_new_plain_stub_in_a_root_that_has_built_compiles_before_its_lookup(cache_root, cxx):
    assert _call("first", 1).stdout.split() == ["1"]
    template = json.loads(_template(cache_root).read_text())
    assert template["format"] == 1 and template["cmd"][0] == str(cxx.path)
    proc = _call("second", 2)
    assert proc.stdout.split() == ["2"]
    assert EARLY in proc.stderr, proc.stderr
    assert cxx.compiles() == 2  # the early compile is the build: no second one
    assert _staging(cache_root) == []
    # ... and what it built is an entry like any other: the next process hits it.
    again = _call("second", 2)
    assert again.stdout.split() == ["2"] and "compiling" not in again.stderr and cxx.compiles() == 2


def test_an_early_compile_the_lookup_does_not_need_is_stopped_whole(cache_root, cxx, tmp_path):
    # The entry is there but the call's hit record is not (removed): the compact path starts the
    # compile, the lookup finds the entry by key, and the compile (sleeping in the wrapper, in
    # the driver's session) is killed whole; the process does not wait for it.
    assert _call("kept", 3).stdout.split() == ["3"]
    for record in (cache_root / "v1" / "state").glob("hit-*.json"):
        record.unlink()
    t0 = time.monotonic()
    proc = _call("kept", 3, env={"STUBCACHE_TEST_CXX_SLEEP": SLEEP, "STUBCACHE_TEST_CXX_MARK": str(tmp_path / "m")},
                 pre=AFTER_THE_START)
    assert time.monotonic() - t0 < 30
    assert proc.stdout.split() == ["3"] and "compiling" not in proc.stderr, proc.stderr
    assert cxx.compiles() == 2  # it did start (the wrapper logged it) ...
    assert _sleepers() == []  # ... and nothing it started outlives the call
    assert _staging(cache_root) == []


def test_a_verbose_call_leaves_the_record_so_the_same_call_after_it_begins_no_compile(cache_root, cxx):
    # A verbose call (an engine's first rank, say) builds the stub; the same call without
    # ``verbose`` in the next process must find its record, not begin a compile that the lookup
    # then finds needless (tests/test_engines.py's NCCL pattern caught that: two compiles).
    assert _call("first", 1).stdout.split() == ["1"]  # a root that has built: a template
    loud = _call("loud", 4, extra=", verbose=True")
    assert loud.stdout.split()[-1] == "4" and "loading extension module loud" in loud.stdout, loud.stdout
    assert cxx.compiles() == 2 and EARLY not in loud.stderr  # (a verbose call begins none itself)
    quiet = _call("loud", 4)
    assert quiet.stdout.split() == ["4"] and "compiling" not in quiet.stderr, quiet.stderr
    assert cxx.compiles() == 2  # no compile begun and killed
    again = _call("loud", 4, extra=", verbose=True")  # still shows what it loads, record or not
    assert "loading extension module loud" in again.stdout and cxx.compiles() == 2


def test_a_call_whose_record_is_there_but_stale_begins_no_compile(cache_root, cxx):
    # The record no longer answers (a validator moved: here its recorded size): the key most
    # likely still hits, so no compile is begun only to be killed.
    assert _call("kept", 3).stdout.split() == ["3"]
    (record,) = (cache_root / "v1" / "state").glob("hit-*.json")
    data = json.loads(record.read_text())
    row = next(row for row in data["validators"] if row[1] is not None)
    row[1][2] += 1  # [path, [dev, ino, size, mtime, ctime]]
    record.write_text(json.dumps(data))
    proc = _call("kept", 3)
    assert proc.stdout.split() == ["3"] and "compiling" not in proc.stderr, proc.stderr
    assert cxx.compiles() == 1
    assert json.loads(record.read_text()) != data  # the full path left a fresh one


def test_the_start_template_is_left_after_the_calls_record(cache_root, cxx):
    # A process that sees the template of a build that served its very call must see that
    # call's record too (early.begin then begins nothing): the full path writes them in that order.
    order = """
from stubcache.cache import core
_record, _state = core.write_hit_record, core.write_state_file
core.write_hit_record = lambda *a: (print("RECORD", flush=True), _record(*a))[1]
core.write_state_file = lambda root, name, data: (print("STATE", name.split("-")[0], flush=True), _state(root, name, data))[1]
"""
    proc = _call("first", 1, pre=order)
    assert proc.stdout.split() == ["RECORD", "STATE", "start", "1"], proc.stdout


def test_an_early_compile_whose_command_is_not_the_builds_is_stopped_and_the_build_runs(cache_root, cxx, tmp_path):
    # The template names another program (a wrapper that sleeps, then compiles): the full path
    # stops it, with what it started, and builds with its own command in a directory emptied of
    # anything the stopped compile wrote.
    assert _call("first", 1).stdout.split() == ["1"]
    path = _template(cache_root)
    other = tmp_path / "other-cxx.sh"
    other.write_text(f"#!/bin/sh\n: > {tmp_path / 'm'}\nsleep {SLEEP}\nexec {cxx.path} \"$@\"\n")
    other.chmod(0o755)
    data = json.loads(path.read_text())
    data["cmd"][0] = str(other)
    path.write_text(json.dumps(data))
    t0 = time.monotonic()
    proc = _call("second", 2, env={"STUBCACHE_TEST_CXX_MARK": str(tmp_path / "m")}, pre=AFTER_THE_START)
    assert time.monotonic() - t0 < 30
    assert proc.stdout.split() == ["2"]
    assert EARLY not in proc.stderr and "compiling (direct build)" in proc.stderr, proc.stderr
    assert cxx.compiles() == 2  # the build's own (the other program never reached the wrapper)
    assert _sleepers() == []
    assert _staging(cache_root) == []


def test_environments_that_differ_in_a_key_variable_keep_a_template_each(cache_root, cxx):
    # LANG set in one environment and not in the other (a shell and a service): each one's
    # second stub starts early, whichever built last.
    with_lang, without = {"LANG": "C.UTF-8"}, {"LANG": ""}
    assert _call("a1", 1, env=with_lang).stdout.split() == ["1"]
    assert _call("b1", 1, env=without).stdout.split() == ["1"]
    assert EARLY in _call("a2", 2, env=with_lang).stderr
    assert EARLY in _call("b2", 2, env=without).stderr
    assert len(list((cache_root / "v1" / "state").glob("start-*.json"))) == 2


def test_an_early_compile_that_fails_is_the_builds_failure(cache_root, cxx):
    assert _call("first", 1).stdout.split() == ["1"]
    code = CALL % ("", "broken", "nope", "")  # 'return nope;': not declared
    proc = run_py("import stubcache\ntry:\n" + textwrap.indent(code, "    ")
                  + "\nexcept stubcache.BuildError as e:\n    print('BuildError', e.name, 'nope' in e.output and 'error' in e.output)\n")
    assert proc.stdout.split() == ["BuildError", "broken", "True"], proc.stdout
    assert EARLY in proc.stderr, proc.stderr
    assert _staging(cache_root) == []


def _marker_template(path: Path, marker: Path) -> dict:
    # A template whose "compiler" leaves a marker: whether it ran at all.
    data = json.loads(path.read_text())
    data["cmd"] = ["/bin/sh", "-c", f": > {marker}"]
    return data


@pytest.mark.parametrize("how", ["private", "group-writable", "symlink", "fifo", "garbage", "huge", "not-a-list"])
def test_a_template_is_trusted_as_a_hit_record_is(cache_root, cxx, tmp_path, how):
    assert _call("first", 1).stdout.split() == ["1"]
    path = _template(cache_root)
    marker = tmp_path / "ran"
    data = _marker_template(path, marker)
    text = json.dumps(data)
    path.unlink()
    if how == "symlink":
        elsewhere = tmp_path / "template.json"
        elsewhere.write_text(text)
        elsewhere.chmod(0o600)
        path.symlink_to(elsewhere)
    elif how == "fifo":
        os.mkfifo(path, 0o600)
    else:
        if how == "garbage":
            text = text[:-3]
        elif how == "huge":
            text = json.dumps(dict(data, pad="x" * (70 << 10)))
        elif how == "not-a-list":
            text = json.dumps(dict(data, cmd={"argv": data["cmd"]}))
        path.write_text(text)  # "private" (the control: a template this user wrote is run)
        path.chmod(0o664 if how == "group-writable" else 0o600)
    proc = _call("second", 2)
    assert proc.stdout.split() == ["2"] and "compiling (direct build)" in proc.stderr, proc.stderr
    assert marker.exists() == (how == "private"), how
    assert _staging(cache_root) == []


@pytest.mark.parametrize("case", ["require-hit", "flags", "long-name"])
def test_no_early_compile_where_a_miss_may_not_build_or_the_call_is_not_plain(cache_root, cxx, tmp_path, case):
    assert _call("first", 1).stdout.split() == ["1"]
    path = _template(cache_root)
    marker = tmp_path / "ran"
    path.write_text(json.dumps(_marker_template(path, marker)))
    if case == "require-hit":
        proc = _call("second", 2, env={"STUBCACHE_REQUIRE_HIT": "1"}, check=False)
        assert proc.returncode != 0 and "CacheMissError" in proc.stderr, proc.stderr
    elif case == "flags":
        assert _call("second", 2, ", extra_cflags=['-O1']").stdout.split() == ["2"]
    else:  # an identifier the spec refuses (over 100 characters): nothing runs before it says so
        proc = _call("n" * 101, 2, check=False)
        assert proc.returncode != 0 and "invalid stub name" in proc.stderr, proc.stderr
    assert not marker.exists(), case
    assert _staging(cache_root) == []


def test_only_a_plain_calls_source_is_compiled_early():
    from stubcache.hit.early import plain_source

    call = dict(name="s", cpp_sources=["int a;", "int b;"], cuda_sources=None, functions=None, extra_cflags=None,
                extra_cuda_cflags=None, extra_ldflags=None, extra_include_paths=None, with_cuda=None,
                no_implicit_headers=True, verbose=False)
    assert plain_source(call) == "int a;\nint b;"  # main.cpp, as the build writes it
    assert plain_source(dict(call, cpp_sources="int a;")) == "int a;"
    for change in ({"no_implicit_headers": None}, {"no_implicit_headers": False}, {"verbose": True}, {"functions": ["f"]},
                   {"extra_cflags": ["-O1"]}, {"extra_ldflags": ["-lm"]}, {"extra_include_paths": ["/x"]},
                   {"cuda_sources": ["x"]}, {"with_cuda": True}, {"cpp_sources": []}, {"cpp_sources": [3]},
                   {"cpp_sources": ["int \u00e9;"]}, {"cpp_sources": ["// uses at::Tensor\n"]},
                   {"cpp_sources": ["#include <torch/all.h>\n"]}):
        assert plain_source(dict(call, **change)) is None, change


def test_a_templates_command_is_the_builds_own(tmp_path):
    # For a build directory named through a symlink too (its prefix map then has both names).
    from stubcache.build import buildinputs, builder
    from stubcache.hit.early import StartTemplate
    from stubcache.key import StubSpec

    facts = buildinputs.compiler_facts()
    template = StartTemplate.from_dict(StartTemplate(builder.start_template(facts), [], None).to_dict())
    assert template is not None
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    spec = StubSpec("plain_stub", 'extern "C" int v(void) { return 1; }', no_implicit_headers=True)
    for build_dir in (str(real), str(tmp_path / "link")):
        want = builder._command_in(spec, build_dir, facts, buildinputs.python_include_early())
        assert template.command("plain_stub", build_dir) == want
    assert len([w for w in template.command("plain_stub", str(tmp_path / "link")) if "prefix-map" in w]) == 2


@pytest.mark.parametrize("data", [
    None, [], {"format": 2, "cmd": ["c++"], "env": [], "torch": None},
    {"format": 1, "cmd": [], "env": [], "torch": None},
    {"format": 1, "cmd": ["c++", 3], "env": [], "torch": None},
    {"format": 1, "cmd": ["c++", "a\0b"], "env": [], "torch": None},
    {"format": 1, "cmd": ["c++"] * 300, "env": [], "torch": None},
    {"format": 1, "cmd": ["c++"], "env": [["CXX"]], "torch": None},
    {"format": 1, "cmd": ["c++"], "env": [], "torch": 3},
])
def test_a_malformed_template_is_refused(data):
    from stubcache.hit.early import StartTemplate

    assert StartTemplate.from_dict(data) is None


def test_a_staging_directory_that_is_a_link_gets_no_early_compile_and_nothing_outside(cache_root, cxx, tmp_path):
    # v1/staging replaced by a link to a directory outside the root: the compact path opens it
    # without following (no compile starts there), and nothing appears outside.
    assert _call("first", 1).stdout.split() == ["1"]
    path = _template(cache_root)
    marker = tmp_path / "ran"
    path.write_text(json.dumps(_marker_template(path, marker)))
    outside = tmp_path / "outside"
    outside.mkdir()
    staging = cache_root / "v1" / "staging"
    for child in staging.iterdir():
        child.rmdir()
    staging.rmdir()
    staging.symlink_to(outside)
    _call("second", 2, check=False)
    assert not marker.exists()
    assert list(outside.iterdir()) == []
