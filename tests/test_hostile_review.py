"""Attacks found in review of the hostile-root work: a group member of a shared root against
root's ``doctor --fix`` and ``init``."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

from .test_hostile_root import GROUP, cli, shared, users  # noqa: F401  (fixtures)


def test_root_doctor_fix_and_init_never_chmod_or_chgrp_a_hard_link_to_a_file_outside(shared, users):  # noqa: F811
    root, outside = shared
    # A file only root may read. (With fs.protected_hardlinks=1 a member can link only files she
    # can read and write; with 0, or for such files, she links anything: planted here as root.)
    secret = outside / "secret"
    secret.write_text("root only\n")
    os.chown(secret, 0, 0)
    secret.chmod(0o600)
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


def test_root_prune_and_rebuild_never_chmod_a_hard_link_where_a_lock_file_belongs(shared, users):  # noqa: F811
    root, outside = shared
    secret = outside / "secret"
    secret.write_text("root only\n")
    os.chown(secret, 0, 0)
    secret.chmod(0o600)
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
    import json
    import subprocess

    from stubcache import fsroot

    from .conftest import run_py
    from .test_hostile_root import LOAD, cli, src

    out = run_py(LOAD, env={"SRC": src(5), "NAME": "huge"}).stdout.split()
    lib = out[2]
    manifest = os.path.join(os.path.dirname(lib), "manifest.json")
    size = fsroot.LIBRARY_CAP + (1 << 20)
    os.unlink(lib)
    subprocess.run(["truncate", "-s", str(size), lib], check=True)
    m = json.load(open(manifest))
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
    import subprocess
    import sys
    import time

    import pytest

    from stubcache import fsroot
    from stubcache.inputs import changed_inputs, still_valid
    from stubcache.store import file_sha256

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(fifo)!r}, 'w')"])
    try:
        wchan = f"/proc/{writer.pid}/wchan"
        deadline = time.monotonic() + 60
        while Path(wchan).read_text() != "wait_for_partner":  # blocked in open(), waiting for a reader
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.01)
        with pytest.raises(fsroot.NotRegularFile):
            file_sha256(str(fifo))
        assert not still_valid({str(fifo): "0" * 64}, None)
        assert changed_inputs({str(fifo): "0" * 64}, None)
        assert writer.poll() is None and Path(wchan).read_text() == "wait_for_partner", "the FIFO was opened"
    finally:
        writer.kill()
        writer.wait()
