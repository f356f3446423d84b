"""The fleet tier against a real ``redis-server``: hosts are separate cache roots and OS
processes sharing one server; compiles are counted with the CXX wrapper; faults are real
(``kill -9`` of a builder or of the server, ``SIGSTOP``, ``maxmemory``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import stubcache
from stubcache.remote.blob import encode, split
from stubcache.remote.config import RemoteConfigError, config_from_env

from . import redis_server
from .conftest import run_py, spawn_py, wait_until

if not redis_server.available():
    if os.environ.get("STUBCACHE_TEST_REQUIRE_REDIS"):
        raise RuntimeError("STUBCACHE_TEST_REQUIRE_REDIS is set but redis-server or the redis client is missing")
    pytest.skip("needs redis-server (apt-get install redis-server) and the redis client (pip install redis)",
                allow_module_level=True)

SECRET = "fleet-secret-0123456789abcdef"
PREFIX = "stubcache:v1:blob:"


def value_src(n: int) -> str:
    return f'extern "C" int value(void) {{ return {n}; }}\n'


# One engine start: wait for the common start time, get the stub, call it, report.
ENGINE = """
import json, os, sys, time, logging
logging.basicConfig(level=logging.WARNING, format="%(message)s")
gate = os.environ.get("GATE")
if gate:  # one of a herd: say so, then start when the gate opens
    print("ready", flush=True)
    while not os.path.exists(gate):
        time.sleep(0.001)
import stubcache
spec = stubcache.StubSpec(os.environ.get("NAME", "fleet"), os.environ["SRC"])
cache = stubcache.StubCache()
entry = cache.get_or_build(spec)
lib = cache.load_entry(entry)
# "key": what the fleet stores a blob under (the base key); the entry key adds tracked files.
print(json.dumps({"value": lib.value(), "key": entry.manifest.base_key, "entry": entry.key, "path": entry.path,
                  "redis": "redis" in sys.modules}))
"""


@pytest.fixture(scope="module")
def shared_server():
    with redis_server.RedisServer() as server:
        yield server


@pytest.fixture
def redis(shared_server, cache_root):
    """The module's server, emptied, and the remote settings in the environment."""
    shared_server.command("FLUSHALL")
    shared_server.command("CONFIG", "SET", "maxmemory", "0")
    return shared_server


@pytest.fixture
def own_redis(cache_root):
    """A server of this test's own (for tests that kill or stop it)."""
    server = redis_server.RedisServer()
    yield server
    server.stop()


def host_env(tmp_path: Path, host: str, url: str, **extra: str) -> dict:
    env = {"STUBCACHE_DIR": str(tmp_path / f"host-{host}"), "STUBCACHE_REMOTE": url,
           "STUBCACHE_REMOTE_SECRET": SECRET}
    env.update(extra)
    return env


def engines(envs: list[dict], src: str, together: bool = False) -> list[subprocess.Popen]:
    """Start one engine per environment; ``together``: hold them at a gate until all are up."""
    if not together:
        return [spawn_py(ENGINE, env=dict(e, SRC=src)) for e in envs]
    gate = Path(tempfile.mkdtemp(prefix="gate-", dir=Path(envs[0]["STUBCACHE_DIR"]).parent)) / "open"
    procs = [spawn_py(ENGINE, env=dict(e, GATE=str(gate), SRC=src)) for e in envs]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.communicate()
    gate.touch()
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[dict, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr
        out.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


def stats(root: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "stubcache", "--cache-dir", str(root), "stats", "--format", "json"],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def lease_polls(server) -> int:
    """How many times hosts have polled a fleet lease since the last ``CONFIG RESETSTAT`` (only a
    waiting host's poll sends GETRANGE)."""
    for line in server.command("INFO", "commandstats").decode().splitlines():
        if line.startswith("cmdstat_getrange:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def blob_keys(server) -> list[str]:
    return sorted(k.decode()[len(PREFIX):] for k in server.client().keys(PREFIX + "*"))


# --- configuration ---------------------------------------------------------------------------


def test_start_up_checks():
    url = "redis://127.0.0.1:1/0"
    assert config_from_env({}) is None
    with pytest.raises(RemoteConfigError, match="read-write mode needs STUBCACHE_REMOTE_SECRET"):
        config_from_env({"STUBCACHE_REMOTE": url})
    with pytest.raises(RemoteConfigError, match="STUBCACHE_REMOTE_INSECURE=1"):
        config_from_env({"STUBCACHE_REMOTE": url, "STUBCACHE_REMOTE_MODE": "read"})
    cfg = config_from_env({"STUBCACHE_REMOTE": url, "STUBCACHE_REMOTE_MODE": "read", "STUBCACHE_REMOTE_INSECURE": "1"})
    assert cfg.mode == "read" and cfg.secret is None and not cfg.writable
    with pytest.raises(RemoteConfigError, match="at least 16"):
        config_from_env({"STUBCACHE_REMOTE": url, "STUBCACHE_REMOTE_SECRET": "short"})
    with pytest.raises(RemoteConfigError, match="port 0 names no server"):
        config_from_env({"STUBCACHE_REMOTE": "redis://h:0/1", "STUBCACHE_REMOTE_SECRET": SECRET})
    with pytest.raises(RemoteConfigError, match="unsupported URL"):
        config_from_env({"STUBCACHE_REMOTE": "http://x/", "STUBCACHE_REMOTE_SECRET": SECRET})
    with pytest.raises(RemoteConfigError, match="'read' or 'read-write'"):
        config_from_env({"STUBCACHE_REMOTE": url, "STUBCACHE_REMOTE_SECRET": SECRET, "STUBCACHE_REMOTE_MODE": "rw"})
    with pytest.raises(RemoteConfigError, match="positive number"):
        config_from_env({"STUBCACHE_REMOTE": url, "STUBCACHE_REMOTE_SECRET": SECRET, "STUBCACHE_REMOTE_TIMEOUT": "-1"})
    cfg = config_from_env({"STUBCACHE_REMOTE": "rediss://u:pw@h:1/2", "STUBCACHE_REMOTE_SECRET": SECRET,
                           "STUBCACHE_REMOTE_TIMEOUT": "0.5"})
    assert cfg.writable and cfg.timeout == 0.5 and "pw" not in repr(cfg) and "pw" not in cfg.display_url


def test_misconfiguration_is_an_error_when_the_cache_is_made(cache_root, cxx):
    proc = run_py("import stubcache; stubcache.StubCache()", env={"STUBCACHE_REMOTE": "redis://127.0.0.1:1/0"},
                  check=False)
    assert proc.returncode != 0 and "RemoteConfigError" in proc.stderr and "STUBCACHE_REMOTE_SECRET" in proc.stderr


def test_import_stubcache_does_not_import_the_remote_tier(cache_root):
    out = run_py("import sys, stubcache; print(sorted(m for m in sys.modules if 'remote' in m or 'redis' in m))")
    assert out.stdout.strip() == "[]"


def test_import_and_local_hit_neither_import_redis_nor_connect(redis, tmp_path, cxx):
    env = host_env(tmp_path, "a", redis.url)
    [(first, _)] = finish(engines([env], value_src(5)))
    assert first["value"] == 5 and first["redis"]  # a miss talks to the remote store
    before = int(redis.info("total_connections_received"))
    [(hit, _)] = finish(engines([env], value_src(5)))
    assert hit == dict(first, redis=False)
    # no connection at all (the one counted is this INFO's own)
    assert int(redis.info("total_connections_received")) == before + 1
    assert cxx.compiles() == 1


# --- fleet single flight ---------------------------------------------------------------------


def test_three_hosts_four_processes_cold_compile_once_fleet_wide(redis, tmp_path, cxx):
    envs = [host_env(tmp_path, h, redis.url) for h in "abc" for _ in range(4)]
    results = finish(engines(envs, value_src(42), together=True))
    assert [r["value"] for r, _ in results] == [42] * 12
    assert cxx.compiles() == 1
    assert len({r["key"] for r, _ in results}) == 1
    # every process loaded from its own host's root, none from a temporary copy
    for (r, _), e in zip(results, envs):
        assert r["path"].startswith(e["STUBCACHE_DIR"] + "/v1/entries/")
    totals = [stats(Path(tmp_path / f"host-{h}"))["remote"] for h in "abc"]
    assert sum(t["uploads"] for t in totals) == 1
    assert sum(t["hits"] for t in totals) == 2          # the two other hosts downloaded it
    assert blob_keys(redis) == [results[0][0]["key"]]
    # Nothing to warn about, beyond the notice a loaded host prints past 5 s of waiting.
    said = [ln for _, err in results for ln in err.splitlines() if ln.strip()]
    assert all(re.search(r"stubcache: waiting for .* for the fleet$", ln) for ln in said), said
    # the host lock let exactly one process per host talk to Redis
    for h in "abc":
        talkers = [f for f in (tmp_path / f"host-{h}" / "v1" / "events").iterdir() if b'"ev":"remote_' in f.read_bytes()]
        assert len(talkers) == 1, h


def test_builder_host_killed_mid_compile_lease_expires_and_another_host_takes_over(redis, tmp_path, cxx):
    mark = tmp_path / "compiling"
    lease = "1.5"
    a = host_env(tmp_path, "a", redis.url, STUBCACHE_REMOTE_LEASE=lease, STUBCACHE_TEST_CXX_SLEEP="60",
                 STUBCACHE_TEST_CXX_MARK=str(mark))
    builder = subprocess.Popen([sys.executable, "-c", ENGINE], env=dict(os.environ, **a, SRC=value_src(9)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    wait_until(mark.exists, "host a to start compiling", proc=builder)
    b = host_env(tmp_path, "b", redis.url, STUBCACHE_REMOTE_LEASE=lease)
    redis.command("CONFIG", "RESETSTAT")
    waiter = engines([b], value_src(9))  # sees host a's lease and waits for its blob
    wait_until(lambda: lease_polls(redis) >= 2, "host b to wait on host a's lease", proc=waiter[0])
    os.killpg(builder.pid, signal.SIGKILL)  # the builder host dies mid-compile (compiler too)
    builder.wait()
    [(res, err)] = finish(waiter)
    assert res["value"] == 9
    assert cxx.compiles() == 2  # host a's killed attempt, host b's takeover
    remote = stats(tmp_path / "host-b")["remote"]
    assert remote["lease_takeovers"] == 1 and remote["uploads"] == 1
    # a third host now downloads what b built
    [(res_c, _)] = finish(engines([host_env(tmp_path, "c", redis.url)], value_src(9)))
    assert res_c["value"] == 9 and cxx.compiles() == 2


def test_slow_builder_keeps_its_lease_by_heartbeat(redis, tmp_path, cxx):
    # The compile below takes over three lease lifetimes; a lease of 1.5 s leaves a renewal
    # (every 0.5 s) room for a loaded host's scheduling and the 0.3 s call bound.
    lease = "1.5"
    a = host_env(tmp_path, "a", redis.url, STUBCACHE_REMOTE_LEASE=lease, STUBCACHE_TEST_CXX_SLEEP="5")
    b = host_env(tmp_path, "b", redis.url, STUBCACHE_REMOTE_LEASE=lease)
    pa = engines([a], value_src(11))
    wait_until(cxx.compiles, "host a to start compiling", proc=pa[0])
    pb = engines([b], value_src(11))
    results = finish(pa + pb)
    assert [r["value"] for r, _ in results] == [11, 11]
    assert cxx.compiles() == 1  # b waited through many lease lifetimes: a renewed it
    remote = stats(tmp_path / "host-b")["remote"]
    assert remote["hits"] == 1 and remote["lease_waits"] == 1 and remote["lease_takeovers"] == 0


def test_slow_builder_does_not_stall_the_fleet_past_the_lock_timeout(redis, tmp_path, cxx):
    a = host_env(tmp_path, "a", redis.url, STUBCACHE_TEST_CXX_SLEEP="8")
    b = host_env(tmp_path, "b", redis.url, STUBCACHE_LOCK_TIMEOUT="1")
    pa = engines([a], value_src(12))
    wait_until(cxx.compiles, "host a to start compiling", proc=pa[0])
    [(res, err)] = finish(engines([b], value_src(12)))
    assert res["value"] == 12 and "gave up after" in err  # b stopped waiting for a at its bound
    remote = stats(tmp_path / "host-b")["remote"]
    assert remote["lease_waits"] == 1 and remote["hits"] == 0
    finish(pa)
    assert cxx.compiles() == 2


def test_a_failed_build_releases_the_lease_and_every_host_gets_the_error(redis, tmp_path, cxx):
    broken = 'extern "C" int value(void) { return ; }\n'
    procs = engines([host_env(tmp_path, h, redis.url) for h in "ab"], broken, together=True)
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0 and "BuildError" in err
    assert blob_keys(redis) == [] and redis.command("KEYS", "stubcache:v1:lease:*") == b"*0"


# --- integrity -------------------------------------------------------------------------------


def _forge(blob: bytes, key: str, library: bytes, secret: bytes | None) -> bytes:
    """A blob for ``key`` carrying ``library`` with a self-consistent manifest (size, sha256)."""
    import hashlib

    _, manifest, _ = split(blob)
    m = json.loads(manifest)
    m.update(size=len(library), sha256=hashlib.sha256(library).hexdigest())
    return encode(key, json.dumps(m).encode(), library, secret)


@pytest.mark.parametrize("attack", ["forged_library", "unsigned", "wrong_secret", "replayed_key"])
def test_tampered_blob_is_refused_with_the_secret_set(redis, tmp_path, cxx, attack):
    [(a, _)] = finish(engines([host_env(tmp_path, "a", redis.url)], value_src(1)))
    [(evil, _)] = finish(engines([host_env(tmp_path, "evil", redis.url)], value_src(666)))
    r = redis.client()
    good = r.get(PREFIX + a["key"])
    evil_lib = Path(evil["path"]).read_bytes()
    if attack == "forged_library":  # the attacker fixes up size and sha256 but cannot sign
        _, manifest, _ = split(_forge(good, a["key"], evil_lib, None))
        tag = split(good)[0]  # so it keeps the genuine MAC
        forged = b"stubcache-blob/1\n" + struct.pack(">IB", len(manifest), len(tag)) + tag + manifest + evil_lib
    elif attack == "unsigned":
        forged = _forge(good, a["key"], evil_lib, None)
    elif attack == "wrong_secret":
        forged = _forge(good, a["key"], evil_lib, b"another-fleets-secret-0000")
    else:  # a validly signed blob of another key, copied under this key
        forged = r.get(PREFIX + evil["key"])
    r.set(PREFIX + a["key"], forged)
    cxx.reset()
    [(b, err)] = finish(engines([host_env(tmp_path, "b", redis.url)] * 2, value_src(1), together=True))[:1]
    assert b["value"] == 1  # its own build, not the planted code
    assert cxx.compiles() == 1
    assert err.count("refused remote blob") <= 1
    remote = stats(tmp_path / "host-b")["remote"]
    assert remote["rejected_blobs"] >= 1 and remote["hits"] == 0
    # blobs are never overwritten (a host with a wrong secret must not replace the fleet's):
    # the bad blob stays, and every host refuses it and builds for itself
    assert r.get(PREFIX + a["key"]) == forged
    [(c, _)] = finish(engines([host_env(tmp_path, "c", redis.url)], value_src(1)))
    assert c["value"] == 1 and cxx.compiles() == 2
    r.delete(PREFIX + a["key"])  # the operator removes it; the next builder uploads a good one
    finish(engines([host_env(tmp_path, "d", redis.url)], value_src(1)))
    [(e, _)] = finish(engines([host_env(tmp_path, "e", redis.url)], value_src(1)))
    assert e["value"] == 1 and cxx.compiles() == 3 and stats(tmp_path / "host-e")["remote"]["hits"] == 1


def test_insecure_read_mode_still_checks_sha256_and_preimage(redis, tmp_path, cxx):
    [(a, _)] = finish(engines([host_env(tmp_path, "a", redis.url)], value_src(2)))
    [(evil, _)] = finish(engines([host_env(tmp_path, "evil", redis.url)], value_src(667)))
    r = redis.client()
    good = r.get(PREFIX + a["key"])
    _, manifest, _ = split(good)
    r.set(PREFIX + a["key"], encode(a["key"], manifest, Path(evil["path"]).read_bytes(), None))
    env = host_env(tmp_path, "b", redis.url, STUBCACHE_REMOTE_MODE="read", STUBCACHE_REMOTE_INSECURE="1",
                   STUBCACHE_REMOTE_SECRET="")
    cxx.reset()
    [(b, err)] = finish(engines([env], value_src(2)))
    assert b["value"] == 2 and cxx.compiles() == 1 and "does not match the manifest" in err
    assert blob_keys(redis) == sorted([a["key"], evil["key"]])  # read mode uploads nothing


def test_hosts_with_different_fingerprints_never_share(redis, tmp_path, cxx):
    other = tmp_path / "cxx2"
    other.mkdir()
    wrapper2 = other / "c++"
    wrapper2.write_text(cxx.path.read_text())
    wrapper2.chmod(0o755)
    [(a, _)] = finish(engines([host_env(tmp_path, "a", redis.url)], value_src(3)))
    [(b, _)] = finish(engines([host_env(tmp_path, "b", redis.url, CXX=str(wrapper2))], value_src(3)))
    assert a["value"] == b["value"] == 3
    assert a["key"] != b["key"] and cxx.compiles() == 2
    assert blob_keys(redis) == sorted([a["key"], b["key"]])
    # Even a correctly signed blob of the other toolchain, copied under b's key, is refused.
    r = redis.client()
    blob_a = r.get(PREFIX + a["key"])
    _, manifest, library = split(blob_a)
    m = json.loads(manifest)
    from stubcache.key.inputs import absent_paths
    from stubcache.key.derive import entry_key

    # A writer holding the secret, on another toolchain, with a self-consistent entry key.
    m.update(key=entry_key(b["key"], m["headers"], absent_paths(m["inputs"])), base_key=b["key"])
    r.set(PREFIX + b["key"], encode(b["key"], json.dumps(m).encode(), library, SECRET.encode()))
    [(c, err)] = finish(engines([host_env(tmp_path, "c", redis.url, CXX=str(wrapper2))], value_src(3)))
    assert c["value"] == 3 and "pre-image differs" in err
    assert cxx.compiles() == 3


# --- keys are host independent ----------------------------------------------------------------


KEY_CHILD = """
import json, os, socket, stubcache
spec = stubcache.StubSpec("hostfree", os.environ["SRC"])
cache = stubcache.StubCache()
entry = cache.get_or_build(spec)
print(json.dumps({"key": cache.key(spec), "entry": entry.key, "path": entry.path, "cwd": os.getcwd()}))
"""


def test_keys_are_host_independent_and_nothing_host_specific_is_in_them(redis, tmp_path, cxx):
    outs = []
    for i, user in enumerate(["alice", "bob"]):
        cwd = tmp_path / f"cwd-{user}"
        cwd.mkdir()
        # remote off: both hosts build, so their bytes can be compared
        env = dict(os.environ, STUBCACHE_DIR=str(tmp_path / f"{user}-root-{i}"), SRC=value_src(77),
                   HOME=str(tmp_path / f"home-{user}"), USER=user, LOGNAME=user)
        proc = subprocess.run([sys.executable, "-c", KEY_CHILD], cwd=cwd, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout))
    a, b = outs
    assert a["key"] == b["key"] and a["entry"] == b["entry"]
    assert a["path"] != b["path"]
    lib_a, lib_b = Path(a["path"]).read_bytes(), Path(b["path"]).read_bytes()
    assert lib_a == lib_b  # reproducible: the same bytes on every host
    host = socket.gethostname().encode()
    for out in outs:
        root = out["path"].split("/v1/")[0]
        for needle in (root.encode(), (root + "/v1/staging").encode(), str(tmp_path).encode(), out["cwd"].encode()):
            assert needle not in lib_a
        assert str(tmp_path) not in out["key"]
    if len(host) >= 4:
        assert host not in lib_a


# --- faults ----------------------------------------------------------------------------------


def test_redis_killed_mid_run_engines_still_start(own_redis, tmp_path, cxx):
    [(a, _)] = finish(engines([host_env(tmp_path, "a", own_redis.url)], value_src(21)))
    own_redis.kill()
    results = finish(engines([host_env(tmp_path, "b", own_redis.url)] * 3, value_src(21), together=True))
    assert [r["value"] for r, _ in results] == [21] * 3
    assert cxx.compiles() == 2  # host b builds once for itself
    warned = [err for _, err in results if "remote cache" in err]
    assert len(warned) == 1 and warned[0].count("unusable") == 1  # the one process that tried, once
    assert stats(tmp_path / "host-b")["remote"]["errors"] >= 1


def test_redis_stopped_every_call_times_out_and_engines_start(own_redis, tmp_path, cxx):
    own_redis.pause()  # accepts connections (kernel backlog), never answers
    try:
        results = finish(engines([host_env(tmp_path, "a", own_redis.url, STUBCACHE_REMOTE_TIMEOUT="0.5")] * 2,
                                 value_src(22)), timeout=60)
    finally:
        own_redis.resume()
    assert [r["value"] for r, _ in results] == [22, 22] and cxx.compiles() == 1
    # the one process that asked timed out (it did not hang) and warned once
    assert sum(err.count("unusable (TimeoutError") for _, err in results) == 1


def test_redis_full_refuses_the_upload_and_the_engine_starts(own_redis, tmp_path, cxx):
    used = int(own_redis.info("used_memory"))
    own_redis.command("CONFIG", "SET", "maxmemory-policy", "noeviction")
    own_redis.command("CONFIG", "SET", "maxmemory", str(used + 4096))
    [(a, err)] = finish(engines([host_env(tmp_path, "a", own_redis.url)], value_src(23)))
    assert a["value"] == 23 and "maxmemory" in err and err.count("unusable") == 1
    assert own_redis.command("KEYS", PREFIX + "*") == b"*0"
    own_redis.command("CONFIG", "SET", "maxmemory", "0")


def test_a_partial_upload_is_never_visible(own_redis, tmp_path, cxx):
    key = "0" * 32
    total = 1 << 20
    head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(PREFIX) + 32, (PREFIX + key).encode(), total)
    with socket.create_connection(("127.0.0.1", own_redis.port)) as s:
        s.sendall(head + b"x" * (total // 2))  # the uploader dies half way
    # the server has read all it will get of that connection once it has dropped it
    wait_until(lambda: own_redis.info("connected_clients") == "1", "the server to drop the uploader")
    assert own_redis.command("EXISTS", PREFIX + key) == b":0"


# --- require-hit, CLI -------------------------------------------------------------------------


def test_require_hit_is_served_by_the_remote_store(redis, tmp_path, cxx):
    finish(engines([host_env(tmp_path, "a", redis.url)], value_src(31)))
    [(b, _)] = finish(engines([host_env(tmp_path, "b", redis.url, STUBCACHE_REQUIRE_HIT="1")], value_src(31)))
    assert b["value"] == 31 and cxx.compiles() == 1
    proc = spawn_py(ENGINE, env=dict(host_env(tmp_path, "c", redis.url, STUBCACHE_REQUIRE_HIT="1"), SRC=value_src(32)))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "CacheMissError" in err and "remote" in err
    assert cxx.compiles() == 1 and blob_keys(redis) == [b["key"]]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stubcache", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=60)


def test_cli_ls_prune_doctor_remote(redis, tmp_path, cxx):
    env = host_env(tmp_path, "a", redis.url)
    [(a, _)] = finish(engines([env], value_src(41)))
    ls = json.loads(cli("ls", "--remote", "--format", "json", env=env).stdout)
    assert [(e["key"], e["name"], e["signed"], e["error"]) for e in ls] == [(a["key"], "fleet", True, None)]
    table = cli("ls", "--remote", env=env).stdout
    assert "fleet" in table and "1 blob" in table
    # URL from the option, no secret needed to list or prune
    assert cli("ls", "--remote", "--remote-url", redis.url, env={"STUBCACHE_REMOTE": ""}).returncode == 0
    redis.client().set(PREFIX + "f" * 32, b"junk")
    dry = cli("prune", "--remote", "--max-age", "1d", "--dry-run", env=env)
    assert dry.returncode == 0 and "would remove 1 blob" in dry.stdout and "not a stubcache blob" in dry.stdout
    assert cli("prune", "--remote", env=env).returncode == 2  # --max-age is required
    time.sleep(1.1)  # not a synchronisation: the blobs must grow older than the --max-age below
    done = cli("prune", "--remote", "--max-age", "1s", "--yes", env=env)
    assert done.returncode == 0 and "removed 2 blob(s)" in done.stdout
    assert blob_keys(redis) == []
    doc = json.loads(cli("doctor", "--format", "json", env=env).stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["remote connection"]["status"] == "ok" and checks["remote writes"]["status"] == "ok"
    finish(engines([env], value_src(42)))
    doc = json.loads(cli("doctor", "--format", "json", env=dict(env, STUBCACHE_REMOTE_SECRET="x" * 20)).stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["remote secret"]["status"] == "error" and doc["errors"] >= 1
    down = json.loads(cli("doctor", "--format", "json", env=dict(env, STUBCACHE_REMOTE="redis://127.0.0.1:1/0")).stdout)
    assert {c["name"]: c["status"] for c in down["checks"]}["remote connection"] == "error"
    opt = json.loads(cli("doctor", "--format", "json", "--remote-url", "redis://127.0.0.1:1/0",
                         "--remote-timeout", "0.5", env=env).stdout)
    assert {c["name"]: c["status"] for c in opt["checks"]}["remote connection"] == "error"
    st = cli("stats", env=env).stdout
    assert "remote uploads" in st


def test_blob_built_from_files_that_differ_here_is_refused(redis, tmp_path, cxx):
    """Blobs are stored under the base key; a host whose copy of a tracked file (here a header
    found through CPATH) differs from the builder's refuses the blob and builds its own."""
    inc = tmp_path / "sysinc"
    inc.mkdir()
    (inc / "val.h").write_text("#define VAL 1\n")
    src = '#include <val.h>\nextern "C" int value(void) { return VAL; }\n'
    [(a, _)] = finish(engines([host_env(tmp_path, "a", redis.url, CPATH=str(inc))], src))
    assert a["value"] == 1 and blob_keys(redis) == [a["key"]] and a["entry"] != a["key"]
    (inc / "val.h").write_text("#define VAL 2\n")  # host b's copy of the header differs
    [(b, err)] = finish(engines([host_env(tmp_path, "b", redis.url, CPATH=str(inc))], src))
    assert b["value"] == 2 and "differ on this host" in err
    assert cxx.compiles() == 2


def test_read_mode_never_writes_to_the_remote_store(own_redis, tmp_path, cxx):
    # Read-mode hosts on a cold key, on a key another host is building, on a stored blob, and on
    # a blob they refuse: none of them sends a single write (no SET, lease, script, delete).
    server = own_redis

    def write_commands() -> dict:
        stats_text = server.command("INFO", "commandstats").decode()
        calls = {}
        for line in stats_text.splitlines():
            if line.startswith("cmdstat_"):
                name, _, rest = line[len("cmdstat_"):].partition(":")
                calls[name] = int(rest.split(",")[0].split("=")[1])
        return {k: v for k, v in calls.items()
                if k not in ("get", "getrange", "exists", "strlen", "ping", "hello", "info", "config|resetstat")
                and not k.startswith("client|")}

    def reader(host: str, n: int) -> tuple[dict, str]:
        server.command("CONFIG", "RESETSTAT")
        changes = int(server.info("rdb_changes_since_last_save"))
        [(res, err)] = finish(engines([host_env(tmp_path, host, server.url, STUBCACHE_REMOTE_MODE="read")],
                                      value_src(n)))
        assert write_commands() == {} and int(server.info("rdb_changes_since_last_save")) == changes, host
        assert res["value"] == n
        return res, err

    reader("cold", 41)
    [(a, _)] = finish(engines([host_env(tmp_path, "w", server.url)], value_src(42)))  # a writer
    reader("hit", 42)
    assert stats(tmp_path / "host-hit")["remote"]["hits"] == 1
    client = server.client()
    blob = client.get(PREFIX + a["key"])
    client.set(PREFIX + a["key"], blob[:-1] + bytes([blob[-1] ^ 1]))  # tampered
    _, err = reader("refuses", 42)
    assert "refused remote blob" in err
    client.delete(PREFIX + a["key"])
    # Being built elsewhere, then gone: the lease is taken away once the reader polls it (so a
    # reader started late on a loaded machine still finds it); that DEL is this test's only write.
    lease = "stubcache:v1:lease:" + a["key"]
    client.set(lease, b"{}")
    server.command("CONFIG", "RESETSTAT")
    changes = int(server.info("rdb_changes_since_last_save"))
    [waiting] = engines([host_env(tmp_path, "waits", server.url, STUBCACHE_REMOTE_MODE="read")], value_src(42))
    # GETRANGE: the blob's fetch, then each poll of the lease; the first poll found it held
    wait_until(lambda: lease_polls(server) >= 2, "the reader to wait on the lease", proc=waiting)
    client.delete(lease)
    [(res, _)] = finish([waiting])
    assert res["value"] == 42
    assert write_commands() == {"del": 1} and int(server.info("rdb_changes_since_last_save")) == changes + 1
    assert stats(tmp_path / "host-waits")["remote"]["lease_waits"] == 1


@pytest.mark.parametrize("url", ["redis://127.0.0.1:abc/0", "redis://127.0.0.1:99999/0", "redis://[::1/0",
                                 "redis://127.0.0.1:6379/one"])
def test_a_malformed_url_is_a_clear_error_when_the_cache_is_made(cache_root, cxx, url):
    # Not a crash on the first miss (a bad port), nor a silent fall back to database 0 (a typo
    # in the database number would share another fleet's keyspace).
    proc = run_py("import stubcache; stubcache.StubCache(); print('made')",
                  env={"STUBCACHE_REMOTE": url, "STUBCACHE_REMOTE_SECRET": "0123456789abcdef0123"}, check=False)
    assert proc.returncode != 0 and "made" not in proc.stdout
    assert "RemoteConfigError" in proc.stderr and "STUBCACHE_REMOTE" in proc.stderr


def test_rediss_tls_through_the_bounded_connection(tmp_path, cache_root, cxx):
    # The per-call bound wraps the TLS socket too: a fleet over rediss:// uploads and downloads.
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    port = redis_server.free_port()
    try:
        server = redis_server.RedisServer("--tls-port", str(port), "--tls-cert-file", str(cert),
                                          "--tls-key-file", str(key), "--tls-auth-clients", "no")
    except RuntimeError:
        pytest.skip("this redis-server has no TLS support")
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none"
        results = finish([*engines([host_env(tmp_path, "a", url)], value_src(71))])
        results += finish(engines([host_env(tmp_path, "b", url)], value_src(71)))
        assert [r["value"] for r, _ in results] == [71, 71] and all(not e.strip() for _, e in results)
        assert cxx.compiles() == 1 and stats(tmp_path / "host-b")["remote"]["hits"] == 1
    finally:
        server.stop()


def test_warm_says_whether_it_built_or_fetched_from_the_fleet(redis, tmp_path, cxx):
    """`warm` on the first host compiles (`built`); on a second host it downloads the blob the
    first one uploaded (`fetched`, no compile there); again on that host it is `cached`."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(stubcache.StubSpec("warm_fleet", value_src(7)).to_dict()))

    def warm(host: str) -> str:
        env = dict(os.environ, **host_env(tmp_path, host, redis.url))
        proc = subprocess.run([sys.executable, "-m", "stubcache", "warm", "--format", "json", str(spec)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.loads(proc.stdout)["results"][0]["status"]

    assert warm("a") == "built"
    compiles = cxx.compiles()
    assert compiles == 1
    assert warm("b") == "fetched"
    assert warm("b") == "cached"
    assert cxx.compiles() == compiles
