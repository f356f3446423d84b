"""Key soundness, the long tail (issue 19): each test closes one class of hole, with the
protocol of tests/test_key_soundness.py (build -> change -> a fresh process loads the new
behaviour -> revert -> the old entry hits again without a compile)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from stubcache import StubCache, StubSpec

from .conftest import run_py
from .test_key_soundness import child, cycle, value_src


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --- class 1: paths as the compiler resolves them -------------------------------------------


def test_paths_through_a_symlink_and_dotdot_are_tracked_as_the_kernel_resolves_them(cache_root, cxx, tmp_path):
    """``-I p/link`` (link -> A/inc) and ``inc/h.h`` doing ``#include "../x.h"``: gcc opens
    ``p/link/../x.h``, which is ``A/x.h``, not ``p/x.h`` (a decoy here). Likewise an include path
    ``p/current/../shared`` with ``current`` a symlink. Collapsing ``..`` on paper hashed the
    decoy (a stale hit) or a missing file (never published: a private build forever)."""
    p = tmp_path / "p"
    _write(p / "A" / "inc" / "h.h", '#include "../x.h"\n')
    real = p / "A" / "x.h"
    _write(real, "#define VAL 1\n")
    _write(p / "x.h", "#define VAL 9\n")  # what normpath("p/link/../x.h") names
    (p / "link").symlink_to("A/inc")
    spec = {"name": "kpath_link", "cpp_sources": value_src('#include "h.h"'), "extra_cflags": [f"-I{p}/link"]}
    cycle(cxx, spec, lambda: real.write_text("#define VAL 2\n"), lambda: real.write_text("#define VAL 1\n"))

    # Re-pointing the link is a change too: B/x.h is what the compiler reads now.
    _write(p / "B" / "inc" / "h.h", '#include "../x.h"\n')
    _write(p / "B" / "x.h", "#define VAL 3\n")

    def point(target: str):
        def go():
            (p / "link").unlink()
            (p / "link").symlink_to(target)
        return go

    cycle(cxx, spec, point("B/inc"), point("A/inc"), new_value=3)

    shared = p / "A" / "shared" / "s.h"
    _write(shared, "#define VAL 1\n")
    _write(p / "shared" / "s.h", "#define VAL 9\n")  # what abspath("p/current/../shared") names
    (p / "A" / "v1").mkdir()
    (p / "current").symlink_to("A/v1")
    spec = {"name": "kpath_inc", "cpp_sources": value_src('#include "s.h"'),
            "extra_include_paths": [f"{p}/current/../shared"]}
    assert StubSpec(**spec).extra_include_paths == (f"{p}/current/../shared",)
    cycle(cxx, spec, lambda: shared.write_text("#define VAL 2\n"), lambda: shared.write_text("#define VAL 1\n"))
    entry = StubCache().lookup(StubSpec(**spec))
    assert entry is not None and f"{p}/current/../shared/s.h" in entry.manifest.headers
    assert f"{p}/current/../shared" in entry.manifest.inputs["search"], "the search order is recorded"


# --- class 4: dependency-file syntax ----------------------------------------------------------

# Every character a Linux file name may hold that make's syntax escapes or that might confuse a
# parser: gcc writes "$" as "$$", escapes " ", "\t" and "#", leaves ":" "%" "\" as they are.
EXPRESSIBLE = ["sp ace", "dol$lar", "two$$dollars", "ha#sh", "co:lon", "pct%p", "bs\\x", "bs\\ sp", "bs\\#h",
               "tab\tt", "quo'te", "uni\u20ac", "bad\udcffbyte", "semi;colon", "star*q?"]
# What no dependency file can say unambiguously: a line break; a name ending in a backslash.
UNEXPRESSIBLE = ["new\nline", "ends\\"]


def test_header_names_with_every_special_character_are_tracked(cache_root, cxx, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    paths = []
    for i, name in enumerate(EXPRESSIBLE):
        path = os.path.join(os.fsencode(inc), os.fsencode(name + ".h"))
        with open(path, "wb") as fh:
            fh.write(f"#define V{i} 1\n".encode())
        paths.append(path)
    includes = "".join(f"#include <{n}.h>\n" for n in EXPRESSIBLE)
    total = " + ".join(f"V{i}" for i in range(len(EXPRESSIBLE)))
    spec = {"name": "depsyntax", "cpp_sources": includes + f'extern "C" int value(void) {{ return {total}; }}\n',
            "extra_include_paths": [str(inc)]}
    v, k0, _ = child(spec)
    assert v == len(EXPRESSIBLE)
    entry = StubCache().lookup(StubSpec(**spec))
    assert entry is not None, "every one of these names can be tracked: the entry is published"
    for path in paths:
        assert os.fsdecode(path) in entry.manifest.headers, os.fsdecode(path)
    for i, path in enumerate(paths):
        with open(path, "wb") as fh:
            fh.write(f"#define V{i} 2\n".encode())
        v, _, _ = child(spec)
        assert v == len(EXPRESSIBLE) + i + 1, f"editing {EXPRESSIBLE[i]!r} was not seen"
    for i, path in enumerate(paths):
        with open(path, "wb") as fh:
            fh.write(f"#define V{i} 1\n".encode())
    n = cxx.compiles()
    assert child(spec)[:2] == (len(EXPRESSIBLE), k0) and cxx.compiles() == n, "reverting hits the first entry"


@pytest.mark.parametrize("name", UNEXPRESSIBLE, ids=["newline", "trailing-backslash"])
def test_a_name_the_dependency_file_cannot_express_is_never_published(cache_root, cxx, tmp_path, name):
    """gcc writes a line break in a name as is, and a trailing backslash undoubled: the file
    read cannot be named for certain. The build loads but is never published, so an edit is
    always seen (a private build each time), never a stale hit. Nothing changed during it, so
    it is not built again: one compile per process (three before: the build, a retry after the
    clock slack, a private build), and the library this compile made is the one loaded."""
    import json

    header = tmp_path / name
    header.write_text("#define VAL 1\n")
    if name.endswith("\\"):  # a decoy where the name read without its backslash points
        (tmp_path / name[:-1]).write_text("#define VAL 99\n")
    spec = {"name": "unexpressed", "cpp_sources": value_src(), "extra_cflags": ["-include", str(header)]}
    n = cxx.compiles()
    assert child(spec)[0] == 1
    assert cxx.compiles() == n + 1
    assert StubCache().lookup(StubSpec(**spec)) is None
    header.write_text("#define VAL 2\n")
    assert child(spec)[0] == 2
    assert cxx.compiles() == n + 2
    events = [json.loads(line) for f in (cache_root / "v1" / "events").iterdir() for line in f.read_text().splitlines()]
    assert [e.get("reason") for e in events if e["ev"] == "private_build"] == ["a file the build read cannot be named"] * 2
    assert not [e for e in events if e["ev"] == "unstable_inputs"]


# --- class 5: a library that cannot load is a failed build ------------------------------------

UNDEFINED_SRC = 'extern "C" int g(void);\nextern "C" int value(void) { return g() + 1; }\n'


def test_a_library_with_an_undefined_symbol_is_a_build_error_and_never_published(cache_root, cxx, tmp_path):
    """It links (``-shared`` allows undefined symbols) and would fail every load, forever: the
    build fails with the loader's message, nothing is published, the failure is recorded like a
    compile error's (for the processes waiting on the build), and linking what defines it builds."""
    from stubcache import BuildError

    spec = StubSpec("undef", UNDEFINED_SRC)
    with pytest.raises(BuildError, match="undefined symbol: g") as info:
        StubCache().get_or_build(spec)
    assert info.value.key and StubCache().lookup(spec) is None
    failures = list((cache_root / "v1" / "failures").iterdir())
    assert len(failures) == 1 and "undefined symbol: g" in failures[0].read_text()
    # A later process gets the same error (it retries the build: the failure is not cached).
    n = cxx.compiles()
    out = run_py("""
        import stubcache
        from stubcache import StubCache
        spec = stubcache.StubSpec("undef", 'extern "C" int g(void);\\nextern "C" int value(void) { return g() + 1; }\\n')
        try:
            StubCache().get_or_build(spec)
        except stubcache.BuildError as exc:
            print("BuildError", "undefined symbol: g" in str(exc))
    """).stdout.split()
    assert out == ["BuildError", "True"]
    assert cxx.compiles() <= n + 1
    # Linking the library that defines it is a good build.
    lib = tmp_path / "libg.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(lib)], input=b"int g(void) { return 41; }",
                   check=True)
    good = StubSpec("undef", UNDEFINED_SRC, extra_ldflags=[str(lib), f"-Wl,-rpath,{tmp_path}"])
    cache = StubCache()
    assert cache.load_entry(cache.get_or_build(good)).value() == 42


def test_symbols_the_loading_python_provides_are_not_undefined(cache_root, tmp_path):
    """An extension module leaves the interpreter's symbols undefined: that loads."""
    src = 'extern "C" int Py_IsInitialized(void);\nextern "C" int value(void) { return Py_IsInitialized(); }\n'
    cache = StubCache()
    assert cache.load_entry(cache.get_or_build(StubSpec("pysym", src))).value() == 1


# --- class 3: a compiler cache's own configuration --------------------------------------------

# A stand-in for ccache where none is installed: it picks the compiler as ccache does
# (CCACHE_COMPILER, else `compiler =` in $CCACHE_CONFIGPATH or $CCACHE_DIR/ccache.conf, else
# the next word) and runs CCACHE_PREFIX in front of it.
FAKE_CCACHE = r"""#!/bin/sh
compiler="$CCACHE_COMPILER"
conf="${CCACHE_CONFIGPATH:-$CCACHE_DIR/ccache.conf}"
if [ -z "$compiler" ] && [ -f "$conf" ]; then
  compiler=$(sed -n 's/^ *compiler *= *//p' "$conf" | tail -n 1)
fi
first="$1"; shift
[ -n "$compiler" ] || compiler="$first"
exec $CCACHE_PREFIX "$compiler" "$@"
"""

WRAPPED_SRC = ("#if defined(BUMP)\n#define VAL 3\n#elif defined(__clang__)\n#define VAL 2\n#else\n#define VAL 1\n#endif\n"
               + value_src())


@pytest.mark.skipif(shutil.which("clang++") is None or shutil.which("g++") is None, reason="needs g++ and clang++")
@pytest.mark.parametrize("wrapper", ["ccache", "stand-in"])
def test_a_compiler_cache_choosing_another_compiler_changes_the_key(cache_root, tmp_path, monkeypatch, wrapper):
    """``CXX="ccache g++"``: ``CCACHE_COMPILER``, ``compiler =`` in ccache.conf and
    ``CCACHE_PREFIX`` change what runs; the key follows the compiler that the wrapper really
    runs (probed through it), and going back hits the first entry again."""
    if wrapper == "ccache":
        ccache = os.environ.get("STUBCACHE_TEST_CCACHE") or shutil.which("ccache")
        if not ccache:
            pytest.skip("needs ccache (or STUBCACHE_TEST_CCACHE naming one)")
        tool = tmp_path / "bin" / "ccache"
        tool.parent.mkdir()
        tool.symlink_to(ccache)
    else:
        tool = tmp_path / "bin" / "ccache"
        tool.parent.mkdir()
        tool.write_text(FAKE_CCACHE)
        tool.chmod(0o755)
    ccdir = tmp_path / "ccache-dir"
    ccdir.mkdir()
    monkeypatch.setenv("CXX", f"{tool} g++")
    monkeypatch.setenv("CCACHE_DIR", str(ccdir))
    for var in ("CCACHE_COMPILER", "CCACHE_PREFIX", "CCACHE_CONFIGPATH"):
        monkeypatch.delenv(var, raising=False)
    spec = {"name": "wrapped", "cpp_sources": WRAPPED_SRC}
    v1, k1, _ = child(spec)
    assert v1 == 1
    v2, k2, _ = child(spec, {"CCACHE_COMPILER": "clang++"})
    assert (v2 == 2) and k2 != k1, "CCACHE_COMPILER chose clang++: a new key"
    assert child(spec)[:2] == (1, k1)

    conf = ccdir / "ccache.conf"
    conf.write_text("compiler = clang++\n")
    v3, k3, _ = child(spec)
    assert v3 == 2 and k3 == k2, "ccache.conf chose clang++: the key of clang++"
    conf.unlink()
    assert child(spec)[:2] == (1, k1)

    prefix = tmp_path / "prefix.sh"
    prefix.write_text('#!/bin/sh\nexec "$@" -DBUMP\n')
    prefix.chmod(0o755)
    v4, k4, _ = child(spec, {"CCACHE_PREFIX": str(prefix)})
    assert v4 == 3 and k4 not in (k1, k2), "a prefix command that adds a flag: its own key"
    assert child(spec)[:2] == (1, k1)


@pytest.mark.skipif(shutil.which("clang++") is None or shutil.which("g++") is None, reason="needs g++ and clang++")
def test_a_compiler_cache_configured_in_another_home_changes_the_key(cache_root, tmp_path, monkeypatch):
    """``CXX="ccache g++"`` with ccache's directory in ``$HOME`` (no ``CCACHE_DIR``): a process
    whose HOME holds ``compiler = clang++`` runs clang++, so it must not take the entry built
    under a HOME without that file (found by review: the fingerprint memo was not keyed by HOME)."""
    tool = tmp_path / "bin" / "ccache"
    tool.parent.mkdir()
    tool.write_text(FAKE_CCACHE.replace('conf="${CCACHE_CONFIGPATH:-$CCACHE_DIR/ccache.conf}"',
                                        'conf="${CCACHE_CONFIGPATH:-${CCACHE_DIR:-$HOME/.ccache}/ccache.conf}"'))
    tool.chmod(0o755)
    plain, configured = tmp_path / "home-plain", tmp_path / "home-clang"
    plain.mkdir()
    (configured / ".ccache").mkdir(parents=True)
    (configured / ".ccache" / "ccache.conf").write_text("compiler = clang++\n")
    monkeypatch.setenv("CXX", f"{tool} g++")
    for var in ("CCACHE_DIR", "CCACHE_COMPILER", "CCACHE_PREFIX", "CCACHE_CONFIGPATH", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(var, raising=False)
    spec = {"name": "wrapped_home", "cpp_sources": WRAPPED_SRC}
    v1, k1, _ = child(spec, {"HOME": str(plain)})
    assert v1 == 1
    v2, k2, _ = child(spec, {"HOME": str(configured)})
    assert v2 == 2 and k2 != k1, "the other HOME's ccache.conf chose clang++: a new key"
    assert child(spec, {"HOME": str(plain)})[:2] == (1, k1)


def test_a_build_by_another_compiler_than_the_key_names_is_not_published(cache_root, tmp_path, monkeypatch):
    """A wrapper whose choice stubcache cannot see (its own config file) switches compilers
    after the fingerprint was memoised: the build's own probe, run through the same wrapper,
    names the compiler that ran, and a build whose key names another is never published."""
    if shutil.which("clang++") is None:
        pytest.skip("needs clang++")
    choice = tmp_path / "choice"
    choice.write_text("clang++\n")
    script = tmp_path / "cxx-choose.sh"
    script.write_text(f'#!/bin/sh\nexec $(cat "{choice}") "$@"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    spec = {"name": "chosen", "cpp_sources": WRAPPED_SRC}
    v1, k1, _ = child(spec)
    assert v1 == 2
    choice.write_text("g++\n")  # the fingerprint memo cannot know
    spec2 = dict(spec, cpp_sources=WRAPPED_SRC + "// another source: a miss, built by g++\n")
    assert child(spec2)[0] == 1
    assert StubCache().lookup(StubSpec(**spec2)) is None, "published under a key that names clang++"


# --- class 2: every flag list that reaches the compiler ---------------------------------------


def test_every_flag_list_that_reaches_the_compiler_is_scanned(cache_root, cxx, tmp_path):
    """On the direct path compile and link are one command: ``-I`` in ``extra_ldflags``
    searches for headers (a header appearing earlier on that list shadows), ``-march=native``
    there generates code for this CPU (its resolved target is in the key), and ``-Wl,-L``/
    ``-Wl,-l`` pick libraries (a library appearing earlier on that list shadows)."""
    from .test_key_tracked_inputs import DEP_SRC, _archive

    first, second = tmp_path / "first", tmp_path / "second"
    _write(second / "val.h", "#define VAL 1\n")
    first.mkdir()
    shadow = first / "val.h"
    spec = {"name": "ld_includes", "cpp_sources": value_src('#include "val.h"'),
            "extra_ldflags": ["-I", str(first), f"-I{second}"]}
    cycle(cxx, spec, lambda: shadow.write_text("#define VAL 2\n"), shadow.unlink)

    native = StubSpec("ld_native", value_src("#define VAL 1"), extra_ldflags=["-march=native"])
    pre = StubCache().preimage(native)["fingerprint"]
    assert pre["native"]["target"] and all("native" not in t for t in pre["native"]["target"])
    through = StubSpec("ld_native", value_src("#define VAL 1"), extra_cflags=["-Xcompiler=-march=native"])
    assert through.host_targets == ("-march=native",)

    l1, l2 = tmp_path / "l1", tmp_path / "l2"
    l1.mkdir()
    l2.mkdir()
    _archive(tmp_path, l2 / "libdep.a", 1)
    spec = {"name": "wl_libs", "cpp_sources": DEP_SRC, "extra_ldflags": [f"-Wl,-L{l1}", f"-Wl,-L,{l2}", "-Wl,-ldep"]}
    cycle(cxx, spec, lambda: _archive(tmp_path, l1 / "libdep.a", 2), (l1 / "libdep.a").unlink)


def test_the_flag_scanner_reads_every_form():
    from stubcache.key.flagscan import scan

    found = scan(["-I", "/a", "-isystem/b", "-include", "/c.h", "-specs=/d.specs", "@/e.rsp", "-fplugin=/f.so",
                  "-B", "/g/", "-mtune=native"],
                 [], ["-idirafter", "/h", "-Wl,-L/i,-lj", "-Xlinker", "--library-path=/k", "-Wl,-T,/l.ld",
                      "-Wl,@/m.rsp", "-L/n", "-lo", "-Xcompiler", "-mcpu=native"])
    assert found.search == ("-I", "/a", "-isystem/b", "-idirafter", "/h")
    assert found.files == ("/c.h", "/d.specs", "/e.rsp", "/f.so", "/l.ld", "/m.rsp")
    assert found.tool_flags == ("-B", "/g/")
    assert found.host_targets == ("-mtune=native", "-mcpu=native")
    assert found.lib_dirs == ("/i", "/k", "/n") and found.lib_names == ("j", "o")


def test_a_specs_file_found_in_a_dash_b_directory_is_tracked(cache_root, cxx, tmp_path):
    """``-B DIR -specs=NAME``: gcc reads ``DIR/NAME``, named by no dependency output."""
    tools = tmp_path / "tools"
    tools.mkdir()
    specs = tools / "val.specs"
    specs.write_text("*cc1plus:\n+ -DVAL=1\n")
    spec = {"name": "b_specs", "cpp_sources": value_src(), "extra_cflags": [f"-B{tools}/", "-specs=val.specs"]}
    cycle(cxx, spec, lambda: specs.write_text("*cc1plus:\n+ -DVAL=2\n"),
          lambda: specs.write_text("*cc1plus:\n+ -DVAL=1\n"))


def test_a_header_shadowing_from_a_search_directory_named_in_no_encoding_misses(cache_root, cxx, tmp_path):
    """Found by the fuzzer: the compiler's ``-v`` search list was decoded with replacement
    characters, so a directory whose name is not UTF-8 matched no header, and a header
    appearing there (searched first) was no shadow candidate: a stale hit."""
    first = os.path.join(os.fsencode(tmp_path), b"first\xff$")
    second = tmp_path / "second"
    os.mkdir(first)
    _write(second / "val.h", "#define VAL 1\n")
    shadow = os.path.join(first, b"val.h")
    spec = {"name": "bytes_dir", "cpp_sources": value_src('#include "val.h"'),
            "extra_cflags": ["-I", os.fsdecode(first), "-I", str(second)]}

    def plant():
        with open(shadow, "wb") as fh:
            fh.write(b"#define VAL 2\n")

    class Count:  # the wrapper's log holds the flag's bytes
        def compiles(self) -> int:
            return len(cxx.log.read_bytes().splitlines()) if cxx.log.exists() else 0

    cycle(Count(), spec, plant, lambda: os.unlink(shadow))


def test_a_path_object_on_sys_path_does_not_break_a_load(cache_root):
    """A program may append a ``pathlib.Path`` to ``sys.path`` (importlib ignores it): the
    fingerprint memo and the hit must still work (both crashed on it: found by review)."""
    from .conftest import run_py

    code = """
        import ctypes, pathlib, sys, stubcache
        sys.path.append(pathlib.Path("/nonexistent"))
        path = stubcache.load_inline("pathobj", 'extern "C" int v(void) { return 6; }', is_python_module=False,
                                     no_implicit_headers=True)
        print(ctypes.CDLL(path).v())
    """
    for _ in range(2):  # a build, then a hit
        assert run_py(code).stdout.split() == ["6"]
