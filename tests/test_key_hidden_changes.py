"""Changes that hide from a quick look, found by a review that hunted stale hits: a file rewritten
with its modification time put back, a directory whose mtime a tar extraction restored, gcc's
long spellings of path flags, and a program installed earlier in the driver's search for it.

Each test builds through the drop-in (which leaves a hit record), changes the world, and checks
that a new process's identical call loads what a fresh build gives now, through the record and
through the full path (the record removed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

CALL = """
import ctypes, json, sys
import stubcache
cfg = json.loads(sys.argv[1])
path = stubcache.load_inline(cfg["name"], cfg["src"], is_python_module=False, no_implicit_headers=True,
                             extra_cflags=cfg.get("cflags"), extra_ldflags=cfg.get("ldflags"))
print(json.dumps({"value": ctypes.CDLL(path).value(), "path": path}))
"""


def call(cfg: dict, env: dict, require_hit: bool = False) -> tuple[int, str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), **env)
    full.pop("STUBCACHE_REQUIRE_HIT", None)
    if require_hit:
        full["STUBCACHE_REQUIRE_HIT"] = "1"
    proc = subprocess.run([sys.executable, "-c", CALL, json.dumps(cfg)], env=full, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        return -1, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["value"], out["path"]


def records(root: Path) -> list[Path]:
    return sorted((root / "v1" / "state").glob("hit-*.json"))


def warm_and_full(cfg: dict, env: dict, root: Path) -> tuple[int, int]:
    """The value a new process's warm call loads through the record, then through the full path."""
    assert records(root), "the first call left no hit record"
    through_record = call(cfg, env)[0]
    for r in records(root):
        r.unlink()
    return through_record, call(cfg, env)[0]


def restore_times(path: Path, st: os.stat_result) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_cxx_script_rewritten_with_its_mtime_put_back_is_noticed(tmp_path):
    root = tmp_path / "root"
    script = tmp_path / "cxx.sh"
    gxx = shutil.which("g++") or shutil.which("c++")
    script.write_text(f'#!/bin/sh\nexec {gxx} -DVAL=1 "$@"\n')
    script.chmod(0o755)
    env = {"STUBCACHE_DIR": str(root), "CXX": str(script), "XDG_STATE_HOME": str(tmp_path / "state")}
    cfg = {"name": "cxx_script", "src": 'extern "C" int value(void) { return VAL; }'}
    assert call(cfg, env)[0] == 1
    assert call(cfg, env, require_hit=True)[0] == 1  # a warm hit, through the record
    before = script.stat()
    script.write_text(f'#!/bin/sh\nexec {gxx} -DVAL=2 "$@"\n')  # same size, same inode
    restore_times(script, before)
    assert script.stat().st_size == before.st_size and script.stat().st_mtime_ns == before.st_mtime_ns
    assert warm_and_full(cfg, env, root) == (2, 2)


def test_a_header_extracted_into_a_directory_whose_mtime_tar_restored_is_noticed(tmp_path):
    root = tmp_path / "root"
    overlay, base = tmp_path / "sdk" / "overlay", tmp_path / "sdk" / "base"
    overlay.mkdir(parents=True)
    base.mkdir()
    (base / "val.h").write_text("#define VAL 1\n")
    past = 1_700_000_000_000_000_000
    for d in (overlay, base):
        os.utime(d, ns=(past, past))
    env = {"STUBCACHE_DIR": str(root), "CPLUS_INCLUDE_PATH": f"{overlay}:{base}",
           "XDG_STATE_HOME": str(tmp_path / "state")}
    cfg = {"name": "restored_dir", "src": '#include <val.h>\nextern "C" int value(void) { return VAL; }'}
    assert call(cfg, env)[0] == 1
    assert call(cfg, env, require_hit=True)[0] == 1
    before = overlay.stat()
    (overlay / "val.h").write_text("#define VAL 2\n")  # an SDK update: tar puts the mtime back
    restore_times(overlay, before)
    assert overlay.stat().st_mtime_ns == before.st_mtime_ns
    assert warm_and_full(cfg, env, root) == (2, 2)


def _assembler(path: Path, value: int | None) -> None:
    """An ``as`` in front of the system's: with ``value``, it makes ``return 1`` return ``value``
    (another assembler, as far as the library is concerned)."""
    edit = (f"sed -i 's/movl\\t\\$1, %eax/movl\\t${value}, %eax/' \"$last\"\n" if value is not None else "")
    path.write_text(f'#!/bin/sh\nfor a; do last=$a; done\n{edit}exec /usr/bin/as "$@"\n')
    path.chmod(0o755)


@pytest.fixture
def gnu_toolchain():
    cxx = shutil.which(os.environ.get("CXX") or "c++") or ""
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.lower()
    if "clang" in out or not os.path.exists("/usr/bin/as"):
        pytest.skip("gcc's driver and GNU as (clang's integrated assembler runs no as)")


def test_an_assembler_under_gccs_long_spelling_of_dash_b_is_identified(tmp_path, gnu_toolchain):
    tools = tmp_path / "tools"
    tools.mkdir()
    _assembler(tools / "as", None)
    env = {"STUBCACHE_DIR": str(tmp_path / "root"), "XDG_STATE_HOME": str(tmp_path / "state")}
    cfg = {"name": "long_prefix", "src": 'extern "C" int value(void) { return 1; }', "cflags": [f"--prefix={tools}/"]}
    assert call(cfg, env)[0] == 1
    assert call(cfg, env, require_hit=True)[0] == 1
    _assembler(tools / "as", 3)  # the assembler there upgraded
    assert call(cfg, env)[0] == 3


def test_a_library_in_a_long_spelled_library_directory_is_watched(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    cxx = shutil.which(os.environ.get("CXX") or "c++") or "c++"

    def archive(where: Path, value: int) -> None:
        src = tmp_path / "val.cpp"
        src.write_text(f'extern "C" int val(void) {{ return {value}; }}')
        subprocess.run([cxx, "-fPIC", "-c", str(src), "-o", str(tmp_path / "val.o")], check=True)
        subprocess.run(["ar", "rcs", str(where / "libval.a"), str(tmp_path / "val.o")], check=True)

    archive(second, 1)
    env = {"STUBCACHE_DIR": str(tmp_path / "root"), "XDG_STATE_HOME": str(tmp_path / "state")}
    cfg = {"name": "long_libdir", "src": 'extern "C" int val(void);\nextern "C" int value(void) { return val(); }',
           "ldflags": [f"--library-directory={first}", "--library-directory", str(second), "-lval"]}
    assert call(cfg, env)[0] == 1
    assert call(cfg, env, require_hit=True)[0] == 1
    archive(first, 2)  # the same library, now found first
    assert call(cfg, env)[0] == 2


def test_gccs_long_spellings_are_scanned_as_their_short_forms():
    from stubcache.key.flagscan import scan, short_spellings

    assert short_spellings(["--prefix=/a/", "--prefix", "/b/", "--library-directory=/c", "--include-directory", "/d",
                            "--plugin=/p.so", "--machine-arch=native", "--for-linker=-L/e", "--no-standard-includes",
                            "--include=/h.h", "--ld-path=/l", "--sysroot=/s", "--specs=/f", "-O2"]) == [
        "-B/a/", "-B/b/", "-L/c", "-I/d", "-fplugin=/p.so", "-march=native", "-Xlinker", "-L/e", "-nostdinc",
        "-include", "/h.h", "--ld-path=/l", "--sysroot=/s", "--specs=/f", "-O2"]
    # The value of a flag that takes the next word is that flag's, whatever it looks like.
    kept = ["-Xassembler", "--prefix=/t", "-MF", "--prefix=/x", "--param", "--prefix=/y", "-o",
            "--include-directory=/d", "-Xpreprocessor", "--include", "-Xpreprocessor", "/etc/hostname"]
    assert short_spellings(kept) == kept
    found = scan(["--prefix=/a/", "--include-directory=/d", "--plugin=/p.so", "--machine-arch=native"],
                 ["--library-directory", "/c", "--for-linker", "-L/e", "-lval"])
    assert (found.tool_flags, found.search, found.files, found.host_targets, found.lib_dirs, found.lib_names) == (
        ("-B/a/",), ("-I/d",), ("/p.so",), ("-march=native",), ("/c", "/e"), ("val",))


@pytest.mark.parametrize("where", ["PATH", "PATH, CXX absolute", "COMPILER_PATH", "-B"])
def test_an_assembler_installed_earlier_in_the_drivers_search_is_noticed(tmp_path, gnu_toolchain, where):
    """gcc runs the first ``as`` in its -B and COMPILER_PATH directories, else the one PATH finds:
    an ``as`` that appears in such a directory searched earlier is run from then on."""
    tools = tmp_path / "tools"
    tools.mkdir()
    env = {"STUBCACHE_DIR": str(tmp_path / "root"), "XDG_STATE_HOME": str(tmp_path / "state")}
    cfg: dict = {"name": "earlier_as", "src": 'extern "C" int value(void) { return 1; }'}
    if where.startswith("PATH"):
        env["PATH"] = f"{tools}:{os.environ['PATH']}"
        if where.endswith("absolute"):  # no PATH lookup for the compiler itself
            env["CXX"] = os.path.realpath(shutil.which(os.environ.get("CXX") or "c++") or "c++")
    elif where == "COMPILER_PATH":
        env["COMPILER_PATH"] = str(tools)
    else:
        cfg["cflags"] = [f"-B{tools}/"]
    assert call(cfg, env)[0] == 1
    assert call(cfg, env, require_hit=True)[0] == 1
    _assembler(tools / "as", 4)  # installed where the driver looks first
    if where == "-B":  # no hit record for a spec that picks its own tools
        assert call(cfg, env)[0] == 4
    else:
        assert warm_and_full(cfg, env, tmp_path / "root") == (4, 4)


def test_a_working_directory_on_path_does_not_cost_the_record(tmp_path, gnu_toolchain):
    """PATH with an empty entry (the working directory): the probe watches for an ``as`` there,
    not for any change of the directory, so a process in another directory, or one that wrote a
    log where it runs, still takes the record (found by review: every call probed again)."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    env = {"STUBCACHE_DIR": str(tmp_path / "root"), "XDG_STATE_HOME": str(tmp_path / "state"),
           "PATH": ":" + os.environ["PATH"],
           "CXX": os.path.realpath(shutil.which(os.environ.get("CXX") or "c++") or "c++")}
    code = CALL.replace('print(json.dumps({"value"', 'print(json.dumps({"core": "stubcache.cache.core" in sys.modules, "value"')
    cfg = {"name": "cwd_on_path", "src": 'extern "C" int value(void) { return 6; }'}

    def run(cwd: Path) -> dict:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], cwd=cwd, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO), **env), timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert run(first)["value"] == 6
    (first / "engine.log").write_text("written where it runs\n")
    served = run(second)
    assert (served["core"], served["value"]) == (False, 6)  # the record answered
    (second / "as").write_text("#!/bin/sh\nexit 1\n")  # an as the driver would now run from here
    (second / "as").chmod(0o755)
    assert run(second)["core"] is True  # checked the full way again


def test_a_header_reached_through_a_link_in_a_system_directory_is_placed_by_its_name(tmp_path):
    """gcc names a header found in a system directory by its resolved path when that is shorter
    (``inc/o/h.h`` for ``<longsubname/h.h>`` with ``longsubname -> o``), which says nothing of the
    name searched for; the build asks it for the name it opened, so ``longsubname/h.h`` appearing
    in an earlier directory is noticed (found by review)."""
    early, sysdir = tmp_path / "e", tmp_path / "d"
    early.mkdir()
    (sysdir / "x").mkdir(parents=True)
    (sysdir / "inc" / "o").mkdir(parents=True)
    (sysdir / "inc" / "longsubname").symlink_to("o")
    (sysdir / "inc" / "o" / "h.h").write_text("#define V 2\n")
    env = {"STUBCACHE_DIR": str(tmp_path / "root"), "XDG_STATE_HOME": str(tmp_path / "state")}
    cfg = {"name": "linked_name", "src": '#include <longsubname/h.h>\nextern "C" int value(void) { return V; }',
           "cflags": [f"-I{early}", "-isystem", f"{sysdir}/x/../inc"]}
    assert call(cfg, env)[0] == 2
    assert call(cfg, env, require_hit=True)[0] == 2
    (early / "longsubname").mkdir()
    (early / "longsubname" / "h.h").write_text("#define V 5\n")
    assert call(cfg, env)[0] == 5
