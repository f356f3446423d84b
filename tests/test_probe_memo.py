"""The toolchain probes' memo per user and host (stubcache.key.probememo), in real processes: a new
root's first build reads the answers instead of running the compiler driver again; a changed
compiler is probed again; a memo that is not the user's own, or not a memo, is ignored."""

from __future__ import annotations

import json
import os
import shutil
import stat
import textwrap

import pytest

from .conftest import run_py

BUILD = """
import stubcache
print(stubcache.StubCache().load(stubcache.StubSpec("probed", 'extern "C" int v(void) { return %d; }')).v())
"""
PROBES = ("--version", "-###", "-print-prog-name", "-print-file-name", "-print-libgcc-file-name")


@pytest.fixture
def logged_cxx(tmp_path, monkeypatch):
    """A CXX that logs every invocation (probes too), then runs the real compiler."""
    log = tmp_path / "calls.log"
    script = tmp_path / "cxx-all.sh"
    real = shutil.which(os.environ.get("CXX") or "c++") or shutil.which("c++")
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$*" >> "{log}"
        exec "{real}" "$@"
        """))
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    return script, log


def build(root, value: int = 1) -> None:
    assert run_py(BUILD % value, env={"STUBCACHE_DIR": str(root)}).stdout.split() == [str(value)]


def probes(log) -> list[str]:
    calls = log.read_text().splitlines() if log.exists() else []
    if log.exists():
        log.unlink()
    return [c for c in calls if any(p in c.split() or c.split()[0].startswith(p) for p in PROBES)
            and ".cpp" not in c]


def memo_files(tmp_path) -> list:
    d = tmp_path / "state" / "stubcache" / "probes"
    return sorted(d.glob("*.json")) if d.exists() else []


def test_a_new_root_reads_the_probes_from_the_users_memo(cache_root, logged_cxx, tmp_path):
    _, log = logged_cxx
    build(tmp_path / "root-a")
    assert probes(log), "the first root probes the compiler"
    files = memo_files(tmp_path)
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE(files[0].parent.stat().st_mode) == 0o700
    build(tmp_path / "root-b", 2)
    assert probes(log) == []  # a new root, the same host and user: no driver probe


def test_a_changed_compiler_is_probed_again(cache_root, logged_cxx, tmp_path):
    script, log = logged_cxx
    build(tmp_path / "root-a")
    probes(log)
    with open(script, "a") as fh:
        fh.write("# another compiler\n")
    build(tmp_path / "root-b")
    assert probes(log)


def _spoil(tmp_path, how: str) -> None:
    d = tmp_path / "state" / "stubcache" / "probes"
    files = memo_files(tmp_path)
    if how == "dir writable by others":
        d.chmod(0o777)
    elif how == "dir a symlink":
        d.rename(d.with_name("real-probes"))
        d.symlink_to(d.with_name("real-probes"))
    for f in files:
        if how == "not ours":
            os.chown(f, 4242, -1)
        elif how == "group-writable":
            f.chmod(0o620)
        elif how == "symlink":
            real = f.with_suffix(".real")
            f.rename(real)
            f.symlink_to(real)
        elif how == "hostile json":
            data = json.loads(f.read_text())
            f.write_text(json.dumps({"memo_key": data["memo_key"], "value": [1, {"real": None}]}))
        elif how == "another key":
            data = json.loads(f.read_text())
            f.write_text(json.dumps({"memo_key": "cc6:elsewhere", "value": data["value"]}))
        elif how == "garbage":
            f.write_bytes(b"\x00{[" * 100)


@pytest.mark.parametrize("how", ["not ours", "group-writable", "symlink", "hostile json", "another key", "garbage",
                                 "dir writable by others", "dir a symlink"])
def test_a_memo_that_is_not_the_users_own_is_ignored(cache_root, logged_cxx, tmp_path, how):
    if how == "not ours" and os.geteuid() != 0:
        pytest.skip("needs root to give the file away")
    _, log = logged_cxx
    build(tmp_path / "root-a")
    probes(log)
    _spoil(tmp_path, how)
    build(tmp_path / "root-b", 3)
    assert probes(log), f"a memo spoilt as {how!r} was used"


def test_a_compiler_replaced_with_the_same_size_and_mtime_is_probed_again(cache_root, logged_cxx, tmp_path):
    """A program moved over CXX with the same size and modification time (found by review: the
    answer then crossed into a new root under the old compiler's identity)."""
    script, log = logged_cxx
    build(tmp_path / "root-a")
    probes(log)
    st = script.stat()
    other = script.with_name("cxx-other.sh")
    text = script.read_text()
    other.write_text(text.replace("exec ", "exec  ", 1)[:-1] if len(text) > 1 else text)
    assert other.stat().st_size == st.st_size
    other.chmod(0o755)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, script)
    assert script.stat().st_size == st.st_size and script.stat().st_mtime_ns == st.st_mtime_ns
    build(tmp_path / "root-b", 2)
    assert probes(log), "a replaced compiler took the old one's probe answers"


def test_a_memo_answer_of_the_wrong_shape_does_not_fail_the_build(cache_root, logged_cxx, tmp_path):
    _, log = logged_cxx
    build(tmp_path / "root-a")
    probes(log)
    for f in memo_files(tmp_path):
        data = json.loads(f.read_text())
        if data["memo_key"].startswith("cc6:"):
            f.write_text(json.dumps({"memo_key": data["memo_key"], "value": {}}))
    build(tmp_path / "root-b", 5)
    assert probes(log)


def test_a_state_directory_of_another_user_is_not_used(cache_root, logged_cxx, tmp_path, monkeypatch):
    """Root run with another user's HOME (sudo -E): a state tree that user controls is neither
    written nor pruned nor trusted, and a link planted at stubcache/ is not followed."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory away")
    _, log = logged_cxx
    state = tmp_path / "state"
    state.mkdir()
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    (state / "stubcache").symlink_to(chosen)
    build(tmp_path / "root-a")
    assert list(chosen.iterdir()) == []  # the planted link was not followed
    (state / "stubcache").unlink()
    os.chown(state, 4242, 4242)
    build(tmp_path / "root-b", 2)
    assert not (state / "stubcache").exists()
    assert probes(log)


def test_large_tracked_inputs_hashes_are_remembered_and_follow_the_file(tmp_path, monkeypatch):
    # A build's large tracked inputs (libc, libstdc++ ...) are hashed once per user and host:
    # the memo answers while the file's signature holds, and a rewrite (same size, mtime put
    # back) changes its ctime, so the file is hashed again.
    import hashlib
    import time

    from stubcache.key import tracking

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    lib = tmp_path / "lib" / "libbig.so"
    lib.parent.mkdir()
    lib.write_bytes(b"a" * (128 << 10))
    build = tmp_path / "build"
    build.mkdir()
    later = time.time_ns() + 60 * 10**9  # the build "started" after every write here: all stable
    first = tracking.track([str(lib)], str(build), [], None, later)
    assert first.files[str(lib)] == hashlib.sha256(b"a" * (128 << 10)).hexdigest()
    assert tracking.hash_memo()[str(lib)][1] == first.files[str(lib)]
    assert tracking.track([str(lib)], str(build), [], None, later).files == first.files
    st = lib.stat()
    time.sleep(0.01)
    lib.write_bytes(b"b" * (128 << 10))
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = tracking.track([str(lib)], str(build), [], None, later)
    assert again.files[str(lib)] == hashlib.sha256(b"b" * (128 << 10)).hexdigest()
    assert tracking.hash_memo()[str(lib)][1] == again.files[str(lib)]


def test_a_directory_named_twice_on_path_is_checked_once(tmp_path, monkeypatch):
    """The fingerprint memo's validators (which a hit record copies: each costs every warm start a
    ``stat``) hold each path once, however often PATH names it."""
    from stubcache.key import toolchain

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cxx = bin_dir / "c++"
    cxx.write_text("#!/bin/sh\nexec g++ \"$@\"\n")
    cxx.chmod(0o755)
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("PATH", os.pathsep.join([str(other), str(other), str(bin_dir), str(other)]))
    checks = toolchain.memo_checks({"cxx": {"path": str(cxx), "real": {}}}, {"CXX": "c++"}, None)
    paths = [p for p, _ in checks["validators"]]
    assert len(paths) == len(set(paths))
    assert str(other) in paths and str(bin_dir) in paths and str(cxx) in paths
