"""A remote hit's fetch through stubcache's own protocol reader (``stubcache.remote.resp``), against
a real ``redis-server`` (passwords, ACL users, databases) and against hostile peers on real
sockets: the same answers as redis-py, never redis-py imported on a remote hit, and every reply
bounded."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest

from stubcache.remote import resp
from stubcache.remote.backend import RemoteUnavailable
from stubcache.remote.config import config_from_env
from stubcache.remote.redis_backend import BLOB, RedisBackend

from . import redis_server
from .test_remote import SECRET, engines, finish, host_env, stats, value_src

if not redis_server.available():
    pytest.skip("needs redis-server and the redis client", allow_module_level=True)


def backend(url: str, timeout: float = 2.0) -> RedisBackend:
    cfg = config_from_env({"STUBCACHE_REMOTE": url, "STUBCACHE_REMOTE_SECRET": SECRET,
                           "STUBCACHE_REMOTE_TIMEOUT": str(timeout)})
    assert cfg is not None
    return RedisBackend(cfg)


@pytest.fixture(scope="module")
def locked_server():
    """A server that wants a password, with an ACL user of its own and a value in database 3."""
    import redis

    with redis_server.RedisServer() as server:
        server.command("ACL", "SETUSER", "fleet", "on", ">fleet:pw/1", "~*", "+@all")
        db3 = redis.Redis(port=server.port, db=3)
        db3.set(BLOB + "k", b"in db 3")
        db3.close()
        assert server.command("CONFIG", "SET", "requirepass", "sesame pw") == b"+OK"
        yield server


def test_a_remote_hit_imports_no_redis_client(shared_server, tmp_path, cxx):
    shared_server.command("FLUSHALL")
    [(a, _)] = finish(engines([host_env(tmp_path, "a", shared_server.url)], value_src(71)))
    assert a["redis"]  # the builder claims the key and uploads through redis-py
    [(b, err)] = finish(engines([host_env(tmp_path, "b", shared_server.url)], value_src(71)))
    assert b["value"] == 71 and b["key"] == a["key"] and not err.strip()
    assert b["redis"] is False  # fetched through stubcache.remote.resp
    assert stats(tmp_path / "host-b")["remote"]["hits"] == 1
    assert cxx.compiles() == 1


@pytest.fixture(scope="module")
def shared_server():
    with redis_server.RedisServer() as server:
        yield server


@pytest.mark.parametrize("size", [0, 1, 5, 65536 + 3, 3 << 20])
def test_the_fetch_answers_as_redis_py_does(shared_server, size):
    shared_server.command("FLUSHALL")
    value = bytes(range(256)) * (size // 256) + b"\r\n$-1\r\n"[: size % 256]  # protocol bytes inside
    value = (value + bytes(size))[:size]
    ours, theirs = backend(shared_server.url), backend(shared_server.url)
    client = shared_server.client()
    try:
        if size:
            client.set(BLOB + "k", value)
        for limit in (size + 10, max(size - 1, 0), 0):
            got = ours.get_blob("k", limit)
            want = theirs._redis.getrange(BLOB + "k", 0, limit) or None
            assert got == want
        assert ours.get_blob("absent", 100) is None
        assert ours._client is None
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize("auth", ["password", "user"])
def test_the_fetch_authenticates_and_selects_the_database(locked_server, auth):
    creds = ":sesame%20pw@" if auth == "password" else "fleet:fleet%3Apw%2F1@"
    url = f"redis://{creds}127.0.0.1:{locked_server.port}"
    for path, want in (("/3", b"in db 3"), ("/0", None), ("", None)):
        b = backend(url + path)
        try:
            assert b.get_blob("k", 100) == want
            assert b.get_blob("k", 100) == want  # (the connection is reused)
        finally:
            b.close()
    wrong = backend(f"redis://{'fleet:' if auth == 'user' else ':'}nope@127.0.0.1:{locked_server.port}/3")
    with pytest.raises(RemoteUnavailable, match="WRONGPASS|invalid"):
        wrong.get_blob("k", 100)
    none = backend(f"redis://127.0.0.1:{locked_server.port}/3")
    with pytest.raises(RemoteUnavailable, match="NOAUTH"):
        none.get_blob("k", 100)


@pytest.mark.parametrize("url", [
    "redis://h", "redis://h:7000/2", "redis://:p%40ss@h:1/0", "redis://u%3Ax:p%2F@H.example:2/15",
    "redis://[::1]:6390/1", "redis://localhost/", "redis://u:p@h:5/",
])
def test_a_url_is_read_as_redis_py_reads_it(url):
    from redis.connection import parse_url

    got = resp.fetch_target(url)
    assert got is not None
    want = parse_url(url)
    assert (got.host, got.port, got.db) == (want.get("host", "localhost"), want.get("port", 6379), want.get("db", 0))
    assert (got.username, got.password) == (want.get("username"), want.get("password"))


@pytest.mark.parametrize("url", ["rediss://h:1/0", "redis://h:1/0?db=2", "redis://h:1/0?ssl_cert_reqs=none",
                                 "redis://user@h:1/0", "unix:///tmp/s", "redis://h:0"])
def test_other_urls_are_left_to_redis_py(url):
    assert resp.fetch_target(url) is None


class Peer:
    """A loopback server whose n-th connection answers its first command with ``replies[n]`` (the
    last one for every later connection; sent as they are, a byte every ``trickle`` seconds if
    set, or nothing at all for ``None``), then closes it."""

    def __init__(self, *replies: bytes | None, trickle: float = 0.0) -> None:
        self.replies = replies
        self.trickle = trickle
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self.closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        n = 0
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            reply = self.replies[min(n, len(self.replies) - 1)]
            n += 1
            with conn:
                try:
                    if not conn.recv(65536) or reply is None:
                        time.sleep(5)
                        continue
                    if not self.trickle:
                        conn.sendall(reply)
                        continue
                    for i in range(len(reply)):
                        if self.closed:
                            return
                        conn.sendall(reply[i:i + 1])
                        time.sleep(self.trickle)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.sock.close()


@pytest.mark.parametrize("reply, why", [
    (b"$99999999999\r\n", "bytes where at most"),         # a length past the range asked for
    (b"$12\r\nshort", "closed the connection"),          # a value cut short
    (b"$3\r\nabcXY", "not ended by CRLF"),
    (b"+" + b"x" * (200 << 10), "longer than the protocol allows"),  # a line with no end
    (b":12\r\n", "unexpected reply"),
    (b"-ERR no such thing\r\n", "ERR no such thing"),
    (b"$x\r\n", "malformed bulk length"),
    (b"", "closed the connection"),
], ids=["huge-length", "cut-short", "no-crlf", "endless-line", "integer", "error", "bad-length", "closed"])
def test_a_hostile_reply_is_refused_within_its_bounds(reply, why):
    peer = Peer(reply)
    b = backend(peer.url, timeout=2.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable, match=why):
            b.get_blob("k", 1000)
        assert time.monotonic() - t0 < 2.0 + 1.0
        assert b._fetch_conn is None and b._client is None  # dropped, and no redis-py either
    finally:
        b.close()
        peer.close()


@pytest.mark.parametrize("trickle", [None, 0.05])
def test_a_silent_or_crawling_server_is_given_up_on_at_the_call_bound(trickle):
    # One byte every 50 ms of a 64 KiB value: each read succeeds within the timeout, so only the
    # bound on the whole call (timeout + bytes moved / MIN_RATE) ends it.
    peer = Peer(None if trickle is None else b"$65536\r\n" + bytes(65536), trickle=trickle or 0.0)
    b = backend(peer.url, timeout=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteUnavailable, match="timed out|STUBCACHE_REMOTE_TIMEOUT"):
            b.get_blob("k", 1 << 20)
        assert time.monotonic() - t0 < 0.5 + 5.0  # the whole trickle would take 55 minutes
    finally:
        b.close()
        peer.close()


def test_a_forked_child_opens_its_own_connection(shared_server):
    # An engine forks workers after loading; a worker that fetches must not share its parent's
    # socket (the two would read each other's replies), nor inherit a held lock.
    import os

    shared_server.command("FLUSHALL")
    client = shared_server.client()
    client.set(BLOB + "parent", b"P" * 70000)
    client.set(BLOB + "child", b"C" * 50000)
    b = backend(shared_server.url)
    try:
        assert b.get_blob("parent", 1 << 20) == b"P" * 70000  # the connection is open now
        # Another thread of the parent holds the fetch lock while the process forks.
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with b._fetch_lock:
                held.set()
                release.wait()

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait()
        pid = os.fork()
        if pid == 0:  # the child: its own lock and connection, concurrently with the parent's fetches
            signal.alarm(20)  # a child stuck on the inherited lock fails instead of hanging
            ok = all(b.get_blob("child", 1 << 20) == b"C" * 50000 for _ in range(300))
            os._exit(0 if ok else 1)
        release.set()
        holder.join()
        ok = all(b.get_blob("parent", 1 << 20) == b"P" * 70000 for _ in range(300))
        _, status = os.waitpid(pid, 0)
        assert ok and os.waitstatus_to_exitcode(status) == 0
    finally:
        b.close()


def test_a_password_the_server_does_not_ask_for_is_not_an_error(shared_server):
    # Passwords are often set in clients before the server requires one; redis-py 8 authenticates
    # as the user "default", which a server without a password accepts with any.
    shared_server.command("FLUSHALL")
    shared_server.client().set(BLOB + "k", b"v")
    b = backend(f"redis://:not-needed@127.0.0.1:{shared_server.port}/0")
    try:
        assert b.get_blob("k", 10) == b"v"
    finally:
        b.close()


def test_a_database_in_other_digits_is_refused_and_an_upper_case_scheme_is_read_as_redis(shared_server):
    from stubcache.remote.config import RemoteConfigError

    with pytest.raises(RemoteConfigError, match="must be a number"):
        backend("redis://127.0.0.1:1/\u00b2")  # str.isdigit() says yes; int() and redis-py say no
    assert resp.fetch_target("redis://h/\u00b2") is None
    shared_server.command("FLUSHALL")
    shared_server.client().set(BLOB + "k", b"v")
    b = backend(f"REDIS://127.0.0.1:{shared_server.port}/0")
    try:
        assert b.get_blob("k", 10) == b"v"
        assert b.acquire_lease("k", "me", 5.0) is True  # through redis-py, which knows only redis://
    finally:
        b.close()


def test_bytes_past_a_reply_are_never_read_as_the_next_one():
    # A broken server answers one command with two replies: the second must not become the
    # answer to the next command (the connection is dropped and made afresh).
    peer = Peer(b"$6\r\nreply1\r\n$6\r\nSTALE!\r\n", b"$6\r\nreply2\r\n")
    b = backend(peer.url)
    try:
        assert b.get_blob("a", 100) == b"reply1"
        assert b.get_blob("b", 100) == b"reply2"
    finally:
        b.close()
        peer.close()
