"""The compact hit path (stubcache.hit): a warm call answered through the hit record the full
path left, in real processes, and every way a record or an entry can be wrong sending the call
back to the full path, which then loads the right library (or refuses, as before)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import textwrap
from pathlib import Path

import pytest

from stubcache.dropin import compat
from stubcache.edge import fsroot
from stubcache import hit  # the compact hit path: the hit layer's package module
from stubcache.key import FIELDS

from .conftest import run_py

SRC = 'extern "C" int value(void) { return %d; }'

# A drop-in call and a StubCache.load, each printing its value, whether it took the compact path
# (the cache itself never imported) and the library it loaded.
DROPIN = """
import sys, ctypes, stubcache
path = stubcache.load_inline("recstub", %r, is_python_module=False, no_implicit_headers=True%s)
print(ctypes.CDLL(path).value(), "stubcache.cache.core" not in sys.modules, path)
"""
LOAD = """
import sys, stubcache
lib = stubcache.StubCache().load(stubcache.StubSpec("recstub", %r))
print(lib.value(), "stubcache.cache.core" not in sys.modules, lib._name)
"""


def dropin(value: int = 1, build_directory: str | None = None, env: dict | None = None) -> tuple[int, bool, str]:
    bd = "" if build_directory is None else f", build_directory={build_directory!r}"
    out = run_py(DROPIN % (SRC % value, bd), env=env).stdout.split()
    return int(out[0]), out[1] == "True", out[2]


def load(value: int = 1, env: dict | None = None) -> tuple[int, bool, str]:
    out = run_py(LOAD % (SRC % value,), env=env).stdout.split()
    return int(out[0]), out[1] == "True", out[2]


def records(root) -> list:
    state = root / "v1" / "state"
    return sorted(state.glob("hit-*.json")) if state.exists() else []


def warm(call) -> None:
    """Build and leave the record (first process), and check that the next ones take it."""
    assert call()[:2] == (1, False)
    assert call(env={"STUBCACHE_REQUIRE_HIT": "1"})[:2] == (1, True)


def test_forwarded_fields_and_flags_agree_with_the_full_modules():
    assert compat._FORWARDED == tuple(f.name for f in FIELDS if f.torch and f.name != "name")
    assert hit.FORWARDED == compat._FORWARDED
    assert (hit.O_DIR, hit.O_READ, hit.LIBRARY_CAP) == (fsroot.O_DIR, fsroot.O_READ, fsroot.LIBRARY_CAP)


def test_the_public_load_inline_carries_the_dropin_mark():
    """``stubcache/__init__.py`` marks its ``load_inline`` with the literal name (importing
    ``stubcache.hit`` for ``DROPIN_MARK`` would put it on every ``import stubcache``): held to
    the constant torch's loaders are told apart by."""
    import stubcache
    from stubcache.build import torchjit

    assert torchjit.is_dropin(stubcache.load_inline) and getattr(stubcache.load_inline, hit.DROPIN_MARK) is True


def test_default_root_is_platformdirs_on_linux(monkeypatch, tmp_path):
    import platformdirs

    monkeypatch.delenv("STUBCACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    # Relative, padded and ~ values are read differently by platformdirs releases: those are left
    # to it (None: the full path); where the record names a root, it is the one the full path uses.
    for xdg in (None, "", str(tmp_path / "xdg"), str(tmp_path / "xdg") + "/", "cache", "~/c", f"  {tmp_path}  "):
        for home in (str(tmp_path / "home"), str(tmp_path / "home") + "/", "relhome"):
            if xdg is None:
                monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
            else:
                monkeypatch.setenv("XDG_CACHE_HOME", xdg)
            monkeypatch.setenv("HOME", home)
            quick = hit.default_root()
            assert quick in (None, platformdirs.user_cache_dir("stubcache")), (xdg, home, quick)
            plain = xdg in (None, "", str(tmp_path / "xdg"), str(tmp_path / "xdg") + "/")
            assert quick is not None or home == "relhome" or not plain, (xdg, home)


def test_a_cache_keeps_the_root_it_was_made_with(cache_root, cxx, tmp_path, monkeypatch):
    """A StubCache made with a relative root, or from STUBCACHE_DIR, keeps that root after a chdir
    or a change of the variable: its hits and its builds come from one root."""
    import subprocess
    import sys

    from .conftest import REPO

    code = textwrap.dedent("""
        import os, stubcache
        os.makedirs("a", exist_ok=True); os.makedirs("b", exist_ok=True)
        os.chdir("a")
        rel = stubcache.StubCache("rel")
        env = stubcache.StubCache()
        os.chdir("../b")
        os.environ["STUBCACHE_DIR"] = os.path.abspath("moved")
        spec = stubcache.StubSpec("kept", 'extern "C" int v(void) { return 4; }')
        for cache in (rel, env):
            before = cache.root
            assert cache.load(spec).v() == 4
            print(before == cache.root, cache.root)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO), STUBCACHE_DIR=str(cache_root)))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == f"True {tmp_path / 'a' / 'rel'}" and lines[1] == f"True {cache_root}"
    assert (tmp_path / "a" / "rel" / "v1" / "entries").is_dir() and not (tmp_path / "b" / "rel").exists()
    assert not (tmp_path / "b" / "moved").exists()


@pytest.mark.parametrize("call", [dropin, load], ids=["dropin", "load"])
def test_a_warm_call_takes_the_record_and_is_pinned_and_counted(cache_root, cxx, call):
    warm(call)
    assert cxx.compiles() == 1 and len(records(cache_root)) == 1
    # The hits are counted, the compact one included (one event file per process).
    events = [json.loads(line) for f in (cache_root / "v1" / "events").iterdir()
              for line in f.read_text().splitlines()]
    assert sum(e["ev"] == "hit" for e in events) == 1 and {e["name"] for e in events if e["ev"] == "hit"} == {"recstub"}
    # The compact hit holds the entry's shared pin while its process lives: prune skips it.
    import subprocess
    import sys

    code = (LOAD % (SRC % 1,)) if call is load else (DROPIN % (SRC % 1, ""))
    code += "\nsys.stdout.flush()\nsys.stdin.read()\n"

    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, STUBCACHE_REQUIRE_HIT="1"))
    try:
        line = child.stdout.readline().split()
        assert line[:2] == ["1", "True"]
        from stubcache.storage import locking

        key = json.loads(records(cache_root)[0].read_text())["key"]
        with fsroot.Dir(str(cache_root / "v1" / "pins")) as pins:
            assert locking.flock_held_at(pins, key)
    finally:
        child.communicate("", timeout=60)


def test_dropin_with_a_build_directory_uses_the_placed_file_and_replaces_a_wrong_one(cache_root, cxx, tmp_path):
    bd = tmp_path / "bd"
    bd.mkdir()
    warm(lambda env=None: dropin(build_directory=str(bd), env=env))
    placed = bd / "recstub.so"
    assert dropin(build_directory=str(bd)) == (1, True, str(placed))
    ino = placed.stat().st_ino
    assert dropin(build_directory=str(bd)) == (1, True, str(placed)) and placed.stat().st_ino == ino  # kept
    entry = json.loads(records(cache_root)[0].read_text())
    # Another library of ours at the path (same size, other bytes): never loaded as is; the
    # compact path puts a copy of the entry's in its place.
    data = bytearray(placed.read_bytes())
    data[-1] ^= 0xFF
    placed.unlink()
    placed.write_bytes(bytes(data))
    placed.chmod(0o755)
    assert dropin(build_directory=str(bd)) == (1, True, str(placed))
    assert hashlib.sha256(placed.read_bytes()).hexdigest() == entry["sha256"]
    # A link planted there: replaced, never followed (its target keeps its bytes).
    target = tmp_path / "elsewhere.so"
    target.write_bytes(b"not a library")
    placed.unlink()
    placed.symlink_to(target)
    assert dropin(build_directory=str(bd)) == (1, True, str(placed))
    assert not placed.is_symlink() and target.read_bytes() == b"not a library"
    # A directory where the library goes: the full path reports it, as before.
    placed.unlink()
    placed.mkdir()
    proc = run_py(DROPIN % (SRC % 1, f", build_directory={str(bd)!r}"), check=False)
    assert proc.returncode != 0 and "a directory has its name" in proc.stderr
    placed.rmdir()
    # A directory others can write (not sticky): refused by the full path, as before.
    bd.chmod(0o777)
    proc = run_py(DROPIN % (SRC % 1, f", build_directory={str(bd)!r}"), check=False)
    assert proc.returncode != 0 and "writable by others" in proc.stderr
    assert not placed.exists()
    assert [p.name for p in bd.iterdir()] == []  # no temporary file left by either path
    assert cxx.compiles() == 1


def test_dropin_with_a_new_build_directory_places_the_library_without_the_full_path(cache_root, cxx, tmp_path):
    """A warm host's first call with a build directory that does not hold the library yet (a
    container's fresh /tmp: SGLang's and vLLM's NCCL allocators load ``{dir}/{name}.so``
    themselves): the compact path copies the entry's library there, checked, and loads that very
    file; the cache itself is never imported. The copy is the caller's file, one link (never the
    entry's inode), mode 0755 less the umask: written by no one else, whatever the umask (a group
    member who could write it after it was hashed would have their bytes loaded), so the next
    call keeps it."""
    warm(dropin)
    for i in range(2):
        bd = tmp_path / f"fresh{i}"
        bd.mkdir()
        placed = bd / "recstub.so"
        assert dropin(build_directory=str(bd), env={"STUBCACHE_REQUIRE_HIT": "1"}) == (1, True, str(placed))
        st = placed.stat()
        entry_lib = next((cache_root / "v1" / "entries").glob("*/recstub.so"))
        assert st.st_nlink == 1 and st.st_ino != entry_lib.stat().st_ino
        assert placed.read_bytes() == entry_lib.read_bytes()
        assert stat.S_IMODE(st.st_mode) == 0o755 & ~_umask()
        assert sorted(p.name for p in bd.iterdir()) == ["recstub.so"]
    # Under umask 002 (group-writable files by default): still 0755, and kept by the next call.
    bd = tmp_path / "umask002"
    bd.mkdir()
    old = os.umask(0o002)
    try:
        placed = bd / "recstub.so"
        assert dropin(build_directory=str(bd))[:2] == (1, True)
        assert stat.S_IMODE(placed.stat().st_mode) == 0o755
        ino = placed.stat().st_ino
        assert dropin(build_directory=str(bd))[:2] == (1, True) and placed.stat().st_ino == ino
    finally:
        os.umask(old)
    assert cxx.compiles() == 1


CTOR_SRC = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void ran(void) {
    const char *log = getenv("CTOR_LOG");
    if (log) { int fd = open(log, O_WRONLY | O_APPEND | O_CREAT, 0644); if (fd >= 0) { write(fd, "c\n", 2); close(fd); } }
}
extern "C" int value(void) { return 5; }
"""
NO_MAP_FILES = ["setpriv", "--bounding-set=-sys_admin,-checkpoint_restore"]


def _skip_unless_map_files_can_be_refused() -> None:
    import subprocess
    import sys

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to drop capabilities")
    probe = subprocess.run([*NO_MAP_FILES, sys.executable, "-c", "import os; d = '/proc/self/map_files/'; "
                            "os.stat(d + os.listdir(d)[0])"], capture_output=True, text=True)
    if "PermissionError" not in probe.stderr or "map_files" not in probe.stderr:  # (setpriv itself may be refused)
        pytest.skip("setpriv cannot drop those capabilities here, or this kernel lets a process without "
                    "them read /proc/self/map_files")


@pytest.mark.parametrize("fs", ["tmp", "btrfs"])
def test_the_compact_path_checks_the_mapping_where_proc_map_files_is_refused(cache_root, cxx, tmp_path, fs, request,
                                                                            monkeypatch):
    """``/proc/self/map_files`` needs CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN (Linux 5.9 on): an
    ordinary user's process, or root's in a container with Docker's default capabilities, gets
    EPERM there. The compact path then finds the library's mappings in ``/proc/self/maps``;
    before, every such warm call fell to the full path (after a ``dlclose``, so a library's
    constructors ran twice). Root here, with those two capabilities dropped (``setpriv``).

    On btrfs (the root and the build directory there), /proc/self/maps shows another device
    than ``stat`` for the same file: before, every such load was refused as "not the verified
    file" (an IntegrityError, full path and all), for every process without those capabilities."""
    import subprocess
    import sys

    _skip_unless_map_files_can_be_refused()
    base = tmp_path
    if fs == "btrfs":
        base = request.getfixturevalue("btrfs_dir") / tmp_path.name
        base.mkdir()
        monkeypatch.setenv("STUBCACHE_DIR", str(base / "cache"))
    code = """
import sys, stubcache
path = stubcache.load_inline("ctorstub", %r, is_python_module=False, no_implicit_headers=True%s)
print("stubcache.cache.core" not in sys.modules, path)
"""
    log = tmp_path / "ctor.log"

    def call(build_directory: str | None = None, capped: bool = True) -> tuple[bool, str, int]:
        before = log.read_text().count("c") if log.exists() else 0
        bd = "" if build_directory is None else f", build_directory={build_directory!r}"
        proc = subprocess.run([*(NO_MAP_FILES if capped else []), sys.executable, "-c", code % (CTOR_SRC, bd)],
                              env=dict(os.environ, CTOR_LOG=str(log)), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout.split()
        return out[0] == "True", out[1], log.read_text().count("c") - before

    bd = base / "bd"
    bd.mkdir()
    assert call(capped=False)[0] is False  # builds, leaves the record
    assert call()[0::2] == (True, 1)
    assert call(str(bd)) == (True, str(bd / "ctorstub.so"), 1)  # placed in a new directory: once
    assert call(str(bd)) == (True, str(bd / "ctorstub.so"), 1)  # the copy there
    assert cxx.compiles() == 1


def test_on_btrfs_without_map_files_a_library_swapped_before_the_load_is_still_refused(btrfs_dir, tmp_path):
    """The pair /proc/self/maps shows for the verified file (read from a mapping of the verified
    descriptor itself) accepts that file only: an entry replaced between the check and the
    ``dlopen`` (here on btrfs, in a process without map_files) is still refused."""
    import subprocess
    import sys

    _skip_unless_map_files_can_be_refused()
    base = btrfs_dir / tmp_path.name
    base.mkdir()
    code = """
import os, sys, stubcache
from stubcache.edge.errors import IntegrityError
cache = stubcache.StubCache(sys.argv[1])
entry = cache.get_or_build(stubcache.StubSpec("swapped", 'extern "C" int f(void) { return 1; }'))
cache._lib_fds[entry.path] = cache._open_checked(entry)  # what load_entry verifies first
other = stubcache.StubCache(sys.argv[2]).get_or_build(
    stubcache.StubSpec("swapped", 'extern "C" int f(void) { return 2; }'))
os.chmod(os.path.dirname(entry.path), 0o700)
os.replace(other.path, entry.path)  # replaced after the check, before the dlopen
try:
    cache.load_entry(entry)
except IntegrityError as exc:
    print("refused", "not the verified file" in str(exc))
else:
    print("loaded")
"""
    proc = subprocess.run([*NO_MAP_FILES, sys.executable, "-c", code, str(base / "a"), str(base / "b")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["refused", "True"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_record_goes_stale_when_the_compiler_changes(cache_root, cxx):
    warm(load)
    n = cxx.compiles()
    with open(cxx.path, "a") as fh:
        fh.write("# changed\n")  # another compiler script: its identity is in the key
    assert load()[:2] == (1, False)
    assert cxx.compiles() == n + 1  # rebuilt under the new compiler's key, not served from the record
    assert load()[:2] == (1, True)  # and the new record serves the next process


def test_a_record_watches_the_source_of_every_module_that_decides_a_key(cache_root, cxx):
    """Each file of hit.KEY_MODULE_FILES exists (a package's own module is its __init__.py), and
    a record holds a signature for each: an upgrade or an edit of one stales the record."""
    package = Path(hit.__file__).resolve().parent.parent
    files = {str(package / rel) for rel in hit.KEY_MODULE_FILES}
    # Besides the key's own modules: the fronts that form each request's digest, and the JSON
    # writer whose text derive hashes into every key (edits inside one install stale the record).
    assert {"__init__.py", "hit/front.py", "edge/cjson.py", "key/derive.py"} <= set(hit.KEY_MODULE_FILES)
    assert all(os.path.isfile(f) for f in files), [f for f in files if not os.path.isfile(f)]
    warm(load)
    rows = {path: sig for path, sig in json.loads(records(cache_root)[0].read_text())["validators"]}
    watched = {os.path.realpath(p) for p, sig in rows.items() if sig is not None}
    assert {os.path.realpath(f) for f in files} <= watched


def test_a_record_goes_stale_when_a_key_variable_changes(cache_root, cxx):
    warm(load)
    assert load(env={"CPATH": "/nonexistent"})[:2] == (1, False)


def test_a_truncated_library_is_not_loaded_through_the_record(cache_root, cxx):
    warm(dropin)
    key = json.loads(records(cache_root)[0].read_text())["key"]
    entry = cache_root / "v1" / "entries" / key
    lib = next(p for p in entry.iterdir() if p.suffix == ".so")
    lib.chmod(0o644)
    with open(lib, "r+b") as fh:
        fh.truncate(100)
    assert dropin()[:2] == (1, False)  # the full path quarantined and rebuilt it
    assert cxx.compiles() == 2 and list((cache_root / "v1" / "quarantine").iterdir())


def test_a_root_others_can_write_is_not_used_through_the_record(cache_root, cxx):
    warm(load)
    (cache_root / "v1" / "entries").chmod(0o777)
    value, quick, path = load()
    assert (value, quick) == (1, False) and not path.startswith(str(cache_root))  # built privately


def _spoil(record, how: str) -> None:
    if how == "not ours":
        os.chown(record, 4242, -1)
    elif how == "group-writable":
        record.chmod(0o660)
    elif how == "symlink":
        real = record.with_name("real.json")
        record.rename(real)
        record.symlink_to(real)
    elif how == "fifo":
        record.unlink()
        os.mkfifo(record, 0o600)
    else:
        data = json.loads(record.read_text())
        if how == "wrong types":
            data.update(size="32", validators={"a": 1}, tracked=[[1, 2]])
        elif how == "path in key":
            data["key"] = "../../../../tmp"
        elif how == "library elsewhere":
            data["library"] = "/lib/x86_64-linux-gnu/libc.so.6"
        elif how == "huge":
            data["pad"] = "x" * (hit.RECORD_CAP + 1)
        text = json.dumps(data)
        if how == "deep":
            text = text[:-1] + ', "pad": ' + "[" * 100_000 + "]" * 100_000 + "}"
        record.write_text(text)


@pytest.mark.parametrize("how", ["not ours", "group-writable", "symlink", "fifo", "wrong types", "path in key",
                                 "library elsewhere", "deep", "huge"])
def test_a_spoilt_record_is_ignored(cache_root, cxx, how):
    if how == "not ours" and os.geteuid() != 0:
        pytest.skip("needs root to give the record away")
    warm(load)
    _spoil(records(cache_root)[0], how)
    assert load(env={"STUBCACHE_REQUIRE_HIT": "1"})[:2] == (1, False)  # the full path, a hit there
    assert cxx.compiles() == 1


PATCHED = """
import sys, ctypes, stubcache
import torch.utils.cpp_extension as ext
stubcache.patch_torch()
path = ext.load_inline("recstub", %r, is_python_module=False, no_implicit_headers=True)
print(ctypes.CDLL(path).value(), "stubcache.cache.core" not in sys.modules, "stubcache.dropin.compat" not in sys.modules)
"""


@pytest.mark.torch
def test_a_patched_torch_takes_the_record_too(cache_root, cxx):
    """An engine under `stubcache run` (torch's load_inline patched): a warm call imports neither
    the cache nor the whole drop-in."""
    assert run_py(PATCHED % (SRC % 1,)).stdout.split() == ["1", "False", "False"]
    assert run_py(PATCHED % (SRC % 1,), env={"STUBCACHE_REQUIRE_HIT": "1"}).stdout.split() == ["1", "True", "True"]


UNPATCHED = """
import sys, ctypes
import torch.utils.cpp_extension as ext
path = ext.load_inline("recstub", %r, is_python_module=False, no_implicit_headers=True)
print(ctypes.CDLL(path).value(), "stubcache.cache.core" not in sys.modules, "stubcache.dropin.compat" not in sys.modules)
"""


@pytest.mark.torch
def test_an_engine_under_stubcache_run_takes_the_record(cache_root, cxx):
    """`stubcache run -- CMD` patches torch in every Python process it starts (through the
    STUBCACHE_PATCH_TORCH variable it sets): a warm call there takes the record too."""
    import subprocess
    import sys

    from .conftest import REPO

    cmd = [sys.executable, "-m", "stubcache", "run", "--", sys.executable, "-c", UNPATCHED % (SRC % 1,)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    seen = []
    for _ in range(3):  # the build (full path, leaves the record), then warm starts
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        seen.append(out.stdout.split()[-3:])
        env["STUBCACHE_REQUIRE_HIT"] = "1"
    assert seen[0] == ["1", "False", "False"] and seen[-1] == ["1", "True", "True"], seen


def test_variables_stubcache_does_not_read_keep_the_record(cache_root, cxx):
    """An unknown STUBCACHE_* variable (a test harness's, a typo) is ignored by the full path, so
    the record answers under it too."""
    warm(load)
    assert load(env={"STUBCACHE_TEST_SOMETHING": "1"})[:2] == (1, True)


def test_every_variable_stubcache_reads_is_sorted_for_the_record():
    """Each STUBCACHE_ variable named in the package either needs the full path or is one a
    record may answer under: a new setting must be placed (hit.FULL_PATH_SETTINGS)."""
    import re
    from pathlib import Path

    import stubcache

    pkg = Path(stubcache.__file__).parent
    names = set()
    for f in pkg.rglob("*.py"):
        names |= set(re.findall(r"STUBCACHE_[A-Z][A-Z_]*[A-Z]", f.read_text(encoding="utf-8")))
    from stubcache.edge import settings

    record_ok = {v.name for v in settings.VARIABLES if not v.full_path}
    assert record_ok == {"STUBCACHE_DIR", "STUBCACHE_REQUIRE_HIT", "STUBCACHE_PATCH_TORCH"}
    full = {n.decode() for n in hit.FULL_PATH_SETTINGS}
    remote = {n for n in names if n.startswith(hit.FULL_PATH_PREFIX.decode())}
    assert names - record_ok - full - remote == set(), "place these in hit.FULL_PATH_SETTINGS or say why not"


def test_the_hit_layers_flag_words_are_the_settings_own():
    """stubcache.hit keeps a copy of the yes/no words (it imports no settings module): the same words."""
    from stubcache.edge import settings

    assert set(hit.FLAG_TRUE) == {w for w in settings._FLAG_TRUE}
    assert set(hit._FLAG_VALUES) == set(settings._FLAG_TRUE) | set(settings._FLAG_FALSE)
    for word in hit._FLAG_VALUES:
        assert settings.flag("X", {"X": word}) is (word in hit.FLAG_TRUE)


def test_the_patched_load_inline_hands_only_unsupported_calls_to_torch(cache_root, monkeypatch):
    from stubcache.build import torchjit
    from stubcache.dropin import patch

    calls = []
    monkeypatch.setitem(torchjit._originals, "load_inline", lambda *a, **k: calls.append(k) or "torch's own")
    wrapper = patch._wrapper("load_inline")
    assert wrapper("sycl", "int f();", sycl_sources="x") == "torch's own" and calls == [{"sycl_sources": "x"}]
    with pytest.raises(ValueError, match="invalid stub name"):  # stubcache's own error, not torch's call
        wrapper("not a name", "int f();", is_python_module=False)
    assert len(calls) == 1


def test_a_setting_to_check_takes_the_full_path(cache_root, cxx):
    warm(load)
    assert load(env={"STUBCACHE_LOCK_TIMEOUT": "30"})[:2] == (1, False)
    proc = run_py(LOAD % (SRC % 1,), env={"STUBCACHE_LOCK_TIMEOUT": "soon"}, check=False)
    assert proc.returncode != 0 and "STUBCACHE_LOCK_TIMEOUT" in proc.stderr
    proc = run_py(LOAD % (SRC % 1,), env={"STUBCACHE_REQUIRE_HIT": "maybe"}, check=False)
    assert proc.returncode != 0 and "STUBCACHE_REQUIRE_HIT" in proc.stderr


def test_records_are_private(cache_root, cxx):
    warm(dropin)
    st = records(cache_root)[0].stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()


def test_a_hit_through_a_record_is_counted_once_per_process(cache_root, cxx):
    """load() through the record, then get_or_build() of the same spec in the same process (the
    full path's lookup of the same entry): one hit, as when the full path served both."""
    warm(load)
    run_py("""
        import stubcache
        c = stubcache.StubCache()
        spec = stubcache.StubSpec("recstub", %r)
        assert c.load(spec).value() == 1
        c.get_or_build(spec)
    """ % (SRC % 1,), env={"STUBCACHE_REQUIRE_HIT": "1"})
    events = [json.loads(line) for f in (cache_root / "v1" / "events").iterdir()
              for line in f.read_text().splitlines()]
    assert sum(e["ev"] == "hit" for e in events) == 2  # warm()'s second process, and this one


def test_another_home_does_not_reuse_a_record(cache_root, cxx, tmp_path):
    """HOME and XDG_CONFIG_HOME name a compiler cache's config files (its `compiler =`)."""
    warm(load)
    assert load(env={"HOME": str(tmp_path)})[:2] == (1, False)
    assert load(env={"XDG_CONFIG_HOME": str(tmp_path)})[:2] == (1, False)


def test_the_request_digest_takes_a_non_str_sys_path_entry(monkeypatch):
    import pathlib

    monkeypatch.setattr("sys.path", [*__import__("sys").path, pathlib.Path("/nonexistent")])
    assert hit.request_digest("spec", ({"a": "b"},)) is not None


def test_the_request_lock_follows_no_planted_file_and_waits_no_longer_than_its_bound(tmp_path):
    """The request lock (``v1/state/hit-<digest>.lock``, stubcache.hit.request_turn) in a
    private root: a symlink planted there is not followed (its target outside the root is
    neither created nor written), a FIFO does not hang the caller, and a lock another process
    holds forever costs at most REQUEST_WAIT before the caller goes on (to the full path)."""
    import time

    from tests.test_locking import Holder

    root = tmp_path / "root"
    first = hit.request_turn(str(root), "a" * 32, make_root=True)  # makes root/v1/state, 0700
    assert isinstance(first, int) and first >= 0
    os.close(first)
    state = root / "v1" / "state"
    outside = tmp_path / "outside"
    os.symlink(outside, state / hit.request_lock_name("b" * 32))
    assert hit.request_turn(str(root), "b" * 32) is None and not os.path.lexists(outside)
    os.mkfifo(state / hit.request_lock_name("c" * 32))
    t0 = time.monotonic()
    assert hit.request_turn(str(root), "c" * 32) is None and time.monotonic() - t0 < 5
    holder = Holder(state / hit.request_lock_name("d" * 32))
    try:
        fds = len(os.listdir("/proc/self/fd"))
        t0 = time.monotonic()
        assert hit.request_turn(str(root), "d" * 32) == hit.WAITED
        assert hit.REQUEST_WAIT <= time.monotonic() - t0 < hit.REQUEST_WAIT + 5
        holder.release()
        deadline = time.monotonic() + 10  # the waiting thread lets go of its descriptor once granted
        while len(os.listdir("/proc/self/fd")) > fds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/fd")) <= fds
    finally:
        holder.close()


@pytest.mark.parametrize("how", ["release", "kill -9"])
def test_a_request_waiter_goes_on_the_moment_the_holder_lets_go(tmp_path, monkeypatch, how):
    """A waiter (stubcache.hit.request_turn) returns when the process serving the request lets
    go of its lock, by closing it or by dying, not when its bound runs out (set far above here)."""
    import threading
    import time

    from tests.test_locking import Holder

    monkeypatch.setattr(hit, "REQUEST_WAIT", 60.0)
    root = tmp_path / "root"
    os.close(hit.request_turn(str(root), "a" * 32, make_root=True))
    holder = Holder(root / "v1" / "state" / hit.request_lock_name("e" * 32))
    try:
        timer = threading.Timer(0.3, holder.release if how == "release" else holder.close)
        timer.start()
        t0 = time.monotonic()
        assert hit.request_turn(str(root), "e" * 32) == hit.WAITED
        assert 0.25 <= time.monotonic() - t0 < 30
        timer.join()
    finally:
        holder.close()


# --- the import path: an engine's script directory ----------------------------------------------
# An engine started as `python engine.py` (or `python -m engine`) has its own directory first on
# sys.path, and often writes there (a log, an output). The record and the whole-fingerprint memo
# hold across that; a torch planted there (which would be the one found) makes neither hold.

ENGINE = """
import sys, ctypes, stubcache
spec = stubcache.StubSpec("recstub", %r)
if sys.argv[1] == "load":  # through the record where it holds
    value = stubcache.StubCache().load(spec).value()
else:  # the full path: its fingerprint comes from the memo unless stubcache.key.toolchain is imported
    value = ctypes.CDLL(stubcache.StubCache().get_or_build(spec).path).value()
print(value, "stubcache.cache.core" not in sys.modules, "stubcache.key.toolchain" not in sys.modules)
"""
FAKE_TORCH = "raise SystemExit('the planted torch was imported')\n"


def engine(script, mode: str = "load", pythonpath: str = "") -> tuple[int, bool, bool]:
    """Run ``script`` as ``python script.py MODE``: its value, whether it took the compact path (the
    cache never imported), and whether its fingerprint came from the memo (no toolchain probe)."""
    import subprocess
    import sys

    from .conftest import REPO

    path = os.pathsep.join(p for p in (pythonpath, str(REPO)) if p)
    out = subprocess.run([sys.executable, str(script), mode], cwd=script.parent.parent, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=path))
    assert out.returncode == 0, out.stderr
    value, quick, memo = out.stdout.split()
    return int(value), quick == "True", memo == "True"


def engine_dir(tmp_path):
    d = tmp_path / "engine"
    d.mkdir()
    script = d / "engine.py"
    script.write_text(ENGINE % (SRC % 1,))
    return script


def test_an_engine_writing_into_its_script_directory_keeps_the_record_and_the_memo(cache_root, cxx, tmp_path):
    script = engine_dir(tmp_path)
    assert engine(script) == (1, False, False)  # the build: leaves the memo and the record
    assert engine(script)[:2] == (1, True)
    (script.parent / "engine.log").write_text("started\n")  # the directory's mtime changes
    assert engine(script)[:2] == (1, True)
    assert engine(script, "build") == (1, False, True)  # the full path: the memo held too
    (script.parent / "out").mkdir()
    assert engine(script)[:2] == (1, True)
    assert cxx.compiles() == 1


@pytest.mark.parametrize("plant", ["torch.py", "torch/", "torch<ext>", "torch.pyc"])
def test_a_torch_planted_in_the_script_directory_stales_the_record_and_the_memo(cache_root, cxx, tmp_path, plant):
    import importlib.machinery

    script = engine_dir(tmp_path)
    assert engine(script) == (1, False, False)
    (script.parent / "engine.log").write_text("started\n")
    assert engine(script)[:2] == (1, True)
    where = script.parent / plant.replace("<ext>", importlib.machinery.EXTENSION_SUFFIXES[0])
    if plant.endswith("/"):
        where.mkdir()
        (where / "__init__.py").write_text(FAKE_TORCH)
    else:
        where.write_text(FAKE_TORCH)  # found, never imported: the child does not import torch
    # Neither the record nor the memo answers: the full path computes the fingerprint again
    # (finding the planted torch; what it then builds is its business).
    assert engine(script)[1:] == (False, False)
    assert engine(script, "build")[1:] == (False, True)  # and its new memo holds for it


def test_an_import_path_directory_replaced_by_a_file_stales_the_record_and_the_memo(cache_root, cxx, tmp_path):
    import zipfile

    script = engine_dir(tmp_path)
    extra = tmp_path / "extra"  # a PYTHONPATH directory before torch's
    extra.mkdir()
    assert engine(script, pythonpath=str(extra)) == (1, False, False)
    (extra / "notes.txt").write_text("x")
    assert engine(script, pythonpath=str(extra))[:2] == (1, True)
    for p in extra.iterdir():
        p.unlink()
    extra.rmdir()
    with zipfile.ZipFile(extra, "w") as zf:  # a zip archive on sys.path: zipimport searches it
        zf.writestr("torch.py", FAKE_TORCH)
    assert engine(script, pythonpath=str(extra))[1:] == (False, False)


def test_import_path_checks_keep_mtime_validators_where_a_new_file_can_change_imports(tmp_path):
    """The rows of the import path (toolchain.import_path_checks): plain directories are shadows
    named by the files that would hold another torch; site directories (a new .pth there can
    add an import hook), files (zip archives) and absent entries keep their mtime validators;
    every directory row also watches for a .pth file appearing (those there already are allowed
    and validated by their own signatures);
    after torch's directory only what start-up processes is watched; a watched name that exists
    already is a validator itself; a relative entry is recorded as given."""
    from stubcache.key import toolchain
    from stubcache.key.inputs import dir_sig

    script, plain, pthdir, site, user_site, after = (tmp_path / n for n in ("script", "plain", "pthdir", "site",
                                                                          "usersite", "after"))
    for d in (script, plain, pthdir, site, user_site, after):
        d.mkdir()
    (pthdir / "extra.pth").write_text(str(plain) + "\n")
    archive = tmp_path / "lib.zip"
    archive.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    absent = tmp_path / "absent"
    torch = site / "torch"
    torch.mkdir()
    names = toolchain.import_shadow_names([".cpython-311-x86_64-linux-gnu.so", ".abi3.so", ".so"])
    assert {"torch", "torch.py", "torch.pyc", "torch.cpython-311-x86_64-linux-gnu.so", "torch.abi3.so",
            "torch.so"} <= set(names)
    import time

    from stubcache.key.inputs import CLOCK_SLACK_NS

    # Signatures older than the clock's slack (judged by the ctime, which no utime sets back):
    # ones a later write cannot share, so they are recorded.
    time.sleep(2 * CLOCK_SLACK_NS / 1e9)
    entries = [str(script), str(archive), str(pthdir), str(absent), str(user_site), str(plain), str(site), str(after)]
    validators, shadows = toolchain.import_path_checks(entries, [str(site), str(user_site)], str(torch), names)
    assert validators == [str(archive), str(pthdir / "extra.pth"), str(absent), str(user_site), str(site)]
    watched = [*names, hit.ANY_PTH]
    startup = [n for n in names if n.startswith(("sitecustomize", "usercustomize"))]
    assert startup and not any(n.startswith("torch") for n in startup)
    assert shadows == {str(script): [dir_sig(str(script)), watched], str(plain): [dir_sig(str(plain)), watched],
                       str(pthdir): [shadows[str(pthdir)][0], [*watched, hit.KNOWN_PTH + "extra.pth"]],
                       str(after): [dir_sig(str(after)), [*startup, hit.ANY_PTH]]}
    # A namespace torch/ (it loses to the installed package) and a sitecustomize.py already there:
    # each can change without its directory changing (an __init__.py placed inside).
    (plain / "torch").mkdir()
    (after / "sitecustomize.py").write_text("")
    validators = toolchain.import_path_checks(entries, [str(site), str(user_site)], str(torch), names)[0]
    assert str(plain / "torch") in validators and str(after / "sitecustomize.py") in validators
    assert str(torch) not in validators  # torch's own directory: its version.py is the memo's validator
    (plain / "torch").rmdir()
    (after / "sitecustomize.py").unlink()
    # '' (python -c, a REPL) is the working directory of whichever process checks the row.
    cwd = os.getcwd()
    try:
        os.chdir(plain)
        assert "." in toolchain.import_path_checks(["", str(site)], [str(site)], str(torch), names)[1]
    finally:
        os.chdir(cwd)
    # A directory written just now gets no signature (a write within the same clock tick could
    # leave the same mtime): its names are checked every time.
    (plain / "new").write_text("")
    assert toolchain.import_path_checks([str(plain)], [], None, names)[1] == {str(plain): [None, watched]}
    # A site directory named through a link is still one.
    link = tmp_path / "sitelink"
    link.symlink_to(site)
    validators, shadows = toolchain.import_path_checks([str(site)], [str(link)], str(torch), names)
    assert validators == [str(site)] and shadows == {}
    # ``site`` unable to say: every entry by mtime, as before.
    validators, shadows = toolchain.import_path_checks(entries, None, str(torch), names)
    assert validators == [*entries[:3], str(pthdir / "extra.pth"), *entries[3:]] and shadows == {}
    # No torch found: every entry is checked (one appearing anywhere would be found).
    validators, shadows = toolchain.import_path_checks(entries, [str(site)], None, names)
    assert str(after) in shadows and str(site) in validators
