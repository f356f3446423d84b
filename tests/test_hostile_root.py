"""Hostile and broken roots: planted links, FIFOs, held locks, a stopped pruner, roots this user
never chose to trust. Each test plants the attack or the fault, runs the real commands in real
processes (as root, as CI does, and as real users and groups created here), and asserts that
nothing outside the root changed (content, mode, existence), nothing hung, and the engine started.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from stubcache import StubCache, StubSpec
from stubcache.admin.shared import init_root

from .conftest import run_py, wait_until

IS_ROOT = os.geteuid() == 0
GROUP = "schostile"
USERS = {"mallory": "schostile_mallory", "alice": "schostile_alice", "outsider": "schostile_out"}


def src(n: int) -> str:
    return f'extern "C" int value(void) {{ return {n}; }}\n'


LOAD = """
import os, stubcache
c = stubcache.StubCache()
e = c.get_or_build(stubcache.StubSpec(os.environ.get("NAME", "hostile"), os.environ["SRC"]))
print(c.load_entry(e).value(), e.published, e.path)
"""


def cli(root, *args: str, env: dict | None = None, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "stubcache", "--cache-dir", str(root), *args], env=full,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def snapshot(top: Path) -> dict:
    """Everything about a tree that an attack could change: kind, mode, owner, size, content, link."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [""] + dirnames + filenames:
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            rec = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size)
            if stat.S_ISREG(st.st_mode):
                rec += (hashlib.sha256(Path(p).read_bytes()).hexdigest(),)
            elif stat.S_ISLNK(st.st_mode):
                rec += (os.readlink(p),)
            out[os.path.relpath(p, top)] = rec
    return out


def make_outside(base: Path) -> Path:
    """Files and directories outside the root that attacks aim at."""
    out = base / "outside"
    out.mkdir()
    (out / "victim.txt").write_text("do not touch\n")
    (out / "victim.txt").chmod(0o644)
    (out / "victim2.txt").write_text("nor this\n")
    for d in ("victim_dir", "victim_dir2", "leasedir"):
        (out / d).mkdir()
        (out / d).chmod(0o755)
        (out / d / "f.txt").write_text(d)
    (out / "leasedir" / ("ab" * 16 + ".json")).write_text('{"pid": 1}')
    return out


def no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 1), (proc.returncode, proc.stdout, proc.stderr)


def layout_modes(root: Path) -> dict:
    return {p.name: stat.S_IMODE(os.lstat(p).st_mode) for p in (root / "v1").iterdir() if not p.is_symlink()}


# --- real users and groups -------------------------------------------------------------------


@pytest.fixture(scope="session")
def users():
    """A group with two members (mallory, the attacker; alice, a victim engine) and an outsider,
    created when missing and left in place (like test_trust's users): CI runs several test
    sessions at once, and one removing them at its end would pull them from under another. Root
    only."""
    if not IS_ROOT or not shutil.which("useradd") or not shutil.which("groupadd"):
        pytest.skip("needs root and useradd/groupadd to create real users and groups")
    import pwd

    subprocess.run(["groupadd", "-f", GROUP], check=True)
    for role, name in USERS.items():
        if subprocess.run(["id", name], capture_output=True).returncode != 0:
            cmd = ["useradd", "-M", "-s", "/usr/sbin/nologin", name]
            if role != "outsider":
                cmd[1:1] = ["-G", GROUP]
            made = subprocess.run(cmd, capture_output=True, text=True)
            if made.returncode not in (0, 9):  # 9: made meanwhile by another session
                raise RuntimeError(f"useradd {name}: {made.stderr.strip()}")
    for role, name in USERS.items():  # users left by an interrupted run may have lost the group
        if role != "outsider" and name not in grp.getgrnam(GROUP).gr_mem:
            subprocess.run(["usermod", "-aG", GROUP, name], check=True)
    info = {role: pwd.getpwnam(name) for role, name in USERS.items()}
    info["gid"] = grp.getgrnam(GROUP).gr_gid
    return info


PRELUDE = """
import os, pwd, grp, sys, pkgutil, importlib
import stubcache, platformdirs, ctypes, fcntl, json, hashlib, subprocess, tempfile, shutil, logging
import sysconfig, glob, shlex, inspect, atexit, errno, signal, traceback, argparse, csv, io, fnmatch
import filelock, hmac, secrets, socket, base64, struct, zlib, locale, gettext  # under /root (pyenv), unreadable once dropped
for m in pkgutil.walk_packages(stubcache.__path__, "stubcache."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
sysconfig.get_path("include", scheme="posix_prefix"); stubcache.key.fingerprint.torch_dir()
pw = pwd.getpwnam({user!r})
groups = sorted({{g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem}} | {{pw.pw_gid}})
os.setgroups(groups); os.setegid(pw.pw_gid); os.seteuid(pw.pw_uid)
os.environ["HOME"] = {home!r}
"""


def run_as(user, code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` with the effective uid and groups of ``user`` (a ``pwd`` record). The child
    starts as root so that it can import from wherever the interpreter lives (CI: under /root),
    then drops to the user's ids: every file access after that is the user's."""
    home = tempfile.mkdtemp(prefix="sc-home-")
    os.chown(home, user.pw_uid, user.pw_gid)
    pre = PRELUDE.format(user=user.pw_name, home=home)
    try:
        return run_py(pre + textwrap.dedent(code), env=env, check=False, timeout=timeout)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def cli_as(user, root, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_as(user, f"""
        from stubcache.cli import main
        sys.exit(main(["--cache-dir", {str(root)!r}, *{list(args)!r}]))
        """, env)


@pytest.fixture
def shared(users):
    """A shared root made by root (``stubcache init --shared``), with one entry alice built, and
    a tree outside it that the attacks aim at."""
    base = Path(tempfile.mkdtemp(prefix="sc-hostile-"))
    base.chmod(0o755)
    root = base / "cache"
    init_root(str(root), GROUP)
    proc = run_as(users["alice"], LOAD, {"STUBCACHE_DIR": str(root), "SRC": src(1)})
    assert proc.returncode == 0 and proc.stdout.split()[:2] == ["1", "True"], proc.stderr
    outside = make_outside(base)
    yield root, outside
    shutil.rmtree(base, ignore_errors=True)


FAKE = "cd" * 16


def plant_as(user, root: Path, code: str) -> None:
    proc = run_as(user, f"import os\nV1 = {str(root / 'v1')!r}\n" + textwrap.dedent(code))
    assert proc.returncode == 0, proc.stderr


# --- 1. planted links: root's verify, prune and clear --------------------------------------------


def test_root_verify_never_writes_through_planted_links(shared, users):
    root, outside = shared
    before = snapshot(outside)
    plant_as(users["mallory"], root, f"""
        e = os.path.join(V1, "entries", {FAKE!r})
        os.mkdir(e)
        with open(os.path.join(e, "lib.so"), "wb") as f:
            f.write(b"x" * 10)
        m = dict(key={FAKE!r}, base_key={FAKE!r}, name="evil\\x1b]0;owned\\x07\\x1b[2J", module_name="m",
                 library="lib.so", sha256="0" * 64, size=10, preimage={{}}, headers={{}}, build_method="direct",
                 build_seconds=1e400, build_log="", created=float("nan"), stubcache_version="x")
        with open(os.path.join(e, "manifest.json"), "w") as f:
            f.write(json.dumps(m))
        # quarantine would write its reason through this link, the lock helper truncate through that
        os.symlink({str(outside / 'victim.txt')!r}, os.path.join(e, "QUARANTINE_REASON"))
        os.symlink({str(outside / 'victim2.txt')!r}, os.path.join(V1, "locks", {FAKE!r} + ".lock"))
        # and events would be recorded into a directory of her choosing
        os.rename(os.path.join(V1, "events"), os.path.join(V1, "events.old"))
        os.symlink({str(outside / 'victim_dir')!r}, os.path.join(V1, "events"))
        """)
    for args in (["verify"], ["verify", "-v"], ["ls"], ["stats"]):
        proc = cli(root, *args)
        no_traceback(proc)
        assert "\x1b" not in proc.stdout + proc.stderr and "\x07" not in proc.stdout + proc.stderr
    assert snapshot(outside) == before
    assert not (root / "v1" / "entries" / FAKE).exists()  # quarantined, not patched
    [q] = [p for p in (root / "v1" / "quarantine").iterdir() if p.name.startswith(FAKE)]
    assert (q / "QUARANTINE_REASON").is_file() and not (q / "QUARANTINE_REASON").is_symlink()


def test_root_prune_and_clear_never_follow_or_chmod_planted_links(shared, users):
    root, outside = shared
    before = snapshot(outside)
    modes = layout_modes(root)
    plant_as(users["mallory"], root, f"""
        key = {FAKE!r}
        os.symlink({str(outside / 'victim_dir')!r}, os.path.join(V1, "trash", key + "-1-999999"))
        os.symlink({str(outside / 'victim.txt')!r}, os.path.join(V1, "quarantine", key + "-1-1"))
        os.symlink({str(outside / 'victim_dir2')!r}, os.path.join(V1, "staging", key + "-999999-x"))
        d = os.path.join(V1, "staging", key + "-999998-y")
        os.makedirs(os.path.join(d, "ro", "deeper"))
        with open(os.path.join(d, "ro", "deeper", "f"), "w") as f:
            f.write("x")
        os.symlink({str(outside / 'victim.txt')!r}, os.path.join(d, "ro", "link"))
        os.chmod(os.path.join(d, "ro", "deeper"), 0o500)
        os.chmod(os.path.join(d, "ro"), 0o500)
        os.symlink({str(outside)!r}, os.path.join(V1, "variants", key))
        # the lease directory swapped for a link to a directory with a lease-looking file
        os.rename(os.path.join(V1, "leases"), os.path.join(V1, "leases.old"))
        os.symlink({str(outside / 'leasedir')!r}, os.path.join(V1, "leases"))
        """)
    for args in (["prune", "--dry-run"], ["prune", "--yes"], ["prune", "--yes", "--max-size", "0"],
                 ["clear", "--yes", "--stats"], ["doctor"], ["doctor", "--fix"]):
        no_traceback(cli(root, *args))
    assert snapshot(outside) == before
    after = layout_modes(root)
    assert {k: v for k, v in after.items() if k in modes} == {k: v for k, v in modes.items() if k in after}
    assert os.listdir(root / "v1" / "staging") == []
    assert os.listdir(root / "v1" / "trash") == []
    assert os.listdir(root / "v1" / "quarantine") == []


# --- 2. FIFOs and other odd files never hang anything ----------------------------------------


def test_fifos_in_place_of_files_never_hang(cache_root, tmp_path):
    proc = run_py(LOAD, env={"SRC": src(2), "NAME": "fifo"})
    key = Path(proc.stdout.split()[2]).parent.name
    v1 = cache_root / "v1"
    outside = make_outside(tmp_path)
    before = snapshot(outside)
    (v1 / "entries" / key / "manifest.json").unlink()
    os.mkfifo(v1 / "entries" / key / "manifest.json")
    for p in [v1 / "pins" / key, v1 / "leases" / f"{key}.json", v1 / "failures" / f"{key}.json",
              v1 / "locks" / "events-compact.lock", *(v1 / "state").glob("*.json")]:
        if p.exists():
            p.unlink()
        os.mkfifo(p)
    os.mkfifo(v1 / "events" / "zz-1-1.jsonl")
    os.mkfifo(v1 / "entries" / FAKE)  # a FIFO where an entry directory should be
    os.mkfifo(v1 / "quarantine" / f"{FAKE}-1-1")
    env = {"STUBCACHE_LOCK_TIMEOUT": "5"}
    loaded = run_py(LOAD, env=dict(env, SRC=src(2), NAME="fifo"), timeout=120)
    assert loaded.stdout.split()[:2] == ["2", "True"], loaded.stderr
    for args in (["ls"], ["ls", "--format", "json"], ["stats"], ["verify", "--dry-run"], ["prune", "--dry-run"],
                 ["verify"], ["prune", "--yes"], ["doctor"]):
        no_traceback(cli(cache_root, *args, env=env, timeout=120))
    assert snapshot(outside) == before
    assert run_py(LOAD, env=dict(env, SRC=src(2), NAME="fifo")).stdout.split()[:2] == ["2", "True"]


# --- 3. every wait has a bound ------------------------------------------------------------------


HOLD = """
import fcntl, os, sys, time
fds = []
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    fds.append(fd)
print("held", flush=True)
time.sleep(3600)
"""


def lock_timeout_events(root: Path) -> list[dict]:
    out = []
    for f in (root / "v1" / "events").glob("*.jsonl"):
        out += [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
    return [e for e in out if e.get("ev") == "lock_timeout"]


def test_exclusive_locks_held_by_another_process_cost_at_most_the_timeout(cache_root):
    """Someone holds LOCK_EX on an entry's pin and on build locks, forever: a hit loads unpinned,
    a miss builds privately, each after the bound, with one line naming the holder."""
    first = run_py(LOAD, env={"SRC": src(3), "NAME": "held"})
    key = Path(first.stdout.split()[2]).parent.name
    miss_key = StubCache(str(cache_root)).key(StubSpec("held2", src(4)))
    v1 = cache_root / "v1"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(v1 / "pins" / key), str(v1 / "locks" / f"{key}.lock"),
                               str(v1 / "locks" / f"{miss_key}.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        env = {"STUBCACHE_LOCK_TIMEOUT": "1.5"}
        t0 = time.monotonic()
        hit = run_py(LOAD, env=dict(env, SRC=src(3), NAME="held"), timeout=120)
        t_hit = time.monotonic() - t0
        assert hit.stdout.split()[:2] == ["3", "True"], hit.stderr
        assert "without a pin" in hit.stderr and f"pid {holder.pid}" in hit.stderr, hit.stderr
        assert hit.stderr.count("stubcache:") == 1, hit.stderr
        t0 = time.monotonic()
        miss = run_py(LOAD, env=dict(env, SRC=src(4), NAME="held2"), timeout=120)
        t_miss = time.monotonic() - t0
        assert miss.stdout.split()[:2] == ["4", "False"], miss.stderr
        assert "building privately" in miss.stderr and f"pid {holder.pid}" in miss.stderr, miss.stderr
        [ev] = lock_timeout_events(cache_root)
        assert ev["s"] >= 1.5
        print(f"held pin: engine start {t_hit:.2f}s; held build lock: {t_miss:.2f}s (bound 1.5s)")
    finally:
        holder.kill()
        holder.wait()


def test_a_held_toolchain_memo_lock_costs_at_most_the_timeout(cache_root):
    run_py(LOAD, env={"SRC": src(6), "NAME": "memo"})
    state = cache_root / "v1" / "state"
    for p in state.glob("*.json"):
        p.unlink()  # a cold host: the compiler probe runs again, under its memo lock
    locks = sorted(str(p) for p in state.glob("*.lock"))
    assert locks
    holder = subprocess.Popen([sys.executable, "-c", HOLD, *locks], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = run_py(LOAD, env={"SRC": src(6), "NAME": "memo", "STUBCACHE_LOCK_TIMEOUT": "1"}, timeout=120)
        assert proc.stdout.split()[:2] == ["6", "True"], proc.stderr
        assert "memo lock" in proc.stderr and f"pid {holder.pid}" in proc.stderr, proc.stderr
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("point", ["evict_locked", "evict_trashed"])
def test_a_stopped_prune_does_not_stall_an_engine_start(cache_root, point):
    run_py(LOAD, env={"SRC": src(5), "NAME": "stopped"})
    env = dict(os.environ, STUBCACHE_FAULT=f"{point}:stop")
    pruner = subprocess.Popen([sys.executable, "-m", "stubcache", "prune", "--max-size", "0", "--yes"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: Path(f"/proc/{pruner.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
                   "prune to stop at the fault point", proc=pruner)
        proc = run_py(LOAD, env={"SRC": src(5), "NAME": "stopped", "STUBCACHE_LOCK_TIMEOUT": "1.5"}, timeout=120)
        value, published = proc.stdout.split()[:2]
        assert value == "5", proc.stderr
        assert f"pid {pruner.pid}" in proc.stderr, proc.stderr
        if point == "evict_locked":  # the entry is still there: loaded without a pin
            assert published == "True" and "without a pin" in proc.stderr
        else:  # moved to trash under its build lock: a private build
            assert published == "False" and "building privately" in proc.stderr
    finally:
        pruner.send_signal(signal.SIGKILL)
        pruner.wait()


# --- 4. trust is anchored in the loading user --------------------------------------------------


@pytest.fixture
def mallory_root(users):
    """A root owned by mallory (a group member), readable by everyone, which declares itself
    shared with the group: nothing alice chose."""
    base = Path(tempfile.mkdtemp(prefix="sc-trust-"))
    base.chmod(0o755)
    root = base / "mroot"
    root.mkdir()
    os.chown(root, users["mallory"].pw_uid, users["gid"])
    proc = run_as(users["mallory"], LOAD, {"STUBCACHE_DIR": str(root), "SRC": src(7), "NAME": "mine"})
    assert proc.returncode == 0, proc.stderr
    plant_as(users["mallory"], root, f"""
        with open(os.path.join(os.path.dirname(V1), "stubcache-root.json"), "w") as f:
            json.dump({{"mode": "shared", "group": {GROUP!r}, "gid": {users['gid']}}}, f)
        for d, dirs, files in os.walk(os.path.dirname(V1)):
            for n in [""] + dirs:
                os.chmod(os.path.join(d, n), 0o755)
        """)
    yield root
    shutil.rmtree(base, ignore_errors=True)


def test_a_root_owned_by_someone_else_is_used_only_when_the_user_says_so(mallory_root, users, tmp_path):
    alice = users["alice"]
    env = {"STUBCACHE_DIR": str(mallory_root), "SRC": src(7), "NAME": "mine"}
    before = snapshot(mallory_root)
    proc = run_as(alice, LOAD, env)
    assert proc.returncode == 0 and proc.stdout.split()[:2] == ["7", "False"], proc.stderr
    assert proc.stderr.count("not using the cache") == 1 and "STUBCACHE_TRUSTED_ROOTS" in proc.stderr
    assert snapshot(mallory_root) == before  # nothing loaded from it, nothing written into it
    doctor = cli_as(alice, mallory_root, "doctor", "--format", "json")
    [trust] = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "trust"]
    assert trust["status"] == "warn" and "STUBCACHE_TRUSTED_ROOTS" in trust["fix"]
    # trusted explicitly, by the environment or by her config file: the entry is used
    ok = run_as(alice, LOAD, dict(env, STUBCACHE_TRUSTED_ROOTS=str(mallory_root)))
    assert ok.returncode == 0 and ok.stdout.split()[:2] == ["7", "True"], ok.stderr
    assert "not using" not in ok.stderr
    cfg = mallory_root.parent / "alice-config"  # (pytest's tmp_path is not reachable by alice)
    (cfg / "stubcache").mkdir(parents=True)
    (cfg / "stubcache" / "trusted-roots").write_text(f"# mine\n{mallory_root}\n")
    for p in (cfg, cfg / "stubcache", cfg / "stubcache" / "trusted-roots"):
        os.chown(p, alice.pw_uid, alice.pw_gid)
    ok = run_as(alice, LOAD, dict(env, XDG_CONFIG_HOME=str(cfg)))
    assert ok.returncode == 0 and ok.stdout.split()[:2] == ["7", "True"], ok.stderr
    # a trust file others can write is no one's choice
    (cfg / "stubcache" / "trusted-roots").chmod(0o666)
    bad = run_as(alice, LOAD, dict(env, XDG_CONFIG_HOME=str(cfg)))
    assert bad.returncode == 0 and bad.stdout.split()[:2] == ["7", "False"], bad.stderr


def test_root_does_not_load_code_members_wrote_unless_trusted_explicitly(shared, users):
    root, _ = shared
    before = sorted(os.listdir(root / "v1" / "entries"))
    proc = run_py(LOAD, env={"STUBCACHE_DIR": str(root), "SRC": src(1)})
    assert proc.stdout.split()[:2] == ["1", "False"], proc.stderr
    assert proc.stderr.count("as root") == 1 and "building privately" in proc.stderr
    assert sorted(os.listdir(root / "v1" / "entries")) == before
    ok = run_py(LOAD, env={"STUBCACHE_DIR": str(root), "SRC": src(1), "STUBCACHE_TRUSTED_ROOTS": str(root)})
    assert ok.stdout.split()[:2] == ["1", "True"] and str(root) in ok.stdout, ok.stderr
    # a group member who is not the owner still uses it (uid 0 owns it, she is a member)
    assert run_as(users["alice"], LOAD, {"STUBCACHE_DIR": str(root), "SRC": src(1)}).stdout.split()[:2] == ["1", "True"]


# --- 5. degrade, never fail an engine start -----------------------------------------------------


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_a_root_that_cannot_be_created_degrades_to_private_builds(tmp_path, where):
    (tmp_path / "file").write_text("x")
    root = "/proc/stubcache-nonexistent/cache" if where == "proc" else str(tmp_path / "file" / "cache")
    code = LOAD + "\nprint(c.load(stubcache.StubSpec('second', os.environ['SRC'])).value())\n"
    proc = run_py(code, env={"STUBCACHE_DIR": root, "SRC": src(8)})
    assert proc.stdout.split()[:2] == ["8", "False"] and proc.stdout.split()[-1] == "8", proc.stderr
    assert proc.stderr.count("building privately") == 1 and "Traceback" not in proc.stderr


def test_missing_layout_dirs_future_failures_and_large_sources(cache_root, cxx):
    run_py(LOAD, env={"SRC": src(9), "NAME": "lay"})
    for sub in ("pins", "locks", "events", "leases", "failures", "staging", "variants"):
        shutil.rmtree(cache_root / "v1" / sub)
    assert run_py(LOAD, env={"SRC": src(9), "NAME": "lay"}).stdout.split()[:2] == ["9", "True"]
    spec = StubSpec("future", src(10))
    base = StubCache(str(cache_root)).key(spec)
    (cache_root / "v1" / "failures").mkdir(exist_ok=True)
    (cache_root / "v1" / "failures" / f"{base}.json").write_text(
        json.dumps({"time": time.time() + 1e6, "pid": 1, "output": "planted"}))
    assert run_py(LOAD, env={"SRC": src(10), "NAME": "future"}).stdout.split()[:2] == ["10", "True"]
    for sub in ("pins", "locks", "events", "leases", "failures", "staging"):
        assert (cache_root / "v1" / sub).is_dir(), sub  # recreated when needed
    line = "// " + "y" * 200 + "\n"
    big = line * (24 * 1024 * 1024 // len(line)) + src(11)
    (cache_root.parent / "big.cpp").write_text(big)
    code = LOAD.replace('os.environ["SRC"]', 'open(os.environ["SRCFILE"]).read()')
    n = cxx.compiles()
    env = {"SRCFILE": str(cache_root.parent / "big.cpp"), "NAME": "big", "SRC": ""}
    assert run_py(code, env=env).stdout.split()[:2] == ["11", "True"]
    assert run_py(code, env=env).stdout.split()[:2] == ["11", "True"]
    assert cxx.compiles() == n + 1  # the second process hit the 24 MB spec's entry


def test_a_hit_on_an_unwritable_root_loads(users):
    """Root's cache, readable by all, writable by no one else: another user hits it (owner uid
    0 is trusted) although she can pin nothing, record nothing and build nothing there."""
    base = Path(tempfile.mkdtemp(prefix="sc-ro-"))
    try:
        base.chmod(0o755)
        root = base / "cache"
        root.mkdir()
        out = users["outsider"]
        env = {"STUBCACHE_DIR": str(root), "SRC": src(14)}
        # built in her environment (the fingerprint is hers), then handed to root and made read-only
        os.chown(root, out.pw_uid, out.pw_gid)
        assert run_as(out, LOAD, env).stdout.split()[:2] == ["14", "True"]
        for d, dirs, files in os.walk(root):
            for n in [""] + dirs + files:
                os.chown(os.path.join(d, n), 0, 0)
            for n in [""] + dirs:
                os.chmod(os.path.join(d, n), 0o755)
        before = snapshot(root)
        proc = run_as(out, LOAD, env)
        assert proc.returncode == 0 and proc.stdout.split()[:2] == ["14", "True"], proc.stderr
        assert "stubcache:" not in proc.stderr, proc.stderr  # a hit: nothing to warn about
        assert snapshot(root) == before
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(not IS_ROOT, reason="needs root to mount a read-only tmpfs")
def test_a_hit_on_a_read_only_filesystem_loads(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        env = {"STUBCACHE_DIR": str(mnt / "cache"), "SRC": src(15)}
        assert run_py(LOAD, env=env).stdout.split()[:2] == ["15", "True"]
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        proc = run_py(LOAD, env=env)
        assert proc.stdout.split()[:2] == ["15", "True"] and "stubcache:" not in proc.stderr, proc.stderr
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_many_instances_leak_no_descriptors(cache_root):
    out = run_py("""
        import os, stubcache
        spec = stubcache.StubSpec("fds", 'extern "C" int value(void) { return 12; }')
        stubcache.StubCache().load(spec)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(300):
            c = stubcache.StubCache()
            assert c.load(spec).value() == 12
        print(before, len(os.listdir("/proc/self/fd")))
    """).stdout.split()
    assert int(out[1]) - int(out[0]) <= 2, out


# --- 6. shared mode leaves nothing the owner cannot clean -----------------------------------------


def test_owner_prune_cleans_a_members_killed_build(users):
    alice, mallory = users["alice"], users["mallory"]
    base = Path(tempfile.mkdtemp(prefix="sc-owner-"))
    try:
        base.chmod(0o755)
        os.chown(base, alice.pw_uid, alice.pw_gid)
        root = base / "cache"
        init = cli_as(alice, root, "init", "--shared", "--group", GROUP)
        assert init.returncode == 0, init.stderr
        # alice owns the root, so mallory uses it only because she says she trusts it
        env = {"STUBCACHE_DIR": str(root), "SRC": src(13), "STUBCACHE_FAULT": "after_build",
               "STUBCACHE_TRUSTED_ROOTS": str(root)}
        killed = run_as(mallory, LOAD, env)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert os.listdir(root / "v1" / "staging"), "the killed build left nothing to clean"
        modes = layout_modes(root)
        pruned = cli_as(alice, root, "prune", "--yes")
        assert pruned.returncode == 0, pruned.stdout + pruned.stderr
        assert os.listdir(root / "v1" / "staging") == []
        assert layout_modes(root) == modes and set(modes.values()) == {0o2770}
        # doctor names a deviation from the shared layout and --fix repairs it
        (root / "v1" / "pins").chmod(0o700)
        shutil.rmtree(root / "v1" / "trash")
        bad = cli_as(alice, root, "doctor", "--format", "json")
        [chk] = [c for c in json.loads(bad.stdout)["checks"] if c["name"] == "shared layout"]
        assert chk["status"] == "error" and "pins" in chk["detail"] and "trash is missing" in chk["detail"]
        assert cli_as(alice, root, "doctor", "--fix").returncode == 0
        good = cli_as(alice, root, "doctor", "--format", "json")
        [chk] = [c for c in json.loads(good.stdout)["checks"] if c["name"] == "shared layout"]
        assert chk["status"] == "ok", chk
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- 7. the CLI does not import from the working directory ----------------------------------------


def test_cli_never_imports_modules_planted_in_the_working_directory(cache_root, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "imported"
    plant = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for mod in ("json", "ctypes", "platformdirs", "fcntl", "hashlib", "csv", "evilspec"):
        (work / f"{mod}.py").write_text(plant + "from stubcache import StubSpec\nspec = StubSpec('e', '')\n"
                                        if mod == "evilspec" else plant)
    for args in (["warm", "evilspec:spec"], ["explain", "evilspec:spec"], ["ls"], ["stats"], ["doctor"]):
        proc = cli(cache_root, *args, cwd=work)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert not marker.exists(), (args, marker.read_text())
    proc = cli(cache_root, "warm", "evilspec:spec", cwd=work)
    assert proc.returncode == 2 and "cannot import" in proc.stderr


def test_init_shared_never_follows_planted_symlinks(tmp_path):


    if os.geteuid() != 0:
        pytest.skip("needs root to pick a group")
    root = tmp_path / "cache"
    subprocess.run([sys.executable, "-m", "stubcache", "init", str(root)], check=True, capture_output=True)
    victim = tmp_path / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    (root / "v1" / "locks" / "evil.lock").symlink_to(victim)
    group = grp.getgrgid(os.getgid()).gr_name
    r = subprocess.run([sys.executable, "-m", "stubcache", "init", "--shared", "--group", group, str(root)],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert oct(victim.stat().st_mode & 0o777) == oct(0o600)


def _root_only_file(path):
    """A file outside the root that only root may read (the target of a planted hard link)."""
    path.write_text("root only\n")
    os.chown(path, 0, 0)
    path.chmod(0o600)
    return path


def test_root_doctor_fix_and_init_never_chmod_or_chgrp_a_hard_link_to_a_file_outside(shared, users):
    root, outside = shared
    # A file only root may read. (With fs.protected_hardlinks=1 a member can link only files she
    # can read and write; with 0, or for such files, she links anything: planted here as root.)
    secret = _root_only_file(outside / "secret")
    v1 = root / "v1"
    [key] = os.listdir(v1 / "entries")
    os.link(secret, v1 / "locks" / ("ab" * 16 + ".lock"))
    os.link(secret, v1 / "pins" / ("ab" * 16))
    os.link(secret, v1 / "entries" / key / "notes")
    before = os.lstat(secret)
    for args in (["doctor", "--fix"], ["init", "--shared", "--group", GROUP]):
        proc = cli(root, *args)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "hard links" in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)  # reported, left alone
        st = os.lstat(secret)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 0, 0), \
            f"{args}: the file outside became mode {stat.S_IMODE(st.st_mode):o} group {grp.getgrgid(st.st_gid).gr_name}"
    assert os.lstat(secret).st_ino == before.st_ino and secret.read_text() == "root only\n"


def test_root_prune_and_rebuild_never_chmod_a_hard_link_where_a_lock_file_belongs(shared, users):
    root, outside = shared
    secret = _root_only_file(outside / "secret")
    os.utime(secret, (1_000_000_000, 1_000_000_000))
    v1 = root / "v1"
    [key] = os.listdir(v1 / "entries")
    # the entry's pin replaced by a hard link (pins/ is group-writable), and every memo's lock
    (v1 / "pins" / key).unlink()
    os.link(secret, v1 / "pins" / key)
    for name in os.listdir(v1 / "state"):
        if name.endswith(".json"):
            p = v1 / "state" / (name + ".lock")
            if p.exists():
                p.unlink()
            os.link(secret, p)
    for args, env in ((["verify", "--rebuild"], {"STUBCACHE_TRUSTED_ROOTS": str(root)}),
                      (["prune", "--yes", "--max-size", "0"], None)):
        proc = cli(root, *args, env=env)
        assert "Traceback" not in proc.stderr, proc.stderr
        st = os.lstat(secret)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime) == (0o600, 0, 0, 1_000_000_000), \
            f"{args}: the file outside became mode {stat.S_IMODE(st.st_mode):o}, mtime {st.st_mtime}"
    assert secret.read_text() == "root only\n"


def test_a_huge_sparse_library_is_refused_before_it_is_hashed(cache_root):
    """A member can put a 16 TiB sparse file (ext4's limit) where a library goes and write its
    size into the manifest: hashing it would hold root's cron ``verify`` and every engine that
    loads the key for about an hour. Beyond the library cap it is refused unread."""

    from stubcache.edge import fsroot

    out = run_py(LOAD, env={"SRC": src(5), "NAME": "huge"}).stdout.split()
    lib = out[2]
    manifest = os.path.join(os.path.dirname(lib), "manifest.json")
    size = fsroot.LIBRARY_CAP + (1 << 20)
    os.unlink(lib)
    subprocess.run(["truncate", "-s", str(size), lib], check=True)
    m = json.loads(Path(manifest).read_text())
    os.chmod(manifest, 0o644)
    with open(manifest, "w") as f:
        json.dump(dict(m, size=size), f)
    os.chmod(manifest, 0o444)
    proc = cli(cache_root, "verify", "--format", "json")
    [r] = json.loads(proc.stdout)["results"]
    assert r["status"] == "bad" and "limit" in r["detail"], r
    os.unlink(os.path.join(r["quarantined_to"], "QUARANTINE_REASON"))
    os.rename(r["quarantined_to"], os.path.dirname(lib))  # back in place: now an engine meets it
    proc = run_py(LOAD, env={"SRC": src(5), "NAME": "huge"})
    assert proc.stdout.split()[:2] == ["5", "True"] and "limit" in proc.stderr, proc.stderr


def test_hashing_a_tracked_path_never_opens_a_fifo_or_device(tmp_path):
    """Tracked-input paths come from manifests members wrote (``explain``, lookups): opening a
    device has effects of its own (a watchdog starts, a tape rewinds), and opening a FIFO
    releases a writer waiting for a reader. Only a regular file is ever opened."""

    from stubcache.edge import fsroot
    from stubcache.key.inputs import changed_inputs, still_valid
    from stubcache.storage.store import file_sha256

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(fifo)!r}, 'w')"])
    try:
        wchan = f"/proc/{writer.pid}/wchan"
        wait_until(lambda: Path(wchan).read_text() == "wait_for_partner",  # blocked in open(), for a reader
                   "the writer to block opening the FIFO", proc=writer)
        with pytest.raises(fsroot.NotRegularFile):
            file_sha256(str(fifo))
        assert not still_valid({str(fifo): "0" * 64}, None)
        assert changed_inputs({str(fifo): "0" * 64}, None)
        assert writer.poll() is None and Path(wchan).read_text() == "wait_for_partner", "the FIFO was opened"
    finally:
        writer.kill()
        writer.wait()


# --- deep trees: every walk and removal is iterative and bounded ------------------------------

DEEP = 3000


def test_root_prune_and_clear_end_cleanly_on_trees_3000_levels_deep(shared, users):
    """A member plants directories 3,000 levels deep (deeper than Python's recursion limit, and
    than PATH_MAX allows as one path) under staging/ and trash/, each with a link to a directory
    outside at the bottom. Root's prune --dry-run, prune and clear --yes end without a traceback,
    say what they left, follow nothing, and change nothing outside the root."""
    root, outside = shared
    before = snapshot(outside)
    key = FAKE
    plant_as(users["mallory"], root, f"""
        for area, name in (("staging", {key!r} + "-999997-deep"), ("trash", {key!r} + "-1-999996")):
            fd = os.open(os.path.join(V1, area), os.O_RDONLY | os.O_DIRECTORY)
            os.mkdir(name, dir_fd=fd)
            for i in range({DEEP}):
                nfd = os.open(name if i == 0 else "d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nfd
                os.mkdir("d", dir_fd=fd)
                with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
                    f.write("x")
            os.symlink({str(outside / 'victim_dir')!r}, "link", dir_fd=fd)
            os.close(fd)
        """)
    try:
        for args in (["prune", "--dry-run"], ["prune", "--yes"], ["prune", "--dry-run"], ["clear", "--yes"]):
            proc = cli(root, *args)
            no_traceback(proc)
            assert "RecursionError" not in proc.stdout + proc.stderr
        assert snapshot(outside) == before
        proc = cli(root, "prune", "--yes")
        assert "deeper than" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        # What is within the bounds went; the rest is left, not followed, and reported.
        for area in ("staging", "trash"):
            [left] = os.listdir(root / "v1" / area)
            assert left.startswith(key)
    finally:
        subprocess.run(["rm", "-rf", str(root / "v1" / "staging"), str(root / "v1" / "trash")], check=True)
