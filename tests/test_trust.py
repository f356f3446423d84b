"""Trust model: refusing unsafe paths, shared roots for several real users, seed stores,
require-hit and degraded builds on unwritable roots."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from stubcache import CacheMissError, StubCache, StubSpec
from stubcache.admin.shared import init_root

from .conftest import run_py

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (real users, mounts)")


def src(n: int) -> str:
    return f'extern "C" int value(void) {{ return {n}; }}\n'


def only_entry(root: Path) -> Path:
    [e] = list((root / "v1" / "entries").iterdir())
    return e


def library_of(entry: Path) -> Path:
    return next(p for p in entry.iterdir() if p.suffix == ".so")


LOAD = """
import os, stubcache
print(stubcache.StubCache().load(stubcache.StubSpec("trust", os.environ["SRC"])).value())
"""


def build_one(cache_root: Path, n: int = 1) -> Path:
    assert run_py(LOAD, env={"SRC": src(n)}).stdout.strip() == str(n)
    return only_entry(cache_root)


def expect_refusal(n: int = 1, match: str = "refusing", root_level: bool = False) -> str:
    """The unsafe path is not used, and the engine still starts: an unsafe entry is quarantined
    and rebuilt, an unsafe root gives one warning and a private build."""
    proc = run_py(LOAD + "\n", env={"SRC": src(n)}, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == str(n), proc.stderr
    assert match in proc.stderr, proc.stderr
    if root_level:
        assert proc.stderr.count("not using the cache") == 1 and "building privately" in proc.stderr, proc.stderr
    else:
        assert "quarantined entry" in proc.stderr, proc.stderr
    return proc.stderr


def test_a_store_takes_its_policy_once(tmp_path):
    """A Store is made with its root's trust policy, which sets the modes of what it creates;
    no one can change it afterwards."""
    from stubcache.storage.store import Store
    from stubcache.storage.trust import TrustPolicy

    policy = TrustPolicy(gid=os.getgid(), group="g")
    store = Store(str(tmp_path / "r"), policy)
    assert store.policy is policy and store.shared and store.mode(0o600, 0o660) == 0o660
    store.ensure()
    assert stat.S_IMODE(os.stat(store.path("pins")).st_mode) == 0o2770
    private = Store(str(tmp_path / "p"))
    assert private.policy is None and not private.shared and private.mode(0o600, 0o660) == 0o600
    with pytest.raises(AttributeError):
        store.shared = False


def test_group_writable_root_is_refused(cache_root):
    build_one(cache_root)
    cache_root.chmod(0o770)
    err = expect_refusal(root_level=True)
    assert str(cache_root) in err and "chmod go-w" in err


def test_world_writable_entry_is_refused(cache_root):
    entry = build_one(cache_root)
    entry.chmod(0o757)
    assert str(entry) in expect_refusal()
    assert not entry.exists() or stat.S_IMODE(entry.stat().st_mode) == 0o755  # rebuilt, not reused


def test_writable_library_is_refused(cache_root):
    entry = build_one(cache_root)
    library_of(entry).chmod(0o777)
    expect_refusal()
    assert stat.S_IMODE(library_of(only_entry(cache_root)).stat().st_mode) == 0o555


def test_library_replaced_by_symlink_is_refused(cache_root, tmp_path):
    entry = build_one(cache_root)
    lib = library_of(entry)
    evil = tmp_path / "evil.so"
    shutil.copy(lib, evil)
    entry.chmod(0o755)
    lib.unlink()
    lib.symlink_to(evil)
    assert "symlink" in expect_refusal()
    assert not library_of(only_entry(cache_root)).is_symlink()


def test_root_that_is_a_symlink_is_refused(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setenv("STUBCACHE_DIR", str(link))
    run_py(LOAD, env={"SRC": src(1)}, check=False)  # first use may create it through the link
    assert "symlink" in expect_refusal(root_level=True)


@pytest.fixture(scope="session")
def test_users():
    """Real users: alice and bob in group stubcache_share, eve outside it (root only)."""
    if not IS_ROOT or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to create real users")
    subprocess.run(["groupadd", "-f", "stubcache_share"], check=True)
    users = {"alice": "stubcache_alice", "bob": "stubcache_bob", "eve": "stubcache_eve"}
    for role, name in users.items():
        if subprocess.run(["id", name], capture_output=True).returncode != 0:
            cmd = ["useradd", "-M", "-s", "/usr/sbin/nologin", name]
            if role != "eve":
                cmd[1:1] = ["-G", "stubcache_share"]
            made = subprocess.run(cmd, capture_output=True, text=True)
            if made.returncode not in (0, 9):  # 9: made meanwhile by another test session
                raise RuntimeError(f"useradd {name}: {made.stderr.strip()}")
    return users


def run_as(user: str, code: str, env: dict) -> subprocess.CompletedProcess:
    """Run ``code`` with the effective uid/gids of ``user``. The interpreter lives under /root
    (mode 0700 here), so the child starts as root, imports what it needs, then drops to the
    user's effective ids: every file access after that is the user's."""
    pre = textwrap.dedent(f"""
        import os, pwd, grp
        import stubcache, stubcache.build.builder, stubcache.storage.locking, stubcache.admin.shared, stubcache.storage.store
        import stubcache.key.toolchain, stubcache.dropin.compat, stubcache.dropin.patch, stubcache.edge.progress, stubcache.edge.faults
        import fcntl, ctypes, subprocess, tempfile, shutil, json, logging, sysconfig, hashlib, threading, re
        import glob, shlex, inspect, atexit, errno, signal, traceback, argparse, locale, gettext, dataclasses
        import importlib, pkgutil, filelock
        for m in pkgutil.walk_packages(stubcache.__path__, "stubcache."):  # every module a command may reach
            if not m.name.endswith("__main__"):
                importlib.import_module(m.name)
        sysconfig.get_path("include", scheme="posix_prefix"); stubcache.key.fingerprint.torch_dir()
        pw = pwd.getpwnam({user!r})
        groups = sorted({{g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem}} | {{pw.pw_gid}})
        os.setgroups(groups); os.setegid(pw.pw_gid); os.seteuid(pw.pw_uid)
        """)
    return run_py(pre + textwrap.dedent(code), env=env, check=False)


@pytest.fixture
def shared_root(test_users):
    parent = Path(tempfile.mkdtemp(prefix="stubcache-shared-test-"))
    parent.chmod(0o755)
    root = parent / "cache"
    init_root(str(root), "stubcache_share")
    yield root
    shutil.rmtree(parent, ignore_errors=True)


def test_shared_root_serves_a_group(shared_root, test_users):
    env = {"STUBCACHE_DIR": str(shared_root), "SRC": src(5)}
    a = run_as(test_users["alice"], LOAD, env)
    assert a.returncode == 0 and a.stdout.strip() == "5", a.stderr
    entry = only_entry(shared_root)
    b = run_as(test_users["bob"], LOAD + "\nprint(len(os.listdir(os.environ['STUBCACHE_DIR'] + '/v1/entries')))", env)
    assert b.returncode == 0 and b.stdout.split() == ["5", "1"], b.stderr
    assert only_entry(shared_root) == entry  # bob hit alice's build
    import grp
    import pwd

    gid = grp.getgrnam("stubcache_share").gr_gid
    lib = library_of(entry)
    assert pwd.getpwuid(lib.stat().st_uid).pw_name == test_users["alice"]
    assert stat.S_IMODE(lib.stat().st_mode) == 0o555
    assert stat.S_IMODE((entry / "manifest.json").stat().st_mode) == 0o444
    for dirpath, dirnames, filenames in os.walk(shared_root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            assert st.st_gid == gid, (dirpath, name)
            assert stat.S_IMODE(st.st_mode) & 0o077 != 0, f"{dirpath}/{name} is private to its owner"
            assert not st.st_mode & stat.S_IWOTH


def test_shared_root_refuses_non_members(shared_root, test_users):
    env = {"STUBCACHE_DIR": str(shared_root), "SRC": src(6)}
    assert run_as(test_users["alice"], LOAD, env).returncode == 0
    entries = sorted(os.listdir(shared_root / "v1" / "entries"))
    # eve cannot enter the 2770 root: she still starts, from a private build, and writes nothing.
    e = run_as(test_users["eve"], LOAD, env)
    assert e.returncode == 0 and e.stdout.strip() == "6", e.stderr
    assert "building privately" in e.stderr
    assert sorted(os.listdir(shared_root / "v1" / "entries")) == entries
    # Where she can read the root, the group still counts only for members: one warning saying
    # so, a private build, nothing loaded from or written to the root.
    shared_root.chmod(0o2755)
    (shared_root / "v1").chmod(0o2775)
    e = run_as(test_users["eve"], LOAD, env)
    assert e.returncode == 0 and e.stdout.strip() == "6", e.stderr
    assert e.stderr.count("not a member") == 1 and "building privately" in e.stderr, e.stderr
    assert sorted(os.listdir(shared_root / "v1" / "entries")) == entries


def test_entry_owned_by_another_user_is_refused(cache_root, test_users):
    import pwd

    entry = build_one(cache_root)
    uid = pwd.getpwnam(test_users["eve"]).pw_uid
    os.chown(library_of(entry), uid, -1)
    err = expect_refusal()
    assert f"uid {uid}" in err
    assert library_of(only_entry(cache_root)).stat().st_uid == os.geteuid()  # rebuilt by us


def test_require_hit_turns_a_miss_into_an_error(cache_root, monkeypatch):
    monkeypatch.setenv("STUBCACHE_REQUIRE_HIT", "1")
    with pytest.raises(CacheMissError) as info:
        StubCache().get_or_build(StubSpec("needhit", src(1)))
    assert "needhit" in str(info.value) and "stubcache warm" in str(info.value)
    assert not (cache_root / "v1" / "entries").exists() or not os.listdir(cache_root / "v1" / "entries")


def test_seed_store_is_read_first_and_never_written(tmp_path, monkeypatch, cxx):
    seed = tmp_path / "seed"
    monkeypatch.setenv("STUBCACHE_DIR", str(seed))
    run_py(LOAD, env={"SRC": src(8)})
    assert cxx.compiles() == 1
    before = sorted(str(p) + str(p.stat().st_mtime_ns) for p in seed.rglob("*"))
    for p in seed.rglob("*"):
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)
    main = tmp_path / "main"
    env = {"STUBCACHE_DIR": str(main), "STUBCACHE_SEED_DIRS": str(seed), "STUBCACHE_REQUIRE_HIT": "1",
           "SRC": src(8)}
    assert run_py(LOAD, env=env).stdout.strip() == "8"
    assert cxx.compiles() == 1
    assert not (main / "v1" / "entries").exists() or not os.listdir(main / "v1" / "entries")
    after = sorted(str(p) + str(p.stat().st_mtime_ns) for p in seed.rglob("*"))
    assert before == after
    for p in seed.rglob("*"):
        p.chmod(p.stat().st_mode | 0o200)


def test_corrupt_seed_entry_is_skipped_and_built_locally(tmp_path, monkeypatch, cxx):
    seed = tmp_path / "seed"
    monkeypatch.setenv("STUBCACHE_DIR", str(seed))
    run_py(LOAD, env={"SRC": src(9)})
    lib = library_of(only_entry(seed))
    lib.chmod(0o755)
    lib.write_bytes(lib.read_bytes()[:200])
    lib.chmod(0o555)
    main = tmp_path / "main"
    proc = run_py(LOAD, env={"STUBCACHE_DIR": str(main), "STUBCACHE_SEED_DIRS": str(seed), "SRC": src(9)})
    assert proc.stdout.strip() == "9" and "ignoring seed entry" in proc.stderr
    assert cxx.compiles() == 2
    assert len(os.listdir(main / "v1" / "entries")) == 1
    assert library_of(only_entry(seed)).stat().st_size == 200  # the seed was not touched


@needs_root
def test_read_only_root_degrades_to_a_private_build(tmp_path, monkeypatch):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        monkeypatch.setenv("STUBCACHE_DIR", str(mnt / "cache"))
        proc = run_py(LOAD + "\nprint(stubcache.StubCache().load(stubcache.StubSpec('trust2', os.environ['SRC'])).value())",
                      env={"SRC": src(3)})
        assert proc.stdout.split() == ["3", "3"]
        assert proc.stderr.count("building privately") == 1, proc.stderr  # warned once
        monkeypatch.setenv("STUBCACHE_REQUIRE_HIT", "1")
        proc = run_py(LOAD, env={"SRC": src(3)}, check=False)
        assert proc.returncode != 0 and "CacheMissError" in proc.stderr
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_doctor_reports_and_fixes_permissions(cache_root):
    entry = build_one(cache_root)
    entry.chmod(0o775)
    cli = [sys.executable, "-m", "stubcache", "--cache-dir", str(cache_root)]
    bad = subprocess.run(cli + ["doctor", "--format", "json"], capture_output=True, text=True)
    assert bad.returncode == 1
    errors = [c for c in json.loads(bad.stdout)["checks"] if c["status"] == "error"]
    assert errors and str(entry) in errors[0]["detail"]
    fixed = subprocess.run(cli + ["doctor", "--fix"], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout
    assert f"chmod 755 {entry}" in fixed.stdout
    assert stat.S_IMODE(entry.stat().st_mode) == 0o755
    assert run_py(LOAD, env={"SRC": src(1)}).stdout.strip() == "1"


def test_cli_init_shared_then_members_verify_each_others_entries(test_users):
    parent = Path(tempfile.mkdtemp(prefix="stubcache-shared-cli-"))
    parent.chmod(0o755)
    root = parent / "cache"
    try:
        init = subprocess.run([sys.executable, "-m", "stubcache", "init", "--shared", "--group",
                               "stubcache_share", str(root)], capture_output=True, text=True)
        assert init.returncode == 0, init.stderr
        assert "shared with group stubcache_share" in init.stdout
        env = {"STUBCACHE_DIR": str(root), "SRC": src(2)}
        assert run_as(test_users["alice"], LOAD, env).stdout.strip() == "2"
        verify = run_as(test_users["bob"], """
        import sys
        from stubcache.cli import main
        sys.exit(main(["verify"]))
        """, env)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        bad = subprocess.run([sys.executable, "-m", "stubcache", "init", "--shared", str(root)],
                             capture_output=True, text=True)
        assert bad.returncode == 2 and "--group" in bad.stderr
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_shared_root_header_tracked_entries_serve_other_members(shared_root, test_users):
    inc = shared_root.parent / "inc"
    inc.mkdir()
    (inc / "h.h").write_text("#define H 31\n")
    inc.chmod(0o755)
    code = """
    import os, stubcache
    spec = stubcache.StubSpec("hdr", '#include "h.h"\\nextern "C" int value(void) { return H; }\\n',
                              extra_include_paths=[os.environ["INC"]])
    e = stubcache.StubCache().get_or_build(spec)
    print(stubcache.StubCache().load_entry(e).value(), e.key)
    """
    env = {"STUBCACHE_DIR": str(shared_root), "INC": str(inc)}
    a = run_as(test_users["alice"], code, env)
    assert a.returncode == 0, a.stderr
    b = run_as(test_users["bob"], code, env)
    assert b.returncode == 0, b.stderr
    assert a.stdout.split() == b.stdout.split() and a.stdout.split()[0] == "31"
    assert len(os.listdir(shared_root / "v1" / "entries")) == 1


def test_trust_is_decided_where_the_root_is_used_not_where_the_cache_is_made(cache_root):
    """An engine makes its StubCache at start-up and first uses it later: the root is checked at
    that first use. A root that became unsafe meanwhile (here: writable by others) is not used,
    and one that became safe meanwhile is."""
    StubCache().get_or_build(StubSpec("trust_late", src(31)))  # the root exists, this user's
    early = StubCache()
    os.chmod(cache_root, 0o777)
    try:
        entry = early.get_or_build(StubSpec("trust_late", src(32)))
        assert not entry.published and not entry.path.startswith(str(cache_root))
        late_ok = StubCache()
    finally:
        os.chmod(cache_root, 0o700)
    assert late_ok.get_or_build(StubSpec("trust_late", src(33))).published


def test_a_root_shared_after_the_cache_was_made_gets_the_groups_modes(tmp_path, monkeypatch):
    """A root that did not exist when the engine made its StubCache and was then set up as a
    shared root: what the engine publishes there gets the group's modes, as a fresh cache's does."""
    import grp

    parent = tmp_path / "p"
    parent.mkdir(mode=0o755)
    root = parent / "cache"
    for name in ("STUBCACHE_REQUIRE_HIT", "STUBCACHE_LOCK_TIMEOUT", "STUBCACHE_SEED_DIRS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STUBCACHE_DIR", str(root))
    monkeypatch.setenv("STUBCACHE_TRUSTED_ROOTS", str(root))  # uid 0 trusts a group only explicitly
    early = StubCache()
    init_root(str(root), grp.getgrgid(os.getgid()).gr_name)
    late = early.get_or_build(StubSpec("late_shared", src(41)))
    fresh = StubCache().get_or_build(StubSpec("late_shared", src(42)))
    assert late.published and fresh.published

    def modes(entry):
        return [stat.S_IMODE(os.stat(p).st_mode) for p in (os.path.dirname(entry.path), entry.path)]

    assert modes(late) == modes(fresh)
    assert modes(fresh)[0] & 0o050 == 0o050  # the group can list the entry


def test_a_config_nested_too_deeply_is_an_unsafe_root_not_a_crash(cache_root):
    """A root anyone may write to, where someone planted a stubcache-root.json nested deeper than
    the parser goes: one warning and a private build, as for any unsafe root (not a
    RecursionError out of StubCache() or get_or_build)."""
    StubCache().get_or_build(StubSpec("deep_cfg", src(51)))  # the root exists
    (cache_root / "stubcache-root.json").write_text("[" * 100_000)
    os.chmod(cache_root, 0o777)
    try:
        entry = StubCache().get_or_build(StubSpec("deep_cfg", src(52)))
    finally:
        os.chmod(cache_root, 0o700)
    assert not entry.published
