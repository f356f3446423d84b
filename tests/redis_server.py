"""A throwaway ``redis-server`` on a free loopback port, for the remote-tier tests and the
benchmarks: no files written (``--save "" --appendonly no``), stopped (or killed) at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One real ``redis-server`` process. ``url`` is its ``redis://127.0.0.1:PORT/0``."""

    def __init__(self, *extra: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server not found (apt-get install redis-server)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="stubcache-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._clients: list = []
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "no", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.command("PING") == b"+PONG":
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)

    def command(self, *args: str | bytes, timeout: float = 5.0) -> bytes:
        """Send one command with a fresh connection; the first reply line (or bulk payload)."""
        parts = [a.encode() if isinstance(a, str) else a for a in args]
        req = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(req)
            buf = b""
            while b"\r\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
            line, _, rest = buf.partition(b"\r\n")
            if line.startswith(b"$") and line != b"$-1":
                n = int(line[1:])
                while len(rest) < n + 2:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    rest += chunk
                return rest[:n]
            return line

    def client(self):
        import redis

        client = redis.Redis.from_url(self.url, socket_timeout=5)
        self._clients.append(client)  # closed by stop(): a socket left to the GC is a ResourceWarning
        return client

    def info(self, field: str) -> str:
        text = self.command("INFO").decode()
        for line in text.splitlines():
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
        raise KeyError(field)

    def kill(self) -> None:
        """``kill -9`` the server."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def available() -> bool:
    return shutil.which("redis-server") is not None and _client_installed()


def _client_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("redis") is not None


if __name__ == "__main__":  # pragma: no cover - manual use
    with RedisServer() as r:
        print(r.url, os.getpid())
        time.sleep(3600)
