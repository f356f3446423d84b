"""The hit path's stand-in for json gives exactly json's answers, and a hit imports only what it
needs (no json, typing, re, torch, ...; docs/design.md "Stand-ins for standard modules")."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st

from stubcache.edge import cjson
from tests.conftest import REPO

SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=30)


def _same(a, b) -> bool:  # NaN != NaN: compare through json's own canonical text
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@settings(max_examples=300, deadline=None)
@given(VALUES, st.booleans(), st.sampled_from([None, (",", ":"), (", ", ": ")]), st.booleans())
def test_dumps_is_jsons(value, sort_keys, separators, ensure_ascii):
    kw = dict(sort_keys=sort_keys, separators=separators, ensure_ascii=ensure_ascii)
    assert cjson.dumps(value, **kw) == json.dumps(value, **kw)


@settings(max_examples=300, deadline=None)
@given(VALUES, st.sampled_from(["", " ", "\n\t "]))
def test_loads_is_jsons(value, pad):
    text = pad + json.dumps(value) + pad
    assert _same(cjson.loads(text), json.loads(text))
    assert _same(cjson.loads(text.encode()), json.loads(text.encode()))


@given(st.text(max_size=12) | st.binary(max_size=12))
def test_loads_fails_and_succeeds_like_json(data):
    def outcome(fn):
        try:
            return ("ok", json.dumps(fn(data), sort_keys=True))
        except Exception as exc:  # noqa: BLE001 - the very exception type and message are compared
            return (type(exc).__name__, str(exc))

    assert outcome(cjson.loads) == outcome(json.loads)


def test_malformed_json_raises_jsons_error_in_a_process_without_json():
    """_json's scanner makes its JSONDecodeError from json.decoder only if that is imported: in
    a hit's process it is not, and the error must still be json's own."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from stubcache.edge import cjson
        assert "json.decoder" not in sys.modules
        for bad in ('{{"a": 1', '[1,]', 'nul', '{{"a" 1}}', b'{{"a":', '[1 2]'):
            try:
                cjson.loads(bad)
            except ValueError as exc:
                print(type(exc).__module__, type(exc).__name__)
            else:
                raise SystemExit(f"{{bad!r}} parsed")
    """)
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:6] == ["json.decoder JSONDecodeError"] * 6


def test_dumps_errors_are_jsons():
    for bad in ({(1, 2): 1}, {"x": object()}, [math.inf, {1j: 0}]):
        errors = []
        for fn in (json.dumps, cjson.dumps):
            try:
                fn(bad)
                errors.append(None)
            except (TypeError, ValueError) as exc:
                errors.append((type(exc), str(exc)))
        assert errors[0] == errors[1]


def _filelock_only(tmp_path) -> str:
    """A directory holding only filelock (a link to the installed package), on both runs' path:
    the building run of a child without site-packages needs it for the build lock, and nothing
    else of site-packages (torch there would change the key). The hit must not import it."""
    import filelock

    d = tmp_path / "filelock-only"
    d.mkdir()
    (d / "filelock").symlink_to(os.path.dirname(filelock.__file__))
    return str(d)


def test_a_hit_imports_only_what_it_needs(cache_root, tmp_path):
    """In a child without site (-S: nothing preloaded, as in a venv without start-up files), the
    modules a hit adds to sys.modules."""
    src = 'extern "C" int f(void) { return 5; }'
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.extend(p for p in os.environ.get("TEST_BUILD_PATH", "").split(":") if p)
        before = set(sys.modules)
        import stubcache
        lib = stubcache.StubCache().load(stubcache.StubSpec('lean', {src!r}))
        assert lib.f() == 5
        print(" ".join(sorted(set(sys.modules) - before)))
    """)
    filelock_only = _filelock_only(tmp_path)
    for require_hit in ("", "", "1"):  # the first run builds it, the second leaves the hit record
        proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, STUBCACHE_REQUIRE_HIT=require_hit,
                                       TEST_BUILD_PATH=filelock_only))
        assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    # The compact hit path (stubcache.hit.front, stubcache.hit; docs/performance.md): the spec the
    # caller made, JSON without json (this process has none), nothing else.
    expected = HIT_MODULES | {"stubcache.hit.front", "stubcache.key"}
    assert {m for m in loaded if m.startswith("stubcache")} == expected, loaded
    heavy = {"json", "typing", "re", "enum", "logging", "subprocess", "shutil",
             "tempfile", "pathlib", "dataclasses", "signal", "importlib.util", "torch", "filelock",
             "stubcache.dropin.compat", "stubcache.dropin.patch", "stubcache.key.toolchain",
             "stubcache.build.builder", "stubcache.edge.progress", "stubcache.edge.faults", "stubcache.key.tracking",
             "stubcache.edge.log"}
    assert not loaded & heavy, loaded & heavy


# What a warm hit imports of stubcache: the compact hit path, and the stand-in for json in a
# process that has none (an engine process has it: then only the first three).
HIT_MODULES = {"stubcache", "stubcache.hit", "stubcache.edge", "stubcache.edge.cjson"}


def test_a_quiet_dropin_hit_imports_no_status_line_nor_logger(cache_root, tmp_path):
    """The drop-in's hit (is_python_module=False, a header-free stub, verbose off) loads the
    drop-in's own modules and the hit path, not the status line, the logger or the probes."""
    src = 'extern "C" int g(void) { return 7; }'
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        sys.path.extend(p for p in os.environ.get("TEST_BUILD_PATH", "").split(":") if p)
        before = set(sys.modules)
        import stubcache
        path = stubcache.load_inline('lean_dropin', {src!r}, is_python_module=False, no_implicit_headers=True)
        import ctypes
        assert ctypes.CDLL(path).g() == 7
        print(" ".join(sorted(set(sys.modules) - before)))
    """)
    filelock_only = _filelock_only(tmp_path)
    for require_hit in ("", "", "1"):  # the first run builds it, the second leaves the hit record
        proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, STUBCACHE_REQUIRE_HIT=require_hit,
                                       TEST_BUILD_PATH=filelock_only))
        assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    # the drop-in's front is the package module's own load_inline: nothing but the hit path
    assert {m for m in loaded if m.startswith("stubcache")} == HIT_MODULES, loaded
    heavy = {"json", "typing", "re", "logging", "subprocess", "torch", "filelock",
             "stubcache.edge.progress", "stubcache.edge.log", "stubcache.key.toolchain", "stubcache.build.builder",
             "stubcache.key.tracking", "stubcache.edge.faults"}
    assert not loaded & heavy, loaded & heavy


def test_a_build_logs_its_phases_without_importing_logging(cache_root, tmp_path):
    """A build's DEBUG phase lines (docs/operations.md) cost a process that never imported
    ``logging`` nothing, not its import; with the logger at DEBUG they come in order."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        if sys.argv[1] == "debug":
            import logging
            logging.basicConfig(format="%(message)s")
            logging.getLogger("stubcache").setLevel(logging.DEBUG)
        import stubcache
        stubcache.load_inline(sys.argv[2], 'extern "C" int g(void) {{ return 8; }}', is_python_module=False,
                              no_implicit_headers=True)
        print("logging" in sys.modules)
    """)
    quiet = subprocess.run([sys.executable, "-S", "-c", code, "quiet", "built_quietly"], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, TEST_BUILD_PATH=_filelock_only(tmp_path)))
    assert quiet.returncode == 0 and quiet.stdout.split() == ["False"], quiet.stderr
    assert quiet.stderr == ""
    loud = subprocess.run([sys.executable, "-c", code, "debug", "built_loudly"], capture_output=True, text=True,
                          timeout=120)
    assert loud.returncode == 0, loud.stderr
    lines = [line[len("stubcache: built_loudly: "):] for line in loud.stderr.splitlines()
             if line.startswith("stubcache: built_loudly: ")]
    starts = ["not in the cache (key ", "compiling (direct build)", "2 inputs tracked while the compiler runs",
              "compiled in ", "inputs tracked and load checked in ", "published as "]
    assert len(lines) == len(starts) and all(a.startswith(b) for a, b in zip(lines, starts)), loud.stderr
