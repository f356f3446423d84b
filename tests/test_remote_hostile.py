"""The fleet tier against a hostile network, a hostile writer to Redis and a broken host root: a
real ``redis-server``, engines as OS processes, and (for a broken network) a TCP relay in front of
the server that forwards its replies one byte at a time."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from . import redis_server
from .conftest import wait_until
from .test_remote import PREFIX, blob_keys, engines, finish, host_env, stats, value_src  # noqa: F401

if not redis_server.available():
    pytest.skip("needs redis-server and the redis client", allow_module_level=True)


class TrickleRelay:
    """A loopback TCP relay to a real server: requests pass at once, replies come back one byte
    every ``gap`` seconds (a link that is alive but crawls: no single read ever times out)."""

    def __init__(self, port: int, gap: float) -> None:
        self.upstream = port
        self.gap = gap
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.gap), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, gap: float) -> None:
        try:
            while not self.closed:
                data = src.recv(65536)
                if not data:
                    break
                if not gap:
                    dst.sendall(data)
                    continue
                for i in range(len(data)):
                    if self.closed:
                        return
                    dst.sendall(data[i:i + 1])
                    time.sleep(gap)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.sock.close()


@pytest.fixture
def server(cache_root):
    s = redis_server.RedisServer()
    yield s
    s.stop()


def test_a_crawling_link_cannot_stall_an_engine_past_the_call_timeout(server, tmp_path, cxx):
    # Host a builds and uploads (a blob of some kilobytes); host b reaches Redis through a link
    # that delivers one byte every 20 ms: each read gets a byte well within the timeout, so only
    # a bound on the whole call stops the download (uncapped it would take minutes).
    [(a, _)] = finish(engines([host_env(tmp_path, "a", server.url)], value_src(31)))
    size = int(server.command("STRLEN", PREFIX + a["key"])[1:])
    assert size > 4000
    relay = TrickleRelay(server.port, gap=0.02)
    try:
        [(b, err)] = finish(engines([host_env(tmp_path, "b", relay.url, STUBCACHE_REMOTE_TIMEOUT="1")],
                                    value_src(31)), timeout=90)
    finally:
        relay.close()
    assert b["value"] == 31 and "unusable" in err and err.count("unusable") == 1
    assert stats(tmp_path / "host-b")["remote"]["errors"] >= 1
    assert cxx.compiles() == 2  # host b gave up on the remote store and built for itself


def test_a_huge_planted_lease_value_is_never_downloaded_by_waiting_hosts(server, tmp_path, cxx):
    # A writer to Redis plants a 32 MiB "lease" on a key nobody builds: a waiting host polls the
    # lease many times a second; it must learn that a lease exists without fetching its value.
    [(a, _)] = finish(engines([host_env(tmp_path, "a", server.url)], value_src(32)))
    key = a["key"]
    client = server.client()
    client.delete(PREFIX + key)
    client.set("stubcache:v1:lease:" + key, b"x" * (32 << 20))
    before = int(server.info("total_net_output_bytes"))
    [(b, err)] = finish(engines([host_env(tmp_path, "b", server.url, STUBCACHE_LOCK_TIMEOUT="2")], value_src(32)))
    sent = int(server.info("total_net_output_bytes")) - before
    assert b["value"] == 32 and "gave up" in err
    assert sent < 1 << 20, f"the server sent {sent} bytes to a host waiting on a planted lease"


def test_ls_remote_reads_only_a_header_of_a_blob_whose_header_lies(server, tmp_path):
    # A planted value whose header claims a 2 GiB manifest: listing must not fetch the value.
    import struct
    import subprocess
    import sys

    from stubcache.remote.blob import MAGIC

    client = server.client()
    client.set(PREFIX + "f" * 32, MAGIC + struct.pack(">IB", 1 << 31, 0) + b"x" * (32 << 20))
    before = int(server.info("total_net_output_bytes"))
    proc = subprocess.run([sys.executable, "-m", "stubcache", "ls", "--remote", "--remote-url", server.url,
                           "--format", "json"], capture_output=True, text=True, timeout=120)
    sent = int(server.info("total_net_output_bytes")) - before
    assert proc.returncode == 0, proc.stderr
    [entry] = json.loads(proc.stdout)
    assert entry["error"] and entry["size"] > 32 << 20
    assert sent < 1 << 20, f"ls --remote pulled {sent} bytes of a blob to read its header"


def test_a_blip_during_the_build_does_not_cost_the_builder_its_lease(server, tmp_path, cxx):
    # Host a builds (8 s); Redis stops answering for longer than one heartbeat period (2 s) plus
    # the call timeout but well within the lease (6 s), so one renewal fails. The next renewal must keep the lease: host b, started
    # after the blip, waits for a's blob instead of taking over and compiling a second time.
    import os
    import subprocess
    import sys

    from .test_remote import ENGINE

    mark = tmp_path / "compiling"
    a = host_env(tmp_path, "a", server.url, STUBCACHE_REMOTE_LEASE="6", STUBCACHE_REMOTE_TIMEOUT="0.3",
                 STUBCACHE_TEST_CXX_SLEEP="8", STUBCACHE_TEST_CXX_MARK=str(mark))
    builder = subprocess.Popen([sys.executable, "-c", ENGINE], env=dict(os.environ, **a, SRC=value_src(33)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(mark.exists, "host a to start compiling", proc=builder)
    server.pause()
    time.sleep(2.5)  # the blip under test: one heartbeat period plus the call timeout, within the lease
    server.resume()
    [(b, _)] = finish(engines([host_env(tmp_path, "b", server.url, STUBCACHE_REMOTE_LEASE="6")], value_src(33)))
    [(res_a, err_a)] = finish([builder])
    assert res_a["value"] == b["value"] == 33
    assert "unusable" in err_a  # the failed renewal was reported (once)
    assert cxx.compiles() == 1, "host b took over a lease its builder still held"
    assert stats(tmp_path / "host-b")["remote"]["hits"] == 1


def _claim_with_errors(server, key: str, lease: str, timeout: str):
    """A fleet lease on ``key`` claimed in this process (``lease``/``timeout``: the settings), and
    the list that collects the remote errors recorded after the claim (the heartbeat's)."""
    from stubcache.remote.config import config_from_env
    from stubcache.remote.tier import Claim, RemoteTier
    from stubcache.storage.events import Event

    config = config_from_env({"STUBCACHE_REMOTE": server.url, "STUBCACHE_REMOTE_SECRET": "s" * 32,
                              "STUBCACHE_REMOTE_LEASE": lease, "STUBCACHE_REMOTE_TIMEOUT": timeout})
    errors: list[str] = []

    def event(ev: str, key: str, seconds: float | None = None, **extra: object) -> None:
        if ev == Event.REMOTE_ERROR:
            errors.append(key)

    claim = None
    for _ in range(5):  # a loaded host may miss the short bound of the claim itself
        server.command("DEL", "stubcache:v1:lease:" + key)
        claim = RemoteTier(config, event).fetch_or_claim(key, {"spec": key}, "heartbeat", budget=10)
        if isinstance(claim, Claim):
            break
    assert isinstance(claim, Claim)
    errors.clear()
    return claim, errors


def test_a_blip_over_two_renewals_does_not_cost_the_lease_while_it_lives(server):
    # A 12 s lease, renewed every 4 s: the blip starts 3 s after the claim and lasts 6.5 s, so
    # it covers the renewals due at 4 s and (one timeout later) 8.3 s; Redis is back at 9.5 s,
    # with 2.5 s of the lease left. Renewing only at the next third (12.6 s) came after the
    # expiry: another host took over. Retrying every twelfth (1 s) renews it in time.
    import redis

    key = "c" * 64
    lease = "stubcache:v1:lease:" + key
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    claim, errors = _claim_with_errors(server, key, lease="12", timeout="0.3")
    start = time.monotonic()
    try:
        time.sleep(3.0)
        server.pause()
        time.sleep(6.5)
        server.resume()
        time.sleep(max(0.0, start + 13.5 - time.monotonic()))  # past the lease's first expiry
        assert client.get(lease) is not None, "the lease expired with Redis back in time"
        assert client.pttl(lease) > 6000
        assert len(errors) >= 2  # each failed renewal during the blip was recorded
    finally:
        claim.release()


def test_the_heartbeat_gives_up_once_the_lease_has_surely_expired(server):
    # Redis stops answering for longer than the whole lease (1 s): the retries (every twelfth of
    # it) stop once the lease cannot be alive any more, instead of recording an error every
    # twelfth of a lease for the rest of a long outage.
    import threading

    key = "d" * 64
    claim, errors = _claim_with_errors(server, key, lease="1", timeout="0.2")
    server.pause()
    try:
        time.sleep(3.0)
        beating = [t for t in threading.enumerate() if t.name == f"stubcache-lease-{key[:8]}"]
        assert not beating, "the heartbeat still retries a lease that expired two seconds ago"
        assert 1 <= len(errors) <= 8
    finally:
        server.resume()
        claim.release()


NESTED = b"[" * 100000  # valid JSON's prefix that makes Python's parser recurse past its limit


def test_a_deeply_nested_manifest_does_not_break_ls_or_prune_remote(server, tmp_path):
    import subprocess
    import sys

    from stubcache.remote.blob import encode

    server.client().set(PREFIX + "e" * 32, encode("e" * 32, NESTED, b"lib", None))
    base = [sys.executable, "-m", "stubcache"]
    ls = subprocess.run(base + ["ls", "--remote", "--remote-url", server.url, "--format", "json"],
                        capture_output=True, text=True, timeout=120)
    assert ls.returncode == 0, ls.stderr
    [entry] = json.loads(ls.stdout)
    assert entry["error"].startswith("unreadable")
    prune = subprocess.run(base + ["prune", "--remote", "--max-age", "30d", "--yes", "--remote-url", server.url],
                           capture_output=True, text=True, timeout=120)
    assert prune.returncode == 0 and "removed 1 blob" in prune.stdout, prune.stderr
    assert blob_keys(server) == []


def test_insecure_read_mode_refuses_a_deeply_nested_manifest_and_starts(server, tmp_path, cxx):
    from stubcache.remote.blob import encode

    [(a, _)] = finish(engines([host_env(tmp_path, "a", server.url)], value_src(51)))
    server.client().set(PREFIX + a["key"], encode(a["key"], NESTED, b"lib", None))
    r = host_env(tmp_path, "r", server.url, STUBCACHE_REMOTE_MODE="read", STUBCACHE_REMOTE_INSECURE="1")
    del r["STUBCACHE_REMOTE_SECRET"]
    [(res, err)] = finish(engines([r], value_src(51)))
    assert res["value"] == 51 and "refused remote blob" in err and "unreadable manifest" in err
    assert stats(tmp_path / "host-r")["remote"]["rejected_blobs"] == 1


@pytest.mark.parametrize("where", ["blob", "lease"])
def test_a_value_of_the_wrong_type_leaves_the_engine_to_build_locally(server, tmp_path, cxx, where):
    [(a, _)] = finish(engines([host_env(tmp_path, "a", server.url)], value_src(61)))
    client = server.client()
    client.delete(PREFIX + a["key"])
    client.rpush(f"stubcache:v1:{where}:" + a["key"], b"x", b"y")  # a list where a string belongs
    [(b, err)] = finish(engines([host_env(tmp_path, "b", server.url)], value_src(61)))
    assert b["value"] == 61 and err.count("unusable") == 1 and "WRONGTYPE" in err
    assert cxx.compiles() == 2


def test_the_fleet_lease_is_released_even_when_clearing_the_host_lease_fails(server, tmp_path, cxx):
    # While host a builds, its host lease file is replaced by a directory (a broken or hostile
    # root): clearing it fails at the end of the build. The fleet lease must still be released
    # and its heartbeat thread stopped, or a live engine would hold the key for the fleet forever.
    import os
    import subprocess
    import sys

    mark = tmp_path / "compiling"
    a = host_env(tmp_path, "a", server.url, STUBCACHE_REMOTE_LEASE="1", STUBCACHE_TEST_CXX_SLEEP="2",
                 STUBCACHE_TEST_CXX_MARK=str(mark))
    code = """
import os, threading, stubcache
spec = stubcache.StubSpec("fleet", os.environ["SRC"])
try:
    stubcache.StubCache().get_or_build(spec)
    print("built")
except OSError as exc:
    print("error", type(exc).__name__)
print(sorted(t.name for t in threading.enumerate() if t.name.startswith("stubcache-lease")))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, **a, SRC=value_src(81)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(mark.exists, "host a to start compiling", proc=proc)
    leases = tmp_path / "host-a" / "v1" / "leases"
    [lease] = [p for p in leases.iterdir() if p.name.endswith(".json")]
    lease.unlink()
    lease.mkdir()
    (lease / "x").write_text("")
    out, err = proc.communicate(timeout=120)
    assert out.splitlines()[-1] == "[]", (out, err)  # no heartbeat left running
    assert server.command("KEYS", "stubcache:v1:lease:*") == b"*0"  # released, not left to expire


def test_a_planted_lease_nested_past_the_parser_leaves_the_engine_to_build(server, tmp_path, cxx):
    # A writer to Redis plants a lease value nested deeper than the JSON parser goes (within the
    # 1 KiB of it that a waiting host reads): naming the holder in the "gave up" message must
    # not raise RecursionError out of the engine's start.
    [(a, _)] = finish(engines([host_env(tmp_path, "a", server.url)], value_src(33), 0))
    key = a["key"]
    client = server.client()
    client.delete(PREFIX + key)
    client.set("stubcache:v1:lease:" + key, b"[" * 1024)
    [(b, err)] = finish(engines([host_env(tmp_path, "b", server.url, STUBCACHE_LOCK_TIMEOUT="2")], value_src(33), 0))
    assert b is not None and b["value"] == 33 and "gave up" in err, err


def test_a_planted_lease_cannot_write_control_characters_to_the_log(server, tmp_path, cxx):
    # The holder named in "waiting for"/"gave up" messages comes from a lease anyone with access
    # to Redis may write: its values are escaped as a local lease's are, so it cannot send
    # terminal escape sequences or forge log lines.
    [(a, _)] = finish(engines([host_env(tmp_path, "a", server.url)], value_src(34), 0))
    key = a["key"]
    client = server.client()
    client.delete(PREFIX + key)
    client.set("stubcache:v1:lease:" + key, json.dumps({"pid": "\x1b[2J1", "host": "h\nstubcache: forged"}))
    [(b, err)] = finish(engines([host_env(tmp_path, "b", server.url, STUBCACHE_LOCK_TIMEOUT="2")], value_src(34), 0))
    assert b["value"] == 34 and "gave up" in err, err
    assert "\x1b" not in err and "\nstubcache: forged" not in err, err
