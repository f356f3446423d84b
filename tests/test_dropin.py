"""Drop-in fidelity with torch's loaders, checked against torch's documented behaviour.

Python-module cases use pybind11 alone (``no_implicit_headers=True`` and no torch error
wrapping), a few seconds each; the torch-header cases live in ``test_torch_builds.py``'s one
session fixture. Each case that loads a Python module runs in a fresh process, as pybind11's
per-interpreter module state is exactly what some of them are about.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import pytest

import stubcache

from .conftest import REPO, run_on_pty, run_py, wait_until

PYB = "#include <pybind11/pybind11.h>\n"


def last_json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_same_name_new_sources_returns_the_new_module(cache_root):
    # With three loads of one name in one process, each returns its own code, named as torch
    # names them (name, name_v1, name_v2: torch bumps on every change, even back to old sources).
    proc = run_py(f"""
        import json, stubcache
        def load(n, functions):
            return stubcache.load_inline("reload_me", {PYB!r} + "int f() {{ return %d; }}" % n,
                                         functions=functions, no_implicit_headers=True,
                                         with_pytorch_error_handling=False)
        a = load(1, ["f"])                 # functions as a list
        b = load(2, "f")                   # as a single string
        c = load(1, {{"f": "The answer."}})  # as a dict with docstrings
        again = load(1, {{"f": "The answer."}})  # unchanged: the same module object
        print(json.dumps({{"values": [a.f(), b.f(), c.f()], "names": [m.__name__ for m in (a, b, c)],
                          "doc": c.f.__doc__, "same": again is c}}))
    """)
    out = last_json(proc)
    assert out["values"] == [1, 2, 1]
    assert out["names"] == ["reload_me", "reload_me_v1", "reload_me_v2"]
    assert "The answer." in out["doc"] and out["same"] is True


def test_a_changed_header_with_the_same_arguments_returns_the_new_module(cache_root, tmp_path):
    # The header is in the key, so the library is new; under the name already imported, Python
    # handed back the first module (old code) while verbose said it loaded the new file.
    (tmp_path / "v.h").write_text("#define V 1\n")
    (tmp_path / "m.cpp").write_text(PYB + '#include "v.h"\nint f() { return V; }\n'
                                    "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"f\", &f); }\n")
    proc = run_py(f"""
        import json, stubcache
        a = stubcache.load("hdr_change", [{str(tmp_path / "m.cpp")!r}])
        open({str(tmp_path / "v.h")!r}, "w").write("#define V 2\\n")
        b = stubcache.load("hdr_change", [{str(tmp_path / "m.cpp")!r}])
        again = stubcache.load("hdr_change", [{str(tmp_path / "m.cpp")!r}])
        print(json.dumps({{"values": [a.f(), b.f(), again.f()], "names": [a.__name__, b.__name__],
                          "same": again is b}}))
    """)
    out = last_json(proc)
    assert out["values"] == [1, 2, 2]
    assert out["names"] == ["hdr_change", "hdr_change_v1"] and out["same"] is True


def test_functions_of_the_wrong_type_raise_value_error_as_torch_does(cache_root):
    with pytest.raises(ValueError, match="Expected 'functions' to be a list or dict"):
        stubcache.load_inline("bad_functions", "int f() { return 1; }", functions=5)


@pytest.mark.parametrize("args, kwargs", [
    (("t1", "int f();"), dict(functions=5)),
    (("t2", None), dict(is_python_module=False)),
    (("t3", 123), dict(is_python_module=False)),
])
def test_bad_inputs_raise_what_torch_raises(cache_root, tmp_path, args, kwargs):
    import torch.utils.cpp_extension as cpp_ext

    def outcome(fn, **extra):
        try:
            fn(*args, no_implicit_headers=True, **kwargs, **extra)
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            return type(exc)
        return None

    torch_exc = outcome(cpp_ext.load_inline, build_directory=str(tmp_path))
    assert torch_exc is not None and outcome(stubcache.load_inline) is torch_exc


def test_missing_source_file_raises_file_not_found_as_torch_does(cache_root, tmp_path):
    import torch.utils.cpp_extension as cpp_ext

    for fn, extra in ((cpp_ext.load, {"build_directory": str(tmp_path)}), (stubcache.load, {})):
        with pytest.raises(FileNotFoundError):
            fn("missing_src", [str(tmp_path / "nope.cpp")], is_python_module=False, **extra)


def test_unsupported_options_raise_value_error(cache_root):
    with pytest.raises(ValueError, match="does not support sycl_sources"):
        stubcache.load_inline("sycl", "int f();", sycl_sources="x")
    with pytest.raises(stubcache.UnsupportedError):
        stubcache.load("standalone", [], is_standalone=True)


@pytest.mark.parametrize("builder", ["direct", "load_inline"])
def test_build_error_is_a_runtime_error_with_torchs_message_shape(cache_root, builder):
    spec = stubcache.StubSpec("broken_stub", 'extern "C" int f(void) { return undefined_thing; }',
                              builder=builder, no_implicit_headers=True)
    with pytest.raises(RuntimeError) as info:
        stubcache.StubCache().get_or_build(spec)
    exc = info.value
    assert isinstance(exc, stubcache.BuildError) and isinstance(exc, stubcache.StubCacheError)
    assert str(exc).startswith("Error building extension 'broken_stub': ")
    assert "undefined_thing" in str(exc) and "undefined_thing" in exc.output


def test_drop_in_build_failure_is_caught_by_except_runtime_error(cache_root):
    try:
        stubcache.load_inline("broken_dropin", "int f() { return nope; }", is_python_module=False,
                              no_implicit_headers=True)
    except RuntimeError as exc:
        assert str(exc).startswith("Error building extension 'broken_dropin': ")
    else:
        raise AssertionError("no error")


LATIN1 = b'/* caf\xe9 */\nextern "C" int last_byte(void) { return (unsigned char)"caf\xe9"[3]; }\n'


def test_load_of_a_non_utf8_source_keys_and_compiles_the_bytes(cache_root, cxx, tmp_path):
    src = tmp_path / "latin1.cpp"
    src.write_bytes(LATIN1)
    path = stubcache.load("latin1_direct", [str(src)], is_python_module=False)
    assert ctypes.CDLL(path).last_byte() == 0xE9
    src.write_bytes(LATIN1.replace(b"\xe9", b"\xe8"))  # one byte changes: another key
    path2 = stubcache.load("latin1_direct", [str(src)], is_python_module=False)
    assert path2 != path and ctypes.CDLL(path2).last_byte() == 0xE8


def test_load_of_a_non_utf8_python_module_on_the_torch_path(cache_root, tmp_path):
    src = tmp_path / "latin1_mod.cpp"
    src.write_bytes(PYB.encode() + LATIN1 + b"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) "
                    b'{ m.def("last_byte", &last_byte); }\n')
    headers = tmp_path / "sub"
    headers.mkdir()
    proc = run_py(f"""
        import stubcache
        m = stubcache.load("latin1_mod", [{str(src)!r}])
        print(m.last_byte())
    """)
    assert proc.stdout.strip().splitlines()[-1] == str(0xE9)


@pytest.mark.parametrize("builder", ["direct", "load_inline"])
def test_no_flag_reaches_a_shell(cache_root, tmp_path, builder):
    marker = tmp_path / "pwned"
    nasty = f"a;touch {marker};$(touch {marker}) `touch {marker}` $HOME"
    inc = tmp_path / "inc $HOME; touch pwned2 dir"  # an include path ninja and sh would both mangle
    inc.mkdir()
    (inc / "seven.h").write_text("#define SEVEN 7\n")
    spec = stubcache.StubSpec(
        f"flags_{builder}", '#include "seven.h"\nextern "C" const char* msg(void) { return MSG; }\n'
        'extern "C" int seven(void) { return SEVEN; }', builder=builder,
        no_implicit_headers=True, extra_include_paths=[str(inc)],
        extra_cflags=[f'-DMSG="{nasty}"', "-O2", "-O2", "-DDUP=1", "-DDUP=1"],  # duplicates tolerated
        # no space: a flag with spaces and no quotes is split into words, as torch's shell would
        extra_ldflags=[f"-L{tmp_path}/x;touch${{IFS}}{marker};$(touch${{IFS}}{marker})"])
    cache = stubcache.StubCache()
    lib = cache.load(spec)
    lib.msg.restype = ctypes.c_char_p
    assert lib.msg().decode() == nasty  # the compiler got exactly the flag
    assert lib.seven() == 7
    assert not marker.exists() and not list(tmp_path.rglob("pwned2"))


def test_a_flag_with_a_line_break_is_refused_on_the_torch_path(cache_root):
    spec = stubcache.StubSpec("nl_flag", 'extern "C" int f(void) { return 1; }', builder="load_inline",
                              no_implicit_headers=True, extra_cflags=["-DX=1\nrule evil"])
    with pytest.raises(ValueError, match="line break"):
        stubcache.StubCache().get_or_build(spec)


def test_include_paths_with_spaces_and_headers_beside_load_sources(cache_root, tmp_path):
    inc = tmp_path / "my headers"
    inc.mkdir()
    (inc / "two.h").write_text("#define TWO 2\n")
    srcdir = tmp_path / "src dir"
    srcdir.mkdir()
    (srcdir / "three.h").write_text("#define THREE 3\n")
    (srcdir / "a.cpp").write_text('#include "two.h"\n#include "three.h"\nextern "C" int a(void) { return TWO; }\n')
    # several sources, each its own translation unit (as in torch): b.cpp includes what it uses
    (srcdir / "b.cpp").write_text('#include "three.h"\nextern "C" int b(void) { return THREE; }\n')
    path = stubcache.load("spaces", [str(srcdir / "a.cpp"), str(srcdir / "b.cpp")],
                          extra_include_paths=[str(inc)], is_python_module=False)
    lib = ctypes.CDLL(path)
    assert (lib.a(), lib.b()) == (2, 3)


def test_several_sources_and_no_functions(cache_root):
    proc = run_py(f"""
        import stubcache
        m = stubcache.load_inline("no_funcs", [{PYB!r}, "static int g() {{ return 4; }}",
                                  "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def(\\"g\\", &g); }}"],
                                  no_implicit_headers=True)
        print(m.g(), m.__name__)
    """)
    assert proc.stdout.strip().splitlines()[-1] == "4 no_funcs"


def test_loaded_library_shows_its_real_path_in_proc_maps(cache_root):
    cache = stubcache.StubCache()
    entry = cache.get_or_build(stubcache.StubSpec("mapped", 'extern "C" int f(void) { return 1; }'))
    assert cache.loaded_path(entry) == entry.path
    with open("/proc/self/maps") as fh:
        assert any(line.rstrip().endswith(entry.path) for line in fh)


def test_a_library_swapped_between_check_and_load_is_refused(cache_root, tmp_path, monkeypatch):
    from stubcache import hit
    from stubcache.edge.errors import IntegrityError

    scanned = []  # the direct check (map_files) only ever accepts: a mismatch goes the full way
    full_scan = hit.mappings
    monkeypatch.setattr(hit, "mappings", lambda path, fd=None: scanned.append(path) or full_scan(path, fd))
    cache = stubcache.StubCache()
    entry = cache.get_or_build(stubcache.StubSpec("swapped", 'extern "C" int f(void) { return 1; }'))
    fd = cache._open_checked(entry)  # what load_entry verifies first
    cache._lib_fds[entry.path] = fd
    # An attacker (or a broken copy) replaces the file after the check, before the dlopen.
    other = stubcache.StubCache(tmp_path / "other").get_or_build(
        stubcache.StubSpec("swapped", 'extern "C" int f(void) { return 2; }'))
    os.chmod(os.path.dirname(entry.path), 0o700)
    os.replace(other.path, entry.path)
    with pytest.raises(IntegrityError, match="not the verified file"):
        cache.load_entry(entry)
    assert scanned


def test_a_root_reached_through_a_symlink_is_loaded_by_its_real_path(tmp_path, monkeypatch):
    """torch.ops.load_library (and symbolizers) use os.path.realpath of the path we return: it
    must name the handle that was checked, or glibc maps whatever file is there now, unchecked."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("STUBCACHE_DIR", str(tmp_path / "link" / "cache"))
    path = stubcache.load_inline("via_link", 'extern "C" int f(void) { return 1; }', is_python_module=False,
                                 no_implicit_headers=True)
    assert path == os.path.realpath(path)
    # The file is replaced after the checked load (a prune and rebuild, or a swap): what torch's
    # load_library(path) opens is still the checked library.
    other = stubcache.StubCache(tmp_path / "other").get_or_build(
        stubcache.StubSpec("via_link", 'extern "C" int f(void) { return 2; }'))
    os.chmod(os.path.dirname(path), 0o700)
    os.replace(other.path, path)
    assert ctypes.CDLL(os.path.realpath(path)).f() == 1


def test_build_directory_holds_only_the_library(cache_root, tmp_path):
    # The build happens in private staging; the caller's directory gets <name>.so and nothing
    # stubcache needs later (no lock, no sources).
    bd = tmp_path / "bd"
    bd.mkdir()
    for i in range(2):
        stubcache.load_inline(f"bd{i}", 'extern "C" int f(void) { return 1; }', is_python_module=False,
                              no_implicit_headers=True, build_directory=str(bd))
    assert sorted(os.listdir(bd)) == ["bd0.so", "bd1.so"]


# --- verbose --------------------------------------------------------------------------------------


@pytest.mark.parametrize("torch_path", [False, True])
def test_verbose_shows_the_build_live_on_stdout(cache_root, torch_path):
    # A comment naming TORCH_ sends the stub down torch's own path (ninja), else the direct one.
    src = ("// TORCH_ path\n" if torch_path else "") + 'extern "C" int f(void) { return 1; }'
    code = f"""
        import stubcache
        stubcache.load_inline("verbose_{int(torch_path)}", {src!r}, is_python_module=False,
                              no_implicit_headers=True, verbose=True)
    """
    out = run_py(code)
    assert "-shared" in out.stdout  # the link command, as torch's verbose build prints it
    if torch_path:
        assert "ninja" in out.stdout.lower() or "[2/2]" in out.stdout
    quiet = run_py(code.replace("verbose=True", "verbose=False").replace("verbose_", "quiet_"))
    assert quiet.stdout == ""


# --- patching torch -------------------------------------------------------------------------------


def test_assigning_the_drop_in_to_torch_does_not_deadlock(cache_root):
    # The builder calls torch's original function, not the (now patched) module attribute.
    proc = run_py("""
        import torch.utils.cpp_extension as cpp_ext, stubcache, ctypes
        cpp_ext.load_inline = stubcache.load_inline
        path = cpp_ext.load_inline("selfpatched", '// TORCH_ path\\nextern "C" int f(void) { return 9; }',
                                   is_python_module=False, no_implicit_headers=True)
        print(ctypes.CDLL(path).f(), path.startswith(stubcache.default_cache().root))
    """, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "9 True"


def test_patch_torch_is_idempotent_and_reversible():
    import torch.utils.cpp_extension as cpp_ext

    orig = (cpp_ext.load_inline, cpp_ext.load)
    try:
        stubcache.patch_torch()
        first = cpp_ext.load_inline
        stubcache.patch_torch()
        assert cpp_ext.load_inline is first and stubcache.dropin.patch.is_patched()
        assert first.__wrapped__ is orig[0]
    finally:
        stubcache.unpatch_torch()
    assert (cpp_ext.load_inline, cpp_ext.load) == orig and not stubcache.dropin.patch.is_patched()
    stubcache.unpatch_torch()  # twice is fine


APP = '''
import ctypes, json, multiprocessing as mp, subprocess, sys
import torch.utils.cpp_extension as cpp_ext
from torch.utils.cpp_extension import load_inline  # a binding taken before any patch could run

SRC = 'extern "C" int triple(int x) { return 3 * x; }'

def worker(x):
    path = load_inline("tree_stub", SRC, is_python_module=False, no_implicit_headers=True)
    return ctypes.CDLL(path).triple(x)

if __name__ == "__main__":
    role = sys.argv[1] if len(sys.argv) > 1 else "parent"
    print(json.dumps({"role": role, "value": worker(7 if role == "parent" else 5)}), flush=True)
    if role == "parent":
        subprocess.run([sys.executable, __file__, "child"], check=True)
    else:
        with mp.get_context("spawn").Pool(1) as pool:
            print(json.dumps({"role": "spawned", "value": pool.apply(worker, (11,))}), flush=True)
'''


def test_stubcache_run_covers_a_process_tree(cache_root, cxx, tmp_path):
    import subprocess

    app = tmp_path / "app.py"
    app.write_text(APP)
    tx = tmp_path / "torch_extensions"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tx), PYTHONPATH=str(REPO))

    def run(*prefix):
        proc = subprocess.run([*prefix, sys.executable, str(app)], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return sorted(proc.stdout.split("\n"))

    plain = run()
    assert cxx.compiles() >= 1 and tx.is_dir()  # torch's own loader built it
    cxx.reset()
    import shutil

    shutil.rmtree(tx)
    wrapped = [sys.executable, "-m", "stubcache", "run", "--"]
    assert run(*wrapped) == plain  # same results as unpatched
    assert cxx.compiles() == 1  # one compile across parent, child and spawned worker
    assert not tx.exists()  # torch's JIT directory was never used
    assert run(*wrapped) == plain
    assert cxx.compiles() == 1  # warm rerun: no compile at all
    assert len(os.listdir(cache_root / "v1" / "entries")) == 1


def test_run_env_prints_the_hook_variables():
    from stubcache.cli import main
    from stubcache.admin.run import BOOT_DIR

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["run", "--env"]) == 0
    text = buf.getvalue()
    assert "STUBCACHE_PATCH_TORCH=1" in text and BOOT_DIR in text


def test_start_up_hook_does_nothing_without_the_variable(tmp_path):
    from stubcache.admin.run import BOOT_DIR

    other = tmp_path / "site2"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins; builtins.CHAINED = True\n")
    env = {"PYTHONPATH": os.pathsep.join([BOOT_DIR, str(other), str(REPO)])}
    env.pop("STUBCACHE_PATCH_TORCH", None)
    proc = run_py("""
        import sys, builtins
        print(getattr(builtins, "CHAINED", False), [type(f).__name__ for f in sys.meta_path].count("_Finder"),
              "stubcache" in sys.modules)
    """, env=dict(env, STUBCACHE_PATCH_TORCH="0"))
    assert proc.stdout.split() == ["True", "0", "False"]  # user's sitecustomize still ran


def test_start_up_hook_keeps_the_path_changes_of_the_sitecustomize_it_chains(tmp_path):
    from stubcache.admin.run import BOOT_DIR

    other = tmp_path / "site2"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import sys; sys.path.append('/opt/added-by-user')\n")
    proc = run_py("""
        import sys
        print('/opt/added-by-user' in sys.path)
    """, env={"PYTHONPATH": os.pathsep.join([BOOT_DIR, str(other), str(REPO)]), "STUBCACHE_PATCH_TORCH": "1"})
    assert proc.stdout.split() == ["True"]  # a sitecustomize that extends sys.path keeps working


def _fake_torch(tmp_path):
    """A header-free stand-in for ``torch.utils.cpp_extension`` (the hook only needs the module)."""
    pkg = tmp_path / "faketorch" / "torch"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "utils" / "cpp_extension.py").write_text("def load_inline(*a, **k): pass\ndef load(*a, **k): pass\n")
    return pkg.parent


def test_two_start_up_hooks_on_the_path_do_not_recurse(tmp_path):
    """Nested ``stubcache run`` from two installs puts two hook directories on PYTHONPATH."""
    import shutil

    from stubcache.admin.run import BOOT_DIR

    second = tmp_path / "boot2"
    shutil.copytree(BOOT_DIR, second)
    env = {"PYTHONPATH": os.pathsep.join([str(second), BOOT_DIR, str(REPO), str(_fake_torch(tmp_path))]),
           "STUBCACHE_PATCH_TORCH": "1"}
    proc = run_py("""
        import torch.utils.cpp_extension
        from stubcache.dropin.patch import is_patched
        print(is_patched())
    """, env=env, timeout=120)
    assert proc.stdout.split() == ["True"]


def test_a_failing_patch_does_not_fail_the_programs_torch_import(tmp_path):
    fake = _fake_torch(tmp_path)
    (fake / "torch" / "utils" / "cpp_extension.py").write_text("def load_inline(*a, **k): pass\n")  # no load
    from stubcache.admin.run import BOOT_DIR

    proc = run_py("""
        import torch.utils.cpp_extension as m
        print(m.load_inline.__module__)
    """, env={"PYTHONPATH": os.pathsep.join([BOOT_DIR, str(REPO), str(fake)]), "STUBCACHE_PATCH_TORCH": "1"})
    assert proc.stdout.split() == ["torch.utils.cpp_extension"]
    assert "not patched" in proc.stderr


# --- the terminal status line ---------------------------------------------------------------------

STATUS_CHILD = """
import stubcache
stubcache.load_inline("slow_stub", 'extern "C" int f(void) { return 1; }', is_python_module=False,
                      no_implicit_headers=True)
print("done")
"""


def test_status_line_on_a_terminal_and_never_in_a_pipe(cache_root, cxx, monkeypatch):
    import subprocess

    monkeypatch.setenv("STUBCACHE_TEST_CXX_SLEEP", "3.5")  # a build that lasts past the 2 s mark
    env = dict(os.environ, PYTHONPATH=str(REPO))
    text = run_on_pty(STATUS_CHILD, env)
    assert "stubcache: building slow_stub (direct build), " in text
    assert "\x1b[K" in text  # the line is erased again
    assert text.rstrip().endswith("done")

    # A second process waiting for a third one's build says whom it waits for.
    holder = subprocess.Popen([sys.executable, "-c", STATUS_CHILD.replace("slow_stub", "waited_stub")],
                              env=dict(env, STUBCACHE_TEST_CXX_SLEEP="9"),  # the waiter must wait > 2 s
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    leases = cache_root / "v1" / "leases"
    wait_until(lambda: leases.is_dir() and os.listdir(leases), "the holder to start its build", proc=holder)
    text = run_on_pty(STATUS_CHILD.replace("slow_stub", "waited_stub"), env)
    holder.wait(timeout=60)
    assert f"stubcache: waiting for pid {holder.pid} on " in text and "(waited_stub, building for" in text

    # The same build (another name) with stderr a pipe: not a byte of status.
    piped = subprocess.run([sys.executable, "-c", STATUS_CHILD.replace("slow_stub", "slow_stub2")],
                           env=env, capture_output=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == b"" and piped.stdout == b"done\n"


def test_a_clone_shadowing_the_package_is_explained(tmp_path):
    import subprocess

    (tmp_path / "stubcache").symlink_to(REPO)  # "the directory that contains the clone"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run([sys.executable, "-c", "import stubcache; print(getattr(stubcache, '__file__', None))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    if probe.stdout.strip() != "None":
        pytest.skip("an installed regular package wins over the clone here")
    proc = subprocess.run([sys.executable, "-m", "stubcache", "ls"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "shadows the installed package" in proc.stderr


def test_demo_without_numpy_prints_no_numpy_warning(cache_root, tmp_path):
    # A numpy that fails to import, as on a machine with torch alone installed.
    fake = tmp_path / "nonumpy" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    proc = run_py("from kvarena.demo import main; raise SystemExit(main(['--device', 'cpu', '--tokens', '64']))",
                  env={"PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)])})
    assert "closed" in proc.stdout and "NumPy" not in proc.stderr, proc.stderr


def test_patched_torch_hands_unsupported_options_to_torch(cache_root, tmp_path):
    # is_standalone (an executable) is not something stubcache caches: torch's own load runs.
    src = tmp_path / "hello.cpp"
    src.write_text("int main() { return 3; }\n")
    proc = run_py(f"""
        import subprocess, stubcache, torch.utils.cpp_extension as cpp_ext
        stubcache.patch_torch()
        exe = cpp_ext.load("standalone_exe", [{str(src)!r}], is_standalone=True, is_python_module=False,
                           build_directory={str(tmp_path)!r})
        print(exe.startswith({str(tmp_path)!r}), subprocess.run([exe]).returncode)
    """, timeout=300)
    assert proc.stdout.split()[-2:] == ["True", "3"]


def test_load_of_a_self_contained_file(cache_root, cxx, tmp_path):
    f = tmp_path / "solo.cpp"
    f.write_text('extern "C" int value(void) { return 4; }\n')
    for _ in range(2):
        path = stubcache.load("solo", [str(f)], is_python_module=False)
        assert ctypes.CDLL(path).value() == 4
    assert cxx.compiles() == 1
