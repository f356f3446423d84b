"""Key soundness (docs/design.md, invariant 10), one class of input at a time, with real compiles in
fresh processes: build -> change the input -> a new process loads the new behaviour -> revert
-> the old entry hits again (no compile)."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from stubcache import StubCache, StubSpec

from .conftest import run_py

CHILD = """
import json, os, stubcache
kw = json.loads(os.environ["SPEC"])
spec = stubcache.StubSpec(**kw)
cache = stubcache.StubCache()
e = cache.get_or_build(spec)
print(cache.load_entry(e).value(), e.key, e.path)
"""


def child(spec_kw: dict, env: dict | None = None) -> tuple[int, str, str]:
    import json

    out = run_py(CHILD, env={"SPEC": json.dumps(spec_kw), **(env or {})}).stdout.split()
    return int(out[0]), out[1], out[2]


def value_src(include: str = "") -> str:
    return f'{include}\nextern "C" int value(void) {{ return VAL; }}\n'


def cycle(cxx, spec_kw: dict, change, revert, env=None, new_value: int = 2, old_value: int = 1) -> None:
    """The whole protocol: build, change, new process sees it, revert, old entry hits."""
    v1, k1, _ = child(spec_kw, env)
    assert v1 == old_value
    n = cxx.compiles()
    change()
    v2, k2, _ = child(spec_kw, env)
    assert v2 == new_value, "a fresh process loaded the old library after the input changed"
    assert k2 != k1 and cxx.compiles() == n + 1
    revert()
    v3, k3, _ = child(spec_kw, env)
    assert (v3, k3) == (old_value, k1) and cxx.compiles() == n + 1, "reverting must hit the old entry"


# --- class 8: a spec cannot change after use ---------------------------------------------------


def test_spec_is_immutable(cache_root):
    spec = StubSpec("imm", value_src("#define VAL 1"))
    key = StubCache().key(spec)
    with pytest.raises(AttributeError, match="immutable"):
        spec.cpp_sources = (value_src("#define VAL 2"),)
    with pytest.raises(AttributeError):
        del spec.name
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(spec)) == spec and copy.deepcopy(spec) == spec
    changed = spec.replace(cpp_sources=value_src("#define VAL 2"))
    assert StubCache().key(spec) == key and StubCache().key(changed) != key


# --- class 1: headers from anywhere the fingerprint does not pin --------------------------------


@pytest.mark.parametrize("how", ["isystem", "idirafter", "include", "imacros", "cpath", "cplus_include_path",
                                 "absolute", "usr_include"])
def test_untracked_header_locations_are_tracked(cache_root, cxx, tmp_path, how):
    d = tmp_path / "sys"
    d.mkdir()
    name = "soundness_val.h"
    env = {}
    if how == "usr_include":
        d = Path("/usr/include")
        name = f"stubcache_soundness_{os.getpid()}.h"
        if not os.access(d, os.W_OK):
            pytest.skip("needs a writable /usr/include (root)")
    header = d / name
    header.write_text("#define VAL 1\n")
    try:
        inc, flags = f"#include <{name}>", []
        if how == "isystem":
            flags = ["-isystem", str(d)]
        elif how == "idirafter":
            flags = ["-idirafter", str(d)]
        elif how in ("include", "imacros"):
            inc, flags = "", [f"-{how}", str(header)]
        elif how == "cpath":
            env = {"CPATH": str(d)}
        elif how == "cplus_include_path":
            env = {"CPLUS_INCLUDE_PATH": str(d)}
        elif how == "absolute":
            inc = f'#include "{header}"'
        spec = {"name": f"sys_{how}", "cpp_sources": value_src(inc), "extra_cflags": flags}
        cycle(cxx, spec, lambda: header.write_text("#define VAL 2\n"),
              lambda: header.write_text("#define VAL 1\n"), env=env)
    finally:
        if how == "usr_include":
            header.unlink()


def test_pinned_headers_are_not_tracked(cache_root, cxx):
    e = StubCache().get_or_build(StubSpec("pin", value_src("#include <vector>\n#define VAL 1")))
    gcc_dir = subprocess.run([os.environ.get("CXX", "c++"), "-print-file-name=include"], capture_output=True,
                             text=True).stdout.strip()
    assert not any("/c++/" in p for p in e.manifest.headers), "libstdc++ headers come with the compiler"
    # Linker inputs are named as the linker opened them (`<gcc dir>/../../../libm.so`): not headers.
    headers = [p for p in e.manifest.headers if not p.endswith((".so", ".a", ".o")) and ".so." not in p]
    assert not any(p.startswith(os.path.dirname(gcc_dir) + "/") for p in headers)


# --- class 2: a new header that shadows a tracked one ------------------------------------------


def test_new_header_earlier_on_the_search_path_misses(cache_root, cxx, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    (second / "sub").mkdir(parents=True)
    (second / "sub" / "val.h").write_text("#define VAL 1\n")
    shadow = first / "sub" / "val.h"
    spec = {"name": "shadow", "cpp_sources": value_src('#include "sub/val.h"'),
            "extra_include_paths": [str(first), str(second)]}

    def plant():
        shadow.parent.mkdir()
        shadow.write_text("#define VAL 2\n")

    cycle(cxx, spec, plant, lambda: shutil.rmtree(shadow.parent))


def test_new_header_shadowing_a_system_header_misses(cache_root, cxx, tmp_path):
    """A header found by the compiler's default search (``/usr/include``) is shadowed by one in
    a ``CPATH`` directory that was empty at build time."""
    early = tmp_path / "early"
    early.mkdir()
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "sval.h").write_text("#define VAL 1\n")
    spec = {"name": "shadow_sys", "cpp_sources": value_src("#include <sval.h>"),
            "extra_cflags": ["-idirafter", str(tmp_path / "late")]}
    cycle(cxx, spec, lambda: (early / "sval.h").write_text("#define VAL 2\n"),
          lambda: (early / "sval.h").unlink(), env={"CPATH": str(early)})


# --- class 3: linker inputs --------------------------------------------------------------------


def test_static_archive_named_by_dash_l_is_tracked(cache_root, cxx, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()

    def archive(n: int) -> None:
        src = tmp_path / "dep.c"
        src.write_text(f"int dep_value(void) {{ return {n}; }}\n")
        obj = tmp_path / "dep.o"
        subprocess.run(["cc", "-fPIC", "-c", str(src), "-o", str(obj)], check=True)
        (lib / "libdep.a").unlink(missing_ok=True)
        subprocess.run(["ar", "rcs", str(lib / "libdep.a"), str(obj)], check=True)

    archive(1)
    spec = {"name": "ldin", "cpp_sources": 'extern "C" int dep_value(void);\n'
            'extern "C" int value(void) { return dep_value(); }\n',
            "extra_ldflags": [f"-L{lib}", "-ldep"]}
    cycle(cxx, spec, lambda: archive(2), lambda: archive(1))


# --- class 4: environment the toolchain reads --------------------------------------------------


def _runpath(path: str) -> str:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    return "\n".join(ln for ln in out.splitlines() if "RUNPATH" in ln or "RPATH" in ln)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs readelf")
def test_ld_run_path_changes_the_key(cache_root, cxx, tmp_path):
    spec = {"name": "runpath", "cpp_sources": value_src("#define VAL 1")}
    _, k1, p1 = child(spec)
    assert "/opt/stubcache-runpath" not in _runpath(p1)
    _, k2, p2 = child(spec, env={"LD_RUN_PATH": "/opt/stubcache-runpath"})
    assert k2 != k1 and "/opt/stubcache-runpath" in _runpath(p2)
    n = cxx.compiles()
    _, k3, _ = child(spec)
    assert k3 == k1 and cxx.compiles() == n


# --- class 5: the real compiler behind a wrapper ----------------------------------------------


FAKE_CCACHE = """#!/bin/sh
# Like ccache in a masquerade directory: run the next program of this name on PATH.
me=$(basename "$0"); here=$(cd "$(dirname "$0")" && pwd)
case " $* " in *" -E "*) ;; *.cpp*) echo "$$ $*" >> "{log}" ;; esac
IFS=:
for d in $PATH; do
  [ "$d" = "$here" ] && continue
  if [ -x "$d/$me" ]; then exec "$d/$me" "$@"; fi
done
exit 127
"""


@pytest.mark.skipif(shutil.which("clang++") is None or shutil.which("g++") is None,
                    reason="needs both g++ and clang++")
def test_switching_the_compiler_behind_a_masquerade_dir_misses(cache_root, tmp_path, monkeypatch):
    masq, real = tmp_path / "masq", tmp_path / "real"
    masq.mkdir()
    real.mkdir()
    log = tmp_path / "compiles.log"
    (masq / "ccache").write_text(FAKE_CCACHE.format(log=log))
    (masq / "ccache").chmod(0o755)
    (masq / "c++").symlink_to(masq / "ccache")
    (real / "c++").symlink_to(shutil.which("g++"))
    monkeypatch.setenv("PATH", f"{masq}:{real}:{os.environ['PATH']}")
    monkeypatch.delenv("CXX", raising=False)
    src = '#ifdef __clang__\n#define VAL 2\n#else\n#define VAL 1\n#endif\n' + value_src()
    spec = {"name": "masq", "cpp_sources": src}

    class Count:
        def compiles(self) -> int:
            return len(log.read_text().splitlines()) if log.exists() else 0

    def use(compiler: str):
        def go():
            (real / "c++").unlink()
            (real / "c++").symlink_to(shutil.which(compiler))
        return go

    cycle(Count(), spec, use("clang++"), use("g++"))


def test_cxx_with_a_wrapper_word_builds_and_names_the_real_compiler(cache_root, tmp_path, monkeypatch):
    wrap = tmp_path / "ccache"
    wrap.write_text('#!/bin/sh\nexec "$@"\n')
    wrap.chmod(0o755)
    monkeypatch.setenv("CXX", f"{wrap} c++")
    out = run_py("""
        import stubcache
        c = stubcache.StubCache()
        e = c.get_or_build(stubcache.StubSpec("wrapword", 'extern "C" int value(void) { return 5; }'))
        print(c.load_entry(e).value(), e.manifest.preimage["fingerprint"]["cxx"]["real"]["driver"]["path"])
    """).stdout.split()
    assert out[0] == "5" and os.path.realpath(shutil.which("c++")) == out[1]


# --- class 6: host-dependent targets -----------------------------------------------------------


def test_march_native_is_resolved_into_the_key(cache_root):
    spec = StubSpec("native", value_src("#define VAL 1"), extra_cflags=["-march=native"])
    pre = StubCache().preimage(spec)["fingerprint"]
    assert pre["native"]["target"] and all("native" not in t for t in pre["native"]["target"])
    assert "native" not in StubCache().preimage(StubSpec("plain", value_src("#define VAL 1")))["fingerprint"]


# --- class 7: an input edited during the build -------------------------------------------------


def test_header_edited_during_the_build_is_never_published_stale(cache_root, tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    inc.mkdir()
    header = inc / "val.h"
    header.write_text("#define VAL 1\n")
    mark = tmp_path / "edited"
    wrapper = tmp_path / "cxx-edit.sh"
    # The compiler reads VAL 1; the user saves VAL 2 just as it finishes (before the build hashes
    # its inputs). Published under VAL 2's key, the VAL 1 library would be served to everyone.
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        "{shutil.which('c++')}" "$@"; rc=$?
        case " $* " in *" -E "*) ;; *main.cpp*)
          echo compile >> "{tmp_path / 'log'}"
          if [ ! -e "{mark}" ]; then : > "{mark}"; echo '#define VAL 2' > "{header}"; fi;;
        esac
        exit $rc
        """))
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    spec = {"name": "midedit", "cpp_sources": value_src('#include "val.h"'), "extra_include_paths": [str(inc)]}
    v1, k1, _ = child(spec)
    assert mark.exists() and header.read_text().strip() == "#define VAL 2"
    assert v1 == 2, "the build that raced an edit must not be what loads"
    v2, k2, _ = child(spec)  # a later process with the same header content: a hit, and correct
    assert (v2, k2) == (2, k1)
    assert len((tmp_path / "log").read_text().splitlines()) == 2  # the raced build, one retry


# --- reproducible builds and `stubcache verify --rebuild` ---------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "stubcache", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=300)


@pytest.mark.parametrize("method,flags", [("direct", []), ("direct", ["-g", "-O2"]),
                                          pytest.param("load_inline", [], marks=pytest.mark.torch)])
def test_two_builds_of_one_key_are_identical(cache_root, tmp_path, method, flags):
    """The random staging path must not reach the library (file names, debug info, __FILE__)."""
    from stubcache.build.builder import build
    from stubcache.storage.store import file_sha256

    src = '#include <assert.h>\nextern "C" const char *where(int x) { assert(x); return __FILE__; }\n'
    shas = []
    for i in range(2):
        d = tmp_path / f"b{i}"
        d.mkdir()
        shas.append(file_sha256(build(StubSpec("repro", src, extra_cflags=flags, builder=method), str(d)).library))
    assert shas[0] == shas[1]


WEAK_BUILD = """
import os, stubcache, stubcache.key.tracking as tracking
real_add = tracking.Tracker.add_deps
def weakened(self, deps):  # a key that forgets one header: what a hole in the key looks like
    return real_add(self, [d for d in deps if not d.endswith("val.h")])
tracking.Tracker.add_deps = weakened
spec = stubcache.StubSpec("audited", os.environ["SRC"], extra_include_paths=[os.environ["INC"]])
c = stubcache.StubCache()
e = c.get_or_build(spec)
print(c.load_entry(e).value(), e.key)
"""


def test_verify_rebuild_reports_a_stale_entry(cache_root, cxx, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "val.h").write_text("#define VAL 1\n")
    env = {"SRC": value_src('#include "val.h"'), "INC": str(inc)}
    honest = child({"name": "honest", "cpp_sources": value_src("#define VAL 3")})
    ok = _cli("verify", "--rebuild")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "1 same" in ok.stdout

    v, key = run_py(WEAK_BUILD, env=env).stdout.split()
    assert v == "1"
    (inc / "val.h").write_text("#define VAL 2\n")  # the entry is now stale, and it still hits:
    v2, key2 = run_py(CHILD.replace("json.loads(os.environ[\"SPEC\"])", "dict(name='audited', cpp_sources="
                                    "os.environ['SRC'], extra_include_paths=[os.environ['INC']])"), env=env).stdout.split()[:2]
    assert (v2, key2) == ("1", key)
    res = _cli("verify", "--rebuild")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "the key does not cover an input" in res.stdout
    assert '"extra_include_paths"' in res.stdout and key in res.stdout  # the pre-image is shown
    one = _cli("verify", "--rebuild", honest[1][:10], "--format", "json")
    assert one.returncode == 0 and '"same"' in one.stdout
    assert _cli("verify", "--rebuild", "--sample", "1").returncode in (0, 1)
    assert _cli("verify", "--sample", "1").returncode == 2  # --sample without --rebuild


# --- needless misses ---------------------------------------------------------------------------


@pytest.mark.torch
def test_options_that_do_not_change_the_bytes_share_a_key(cache_root, tmp_path):
    """Without ``functions``, ``is_python_module`` and ``with_pytorch_error_handling`` give
    byte-identical libraries (measured here), so they share one key."""
    from stubcache.build.builder import build
    from stubcache.storage.store import file_sha256

    src = 'extern "C" int value(void) { return 4; }\n'
    variants = [dict(is_python_module=p, with_pytorch_error_handling=h) for p in (False, True) for h in (False, True)]
    shas, keys = set(), set()
    for i, kw in enumerate(variants):
        spec = StubSpec("needless", src, builder="load_inline", **kw)
        d = tmp_path / f"b{i}"
        d.mkdir()
        shas.add(file_sha256(build(spec, str(d)).library))
        keys.add(StubCache().key(spec))
    assert len(shas) == 1 and len(keys) == 1
    with_fn = [StubSpec("needless", "int f(int x) { return x; }", functions=["f"], with_pytorch_error_handling=h)
               for h in (False, True)]
    assert StubCache().key(with_fn[0]) != StubCache().key(with_fn[1])  # bindings differ: kept


def test_touched_but_unchanged_input_is_hashed_once_across_processes(cache_root, cxx, tmp_path):
    """A tracked file whose stat signature changed but whose content did not is re-hashed by one
    process; the root remembers the new signature, so later processes only stat it."""
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "val.h").write_text("#define VAL 1\n")
    spec = {"name": "touched", "cpp_sources": value_src('#include "val.h"'), "extra_include_paths": [str(inc)]}
    _, k1, _ = child(spec)
    os.utime(inc / "val.h")  # new mtime and ctime, same bytes
    memo = cache_root / "v1" / "state" / f"inputs-{k1}.json"
    assert not memo.exists()
    assert child(spec)[1] == k1 and memo.exists()
    import json

    assert str(inc / "val.h") in json.loads(memo.read_text())
    (inc / "val.h").write_text("#define VAL 2\n")  # and a real change still misses
    assert child(spec)[0] == 2


@pytest.mark.parametrize("bad", [{"sigs": 5}, {"shadows": {"/": 3}}, {"shadows": {"/": [None, 7]}},
                                 {"sigs": {"x": "y"}, "shadows": [1]}, "text"])
def test_malformed_inputs_record_is_quarantined_and_rebuilt(cache_root, cxx, bad):
    import json

    spec = {"name": "malformed", "cpp_sources": value_src("#include <stdint.h>\n#define VAL 1")}
    _, key, path = child(spec)
    mpath = Path(path).parent / "manifest.json"
    data = json.loads(mpath.read_text())
    assert data["headers"]  # <stdint.h> and the linker inputs are tracked
    data["inputs"] = bad
    Path(path).parent.chmod(0o755)
    mpath.chmod(0o644)
    mpath.write_text(json.dumps(data))
    mpath.chmod(0o444)
    v, key2, _ = child(spec)  # a hostile or broken record: quarantined, rebuilt, loaded
    assert (v, key2) == (1, key) and cxx.compiles() == 2
    assert any(p.name.startswith(key) for p in (cache_root / "v1" / "quarantine").iterdir())


def test_linker_trace_fallback_finds_the_archive(tmp_path, monkeypatch):
    """Without ``--dependency-file`` (binutils < 2.35) the direct path reads ``-Wl,--trace``."""
    from stubcache.build import buildinputs
    from stubcache.build.builder import build

    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "dep.c").write_text("int dep_value(void) { return 7; }\n")
    subprocess.run(["cc", "-fPIC", "-c", str(tmp_path / "dep.c"), "-o", str(tmp_path / "dep.o")], check=True)
    subprocess.run(["ar", "rcs", str(lib / "libdep.a"), str(tmp_path / "dep.o")], check=True)
    monkeypatch.setattr(buildinputs, "linker_writes_depfile", lambda compiler: False)
    (tmp_path / "b").mkdir()
    spec = StubSpec("trace", 'extern "C" int dep_value(void);\nextern "C" int value(void) { return dep_value(); }\n',
                    extra_ldflags=[f"-L{lib}", "-ldep"])
    result = build(spec, str(tmp_path / "b"))
    assert str(lib / "libdep.a") in result.headers


def test_a_shadow_candidate_the_compiler_does_not_choose_publishes_beside(cache_root, cxx, tmp_path):
    """A path recorded as a possible shadow appears but the compiler keeps the old header (here
    the header is included by a path relative to the including file, which is searched first):
    the lookup misses, and the rebuild, with the same file contents, gets its own entry instead
    of colliding with the old one."""
    inc, other = tmp_path / "inc", tmp_path / "other"
    (inc / "sub").mkdir(parents=True)
    other.mkdir()
    (inc / "sub" / "outer.h").write_text('#include "val.h"\n')
    (inc / "sub" / "val.h").write_text("#define VAL 1\n")
    spec = {"name": "notchosen", "cpp_sources": value_src('#include "sub/outer.h"'),
            "extra_include_paths": [str(other), str(inc)]}
    v1, k1, _ = child(spec)
    (other / "sub").mkdir()
    (other / "sub" / "val.h").write_text("#define VAL 2\n")  # searched before inc, but not for "val.h"
    v2, k2, _ = child(spec)
    assert v2 == 1 and k2 != k1 and cxx.compiles() == 2
    v3, k3, _ = child(spec)
    assert (v3, k3) == (1, k2) and cxx.compiles() == 2


@pytest.mark.parametrize("var", ["LD_RUN_PATH", "SOURCE_DATE_EPOCH", "CCC_OVERRIDE_OPTIONS", "NVCC_CCBIN",
                                 "GNUTARGET", "LDEMULATION", "LIBRARY_PATH", "CPATH"])
def test_toolchain_environment_is_in_the_key(tmp_path, monkeypatch, var):
    spec = StubSpec("envkey", value_src("#define VAL 1"))
    monkeypatch.delenv(var, raising=False)
    base = StubCache(tmp_path).key(spec)
    monkeypatch.setenv(var, "/opt/x")
    assert StubCache(tmp_path).key(spec) != base


def test_only_unusual_locales_split_the_key(tmp_path, monkeypatch):
    spec = StubSpec("lockey", value_src("#define VAL 1"))
    for v in ("LC_ALL", "LC_CTYPE", "LANG"):
        monkeypatch.delenv(v, raising=False)
    base = StubCache(tmp_path).key(spec)
    for value in ("C", "POSIX", "C.UTF-8", "en_US.UTF-8", "de_DE.utf8"):
        monkeypatch.setenv("LANG", value)
        assert StubCache(tmp_path).key(spec) == base, value
    monkeypatch.setenv("LC_ALL", "ja_JP.eucJP")  # gcc would read sources in EUC-JP
    assert StubCache(tmp_path).key(spec) != base


def test_inputs_that_keep_changing_are_never_published(cache_root, tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    inc.mkdir()
    header = inc / "val.h"
    header.write_text("#define VAL 1\n")
    wrapper = tmp_path / "cxx-edit.sh"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        "{shutil.which('c++')}" "$@"; rc=$?
        case " $* " in *" -E "*) ;; *main.cpp*) echo "#define VAL $$" > "{header}";; esac
        exit $rc
        """))
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    out = run_py("""
        import os, stubcache
        spec = stubcache.StubSpec("moving", '#include "val.h"\\nextern "C" int value(void) { return VAL; }',
                                  extra_include_paths=[os.environ["INC"]])
        e = stubcache.StubCache().get_or_build(spec)
        print(e.published)
    """, env={"INC": str(inc)}).stdout.split()
    assert out == ["False"]  # loaded from a private build
    entries = cache_root / "v1" / "entries"
    assert not entries.exists() or not list(entries.iterdir())


def test_explain_names_the_tracked_file_that_changed(cache_root, tmp_path):
    import json

    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "val.h").write_text("#define VAL 1\n")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"name": "explained", "cpp_sources": value_src('#include "val.h"'),
                                     "extra_include_paths": [str(inc)]}))
    assert _cli("warm", str(spec_file)).returncode == 0
    (inc / "val.h").write_text("#define VAL 2\n")
    out = _cli("explain", str(spec_file)).stdout
    assert "not in the cache" in out and f"{inc / 'val.h'}: content changed" in out
    (inc / "val.h").write_text("#define VAL 1\n")
    assert "(in the cache)" in _cli("explain", str(spec_file)).stdout


def test_user_dir_named_like_a_standard_library_dir_is_tracked(cache_root, cxx, tmp_path):
    d = tmp_path / "include" / "c++" / "12"
    d.mkdir(parents=True)
    (d / "val.h").write_text("#define VAL 1\n")
    spec = {"name": "cxxdir", "cpp_sources": value_src('#include "val.h"'), "extra_include_paths": [str(d)]}
    cycle(cxx, spec, lambda: (d / "val.h").write_text("#define VAL 2\n"),
          lambda: (d / "val.h").write_text("#define VAL 1\n"))


def src(n: int) -> str:
    return f'extern "C" int value(void) {{ return {n}; }}\n'


def test_include_dir_without_used_headers(cache_root, cxx, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for _ in range(2):
        cache = StubCache()
        entry = cache.get_or_build(StubSpec("noinc", src(3), extra_include_paths=[str(empty)]))
        assert cache.load_entry(entry).value() == 3
        # Nothing from the include dir; system headers and linker inputs are tracked regardless.
        assert not any(p.startswith(str(empty)) for p in entry.manifest.headers)
    assert cxx.compiles() == 1


def test_environment_changed_after_first_call_changes_the_key(cache_root, monkeypatch):
    cache = StubCache()
    spec = StubSpec("envkey", src(1))
    k1 = cache.get_or_build(spec).key
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    k2 = cache.get_or_build(StubSpec("envkey", src(1))).key
    assert k1 != k2
    assert cache.preimage(spec)["fingerprint"]["env"]["TORCH_CUDA_ARCH_LIST"] == "9.0"


def test_fingerprint_memo_notices_a_compiler_added_earlier_on_path(cache_root, tmp_path, monkeypatch):
    import json

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    real = shutil.which("c++")
    (b / "c++").write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
    (b / "c++").chmod(0o755)
    monkeypatch.setenv("PATH", f"{a}:{b}:{os.environ['PATH']}")
    monkeypatch.delenv("CXX", raising=False)
    code = """
    import json, stubcache
    print(json.dumps(stubcache.StubCache().preimage(stubcache.StubSpec("p", "int x;"))["fingerprint"]["cxx"]))
    """
    first = json.loads(run_py(code).stdout)
    again = json.loads(run_py(code).stdout)  # served by the whole-fingerprint memo
    assert first == again and first["path"] == str(b / "c++")
    (a / "c++").write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "shadow 1.0" && exit 0\nexec "{real}" "$@"\n')
    (a / "c++").chmod(0o755)
    shadow = json.loads(run_py(code).stdout)
    assert shadow["path"] == str(a / "c++") and shadow["version"] == "shadow 1.0"
