"""A remote hit's fetch without redis-py: one ``GETRANGE`` in the Redis protocol (RESP2).

A remote hit sends one command. redis-py's import costs an engine process 50–100 ms (its
package imports ``redis.asyncio``, hence ``asyncio``, and its observability modules), more than
the rest of a remote hit together, so :class:`~.redis_backend.RedisBackend` fetches through this
module and imports redis-py only for what a hit never does (leases, uploads, the admin commands).

It speaks only what that fetch needs, for the URLs it reads exactly as redis-py does (see
:func:`fetch_target`): a TCP connection to each address of the host in turn, ``AUTH`` with the
URL's user name and password (see :func:`handshake`), ``SELECT`` of the URL's database, then
``GETRANGE``. Any other URL (``rediss://`` and its TLS settings, a query string, a user name
without a password) is left to redis-py. A reply is read no further
than the command allows: a line is at most :data:`LINE_CAP` bytes, a value at most the range
asked for, and anything else is a :class:`RespError`.
"""

from __future__ import annotations

import socket

LINE_CAP = 64 << 10  # bytes of a status or error line, or of a bulk length
DEFAULT_PORT = 6379


class RespError(Exception):
    """The server refused a command (an error reply) or broke the protocol."""


class Target:
    """Where a fetch connects, read from a ``redis://`` URL as redis-py reads it."""

    __slots__ = ("host", "port", "db", "username", "password")

    def __init__(self, host: str, port: int, db: int, username: str | None, password: str | None) -> None:
        self.host = host
        self.port = port
        self.db = db
        self.username = username
        self.password = password


def fetch_target(url: str) -> Target | None:
    """The connection a fetch from ``url`` makes, or ``None`` to leave the URL to redis-py. As
    redis-py's ``from_url``: the host and port (``localhost``, 6379 where absent; port 0, which
    redis-py versions read differently and the configuration refuses, is left to it), the path as
    the database, the user name and password percent-decoded. The URL has passed
    :func:`stubcache.remote.config.config_from_env` (its port and database are numbers)."""
    from urllib.parse import unquote, urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme.lower() != "redis" or parts.query or parts.fragment or port == 0:
        return None
    db = parts.path[1:] if parts.path.startswith("/") else parts.path
    if db and not (db.isascii() and db.isdigit()):
        return None
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    if username and not password:
        return None  # redis-py sends AUTH with a missing password: its own error, not ours to copy
    host = unquote(parts.hostname) if parts.hostname else "localhost"
    return Target(host, port or DEFAULT_PORT, int(db or 0), username, password)


def command(*args: bytes) -> bytes:
    """One command as RESP2 sends it: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class Reader:
    """Replies read from a connected socket (anything with ``recv``), buffered."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _more(self) -> None:
        data = self._sock.recv(1 << 16)
        if not data:
            raise RespError("the server closed the connection")
        self._buf += data

    def line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n")
            if end >= 0:
                out = bytes(self._buf[:end])
                del self._buf[:end + 2]
                return out
            if len(self._buf) > LINE_CAP:
                raise RespError("a reply line longer than the protocol allows")
            self._more()

    def exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._more()
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def pending(self) -> bool:
        """Whether bytes beyond the replies read so far have arrived (a broken or hostile server:
        they would be taken for the next command's reply)."""
        import select

        if self._buf:
            return True
        try:
            return bool(select.select([self._sock], [], [], 0)[0])  # data, or the server's close
        except (OSError, ValueError):
            return True

    def status(self) -> bytes:
        """A status reply's text (``OK``); an error reply or anything else raises."""
        line = self.line()
        if line[:1] == b"+":
            return line[1:]
        raise _unexpected(line)

    def bulk(self, cap: int) -> bytes | None:
        """A bulk string of at most ``cap`` bytes (``None`` for the null reply)."""
        line = self.line()
        if line[:1] != b"$":
            raise _unexpected(line)
        try:
            n = int(line[1:])
        except ValueError:
            raise RespError("a malformed bulk length") from None
        if n == -1:
            return None
        if not 0 <= n <= cap:
            raise RespError(f"a value of {n} bytes where at most {cap} were asked for")
        data = self.exact(n + 2)
        if data[n:] != b"\r\n":
            raise RespError("a bulk string not ended by CRLF")
        return data[:n]


def _unexpected(line: bytes) -> RespError:
    if line[:1] == b"-":
        return RespError(line[1:].decode("utf-8", "replace"))
    return RespError(f"an unexpected reply {line[:40]!r}")


def connect(target: Target, timeout: float) -> socket.socket:
    """A TCP connection to ``target``, each of its addresses tried in turn within ``timeout``."""
    sock = socket.create_connection((target.host, target.port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    return sock


# What a server that asks for no password answers to ``AUTH password`` (Redis 6 and later, then
# earlier): the password is not needed, not wrong.
NO_PASSWORD_SET = ("ERR AUTH <password> called without any password configured",
                   "ERR Client sent AUTH, but no password is set")


def handshake(sock: socket.socket, reader: Reader, target: Target) -> None:
    """Authenticate and select the database on a new connection. As redis-py 8 does (its
    ``HELLO … AUTH``), a password alone authenticates as the user ``default``, which a server
    without a password accepts with any; a server older than Redis 6 takes the password alone."""
    if target.password:
        password = target.password.encode("utf-8")
        sock.sendall(command(b"AUTH", (target.username or "default").encode("utf-8"), password))
        try:
            reader.status()
        except RespError as exc:
            if not str(exc).startswith("ERR wrong number of arguments"):
                raise
            sock.sendall(command(b"AUTH", password))
            try:
                reader.status()
            except RespError as again:
                if target.username or str(again) not in NO_PASSWORD_SET:
                    raise
    if target.db:
        sock.sendall(command(b"SELECT", b"%d" % target.db))
        reader.status()


def getrange(sock: socket.socket, reader: Reader, key: str, start: int, end: int) -> bytes:
    """``GETRANGE key start end`` (``end`` inclusive, ``start`` ≤ ``end``): the bytes, ``b""``
    for a key that does not exist."""
    sock.sendall(command(b"GETRANGE", key.encode("utf-8"), b"%d" % start, b"%d" % end))
    value = reader.bulk(end - start + 1)
    return value if value is not None else b""
