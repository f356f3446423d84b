"""Soak: 16 processes mixing get-or-build, loads, prunes and verifies, with a random process
killed every few seconds. Deselected by default; run with ``pytest -m soak``.
``STUBCACHE_SOAK_SECONDS`` sets the duration (default 60; CI uses a shorter one)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.soak

WORKER = r"""
import json, os, random, sys, time
import stubcache
deadline = float(os.environ["DEADLINE"])
rng = random.Random(os.getpid())
log = open(os.environ["LOG"], "a", buffering=1)
cache = stubcache.StubCache()
while True:  # at least one load, however late the worker started
    n = rng.randrange(6)
    spec = stubcache.StubSpec(f"soak{n % 3}", f'extern "C" int value(void) {{ return {n}; }}\n')
    try:
        got = cache.load(spec).value()
        log.write(json.dumps({"ok": got == n, "want": n, "got": got}) + "\n")
    except Exception as exc:  # every error is reported, none is expected
        log.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
    if rng.random() < 0.3:  # a fresh cache object: a new process's view (memo, verify, pin)
        cache = stubcache.StubCache()
    if time.time() >= deadline:
        break
"""

ADMIN = r"""
import os, random, subprocess, sys, time
deadline = float(os.environ["DEADLINE"])
rng = random.Random(os.getpid())
while time.time() < deadline:
    cmd = rng.choice([["prune", "--max-size", "20K", "--yes"], ["prune", "--older-than", "0s", "--yes"],
                      ["verify"], ["ls", "--format", "json"], ["stats"]])
    p = subprocess.run([sys.executable, "-m", "stubcache", *cmd], capture_output=True, text=True)
    if p.returncode != 0 and cmd[0] != "prune":
        print("ADMIN-FAIL", cmd, p.returncode, p.stdout, p.stderr, flush=True)
    time.sleep(rng.uniform(0.1, 0.5))
"""


def test_soak(tmp_path, cache_root):
    seconds = float(os.environ.get("STUBCACHE_SOAK_SECONDS", "60"))
    deadline = time.time() + seconds
    logs = tmp_path / "logs"
    logs.mkdir()
    env = dict(os.environ, DEADLINE=str(deadline))
    n = 0
    log_of = {}  # pid -> the worker's log

    def start_worker():
        nonlocal n
        n += 1
        log = logs / f"w{n}.jsonl"
        p = subprocess.Popen([sys.executable, "-c", WORKER], env=dict(env, LOG=str(log)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        log_of[p.pid] = log
        return p

    workers = [start_worker() for _ in range(14)]
    admins = [subprocess.Popen([sys.executable, "-c", ADMIN], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    rng = random.Random(7)
    kills = 0
    while kills == 0 or time.time() < deadline:  # at least one kill, however short the soak
        time.sleep(rng.uniform(1.0, 3.0))  # not a synchronisation: the pace of the kills
        i = rng.randrange(len(workers))
        os.killpg(workers[i].pid, signal.SIGKILL)
        workers[i].wait()
        kills += 1
        workers[i] = start_worker()
    for p in workers:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        # every worker that was not killed finished its loads (at least one), all of them right
        assert '"ok": true' in log_of[p.pid].read_text(), f"worker {p.pid} logged no load"
    for p in admins:
        out, _ = p.communicate(timeout=300)
        assert "ADMIN-FAIL" not in out, out
    ok = wrong = 0
    errors = []
    for f in logs.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the line a killed worker was writing
            if "error" in rec:
                errors.append(rec["error"])
            elif rec["ok"]:
                ok += 1
            else:
                wrong += 1
    assert wrong == 0
    assert errors == []
    final = subprocess.run([sys.executable, "-m", "stubcache", "verify"], capture_output=True, text=True)
    assert final.returncode == 0, final.stdout + final.stderr
    print(f"soak: {seconds:.0f}s, {ok} loads, {kills} kills, 0 wrong, 0 errors")
