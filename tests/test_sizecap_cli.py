"""The self-enforced size cap, `stubcache config`, `stats --format prometheus`, and the CLI's
wording and exit codes a new user meets."""

from __future__ import annotations

import os
import re

import pytest

from stubcache import StubCache
from stubcache.storage.locking import try_flock

from .conftest import run_py
from .test_cli_support import build_real, run_cli


def _join_prunes() -> None:
    import threading

    for t in threading.enumerate():
        if t.name == "stubcache-sizecap":
            t.join()


def entry_keys(root) -> set[str]:
    d = root / "v1" / "entries"
    return set(os.listdir(d)) if d.is_dir() else set()


def test_cap_is_enforced_after_a_publish_lru_first(cache_root, cxx):
    first = build_real([1], run_py)  # each in its own process, which then exits: nothing in use
    size_one = sum(f.stat().st_size for f in (cache_root / "v1" / "entries" / first[0]).iterdir())
    build_real([2], run_py)
    assert run_cli(cache_root, "config", "set", "max_size", f"{int(size_one * 2.5)}B").returncode == 0
    build_real([3], run_py)  # three entries > 2.5 entries: the least recently used one goes
    keys = entry_keys(cache_root)
    assert len(keys) == 2 and first[0] not in keys
    # A hit never prunes, even over the cap.
    (cache_root / "stubcache-root.json").write_text('{"mode": "private", "max_size": "1B"}')
    os.chmod(cache_root / "stubcache-root.json", 0o644)
    before = entry_keys(cache_root)
    build_real([2, 3], run_py)
    assert entry_keys(cache_root) == before


def test_cap_from_the_environment_and_in_use_entries_are_kept(cache_root, cxx, monkeypatch):
    build_real([1, 2], run_py)
    monkeypatch.setenv("STUBCACHE_MAX_SIZE", "1B")
    cache = StubCache()
    from stubcache import StubSpec

    cache.load(StubSpec("stub9", 'extern "C" int stub_value(void) { return 9; }\n'))  # publishes, pinned
    _join_prunes()
    keys = entry_keys(cache_root)
    assert len(keys) == 1  # the others went; this process's own entry is in use and stays


def test_only_one_process_cleans_at_a_time(cache_root, cxx, monkeypatch):
    from stubcache.admin import sizecap

    build_real([1, 2], run_py)
    store = StubCache().store
    monkeypatch.setenv("STUBCACHE_MAX_SIZE", "1B")
    fd = store.open_lock_file(store.lock_path("sizecap"))
    try:
        assert try_flock(fd)
        assert sizecap.after_publish(store) == "busy"  # another process is cleaning: do not wait
        assert len(entry_keys(cache_root)) == 2
    finally:
        os.close(fd)
    assert sizecap.after_publish(store) == "pruned 2"
    monkeypatch.delenv("STUBCACHE_MAX_SIZE")
    assert sizecap.after_publish(store) == "under cap"  # the default cap
    monkeypatch.setenv("STUBCACHE_MAX_SIZE", "off")
    assert sizecap.after_publish(store) == "no cap"


def test_a_root_removed_after_a_publish_is_not_brought_back(cache_root, cxx):
    """The size cap runs on a helper thread after a publish; if the root's owner removed the root
    meanwhile, that thread must not make the layout afresh (found by the hostile-root property
    test: its next example's scratch directory reappeared under it)."""
    import shutil

    from stubcache.admin import sizecap

    build_real([1], run_py)
    store = StubCache().store
    shutil.rmtree(cache_root)
    assert sizecap.after_publish(store) == "gone"
    assert not cache_root.exists()


def test_config_show_set_and_bad_sizes(cache_root, cxx):
    build_real([1], run_py)
    bad = run_cli(cache_root, "config", "set", "max_size", "10")
    assert bad.returncode == 2 and "give a unit" in bad.stderr and "10B for 10 bytes" in bad.stderr
    neg = run_cli(cache_root, "prune", "--max-size", "-5G", "--yes")
    assert neg.returncode == 2 and "cannot be negative" in neg.stderr
    assert run_cli(cache_root, "config", "set", "max_size", "2G").returncode == 0
    out = run_cli(cache_root, "config", env={"STUBCACHE_MAX_SIZE": "1G"}).stdout
    assert re.search(r"max_size\s+1.0 GiB \(1073741824 bytes\)\s+the smaller", out)
    assert run_cli(cache_root, "config", "unset", "max_size").returncode == 0
    assert re.search(r"max_size\s+2.0 GiB \(2147483648 bytes\)\s+default", run_cli(cache_root, "config").stdout)


def test_stats_prometheus_format(cache_root, cxx):
    build_real([1, 2], run_py)
    build_real([1], run_py)
    text = run_cli(cache_root, "stats", "--format", "prometheus").stdout
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) stubcache_\w+ .+", line)
            continue
        m = re.fullmatch(r'(stubcache_\w+)\{root="([^"]*)"\} (\S+)', line)
        assert m, line
        assert m.group(2) == str(cache_root)
        samples[m.group(1)] = float(m.group(3))
    assert samples["stubcache_builds_total"] == 2 and samples["stubcache_hits_total"] >= 1
    assert samples["stubcache_entries"] == 2 and samples["stubcache_bytes"] > 0
    for name in ("misses_total", "build_seconds_total", "wait_seconds_total", "quarantined_total",
                 "private_builds_total"):
        assert f"stubcache_{name}" in samples


def test_prune_and_clear_wording(cache_root, cxx):
    build_real([1], run_py)
    out = run_cli(cache_root, "prune", "--older-than", "30d", "--yes").stdout
    assert "dry run" not in out and "nothing to remove" in out
    out = run_cli(cache_root, "clear", "--stats", "--yes").stdout
    assert "dry run" not in out and "removed 1 item(s)" in out and "stats reset: deleted" in out


def test_warm_fails_when_the_root_is_read_only(tmp_path, cxx):
    # A file where the root should be: nothing can be created there, whoever runs this.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    root = blocker / "cache"
    spec = tmp_path / "spec.json"
    spec.write_text('{"name": "w1", "cpp_sources": ["extern \\"C\\" int f(void) { return 1; }"]}')
    proc = run_cli(root, "warm", str(spec))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "could not be stored in the cache" in proc.stderr
    doc = run_cli(root, "doctor")
    assert doc.returncode == 1 and "cannot be created" in doc.stdout


def test_help_lists_environment_and_exit_codes(cache_root):
    text = run_cli(cache_root, "--help").stdout
    for name in ("STUBCACHE_DIR", "STUBCACHE_MAX_SIZE", "STUBCACHE_LOCK_TIMEOUT", "STUBCACHE_SEED_DIRS",
                 "STUBCACHE_REQUIRE_HIT", "STUBCACHE_TRUSTED_ROOTS", "exit codes:", "130"):
        assert name in text


@pytest.mark.parametrize("age_days, expect_gone", [(30, "synthetic"), (50, "real")])
def test_entries_of_a_gone_toolchain_age_out_first(cache_root, cxx, monkeypatch, age_days, expect_gone):
    import time

    from stubcache.admin import sizecap
    from _synthetic import fake_entry

    real = build_real([1], run_py)[0]
    store = StubCache().store
    now = time.time()
    os.utime(store.pin_path(real), (now - 60 * 86400, now - 60 * 86400))  # the least recently used
    fake = fake_entry(store, "synthetic", 4096, last_used=now - 40 * 86400)  # a toolchain not here
    sizecap.set_setting(str(cache_root), "toolchain_max_age", f"{age_days}d")
    monkeypatch.setenv("STUBCACHE_MAX_SIZE", f"{sizecap.entries_size(store) - 1}B")  # one must go
    assert sizecap.after_publish(store) == "pruned 1"
    left = entry_keys(cache_root)
    assert left == ({real} if expect_gone == "synthetic" else {fake})


def test_progress_bar_on_a_terminal_only(cache_root, cxx):
    import subprocess
    import sys

    from .conftest import REPO, run_on_pty

    build_real([1, 2, 3], run_py)
    code = "import sys; from stubcache.cli import main; sys.exit(main(['verify']))"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    text = run_on_pty(code, env)
    assert "verifying [" in text and "checked 3 entries: 3 ok, 0 bad" in text
    piped = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "verifying" not in piped.stderr + piped.stdout and "checked 3 entries" in piped.stdout


def test_doctor_and_warm_on_a_read_only_root(tmp_path, cxx):
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only filesystem")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        root = mnt / "cache"
        assert run_cli(root, "init").returncode == 0
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        doc = run_cli(root, "doctor")
        assert doc.returncode == 1 and "read-only filesystem: builds will be private" in doc.stdout
        spec = tmp_path / "spec.json"
        spec.write_text('{"name": "ro1", "cpp_sources": ["extern \\"C\\" int f(void) { return 1; }"]}')
        warm = run_cli(root, "warm", str(spec))
        assert warm.returncode == 1 and "not stored" in warm.stdout and "could not be stored" in warm.stderr
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_gone_toolchain_ages_out_below_the_cap_once_a_day(cache_root, cxx, monkeypatch):
    import time

    from stubcache.admin import sizecap
    from _synthetic import fake_entry

    build_real([1], run_py)
    store = StubCache().store
    now = time.time()
    fake_entry(store, "old_toolchain", 4096, last_used=now - 40 * 86400)
    monkeypatch.setenv("STUBCACHE_MAX_SIZE", "off")
    assert sizecap.after_publish(store) == "no cap"  # the cap turned off: nothing runs
    sizecap.set_setting(str(cache_root), "toolchain_max_age", "30d")
    # The build above ran the daily age-out already (every root has a cap): a day later, it is due.
    stamp = cache_root / "v1" / "state" / "toolchain-ageout"
    os.utime(stamp, (now - 2 * 86400, now - 2 * 86400))
    assert sizecap.after_publish(store) == "pruned 1"  # below any cap, the gone toolchain goes
    assert len(entry_keys(cache_root)) == 1
    fake_entry(store, "old_toolchain2", 4096, last_used=now - 40 * 86400)
    assert sizecap.after_publish(store) == "under cap"  # at most once a day


def test_a_process_forked_during_the_prune_does_not_keep_its_lock(cache_root, cxx, monkeypatch):
    """An engine that forks workers (DataLoader, multiprocessing 'fork') while the size-cap thread
    prunes: the worker inherits the lock's open file, and flock is released only when every copy
    is closed, so a long-lived worker kept every later prune 'busy' (the cap never applied)."""
    import signal
    import time

    from stubcache.admin import sizecap

    build_real([1], run_py)
    store = StubCache().store
    monkeypatch.setenv("STUBCACHE_MAX_SIZE", "1B")
    children = []

    def prune_and_fork(*args):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: says it is running (fork hooks done), then lives on
            os.write(w, b"x")
            time.sleep(30)
            os._exit(0)
        children.append(pid)
        os.close(w)
        assert os.read(r, 1) == b"x"
        os.close(r)
        return 0

    monkeypatch.setattr(sizecap, "_prune", prune_and_fork)
    try:
        assert sizecap.after_publish(store) == "pruned 0"
        fd = store.open_lock_file(store.lock_path("sizecap"))
        try:
            assert try_flock(fd)  # the worker does not hold the cleaner's lock
        finally:
            os.close(fd)
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
