"""Options every service takes, read and validated in one place, and the process runner.

A service's `server.py` defines `add_arguments(parser)`, `config_from_args(args)` and
`async serve(config, ready: asyncio.Event | None)`; `pdmesh serve ROLE` and the launcher call them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import start_http_server

from pdmesh_service.logging import configure_logging, get_logger

log = get_logger(__name__)


class ServiceStopped(Exception):
    """A service's `main()` ended on its own (e.g. a DEP rank whose instance stopped): the process
    exits 1."""


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True)
class CommonConfig:
    host: str = "127.0.0.1"
    port: int = 0  # gRPC port; 0 picks a free one
    advertise_host: str = ""  # address others use to reach us (default: host)
    redis_url: str = "redis://127.0.0.1:6379/0"
    deployment: str = "default"  # Redis key namespace
    instance_id: str = ""  # registry id; default: ROLE-PORT
    metrics_port: int | None = None  # Prometheus endpoint; None: no separate endpoint
    heartbeat_s: float = 1.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"--heartbeat-s must be positive, got {self.heartbeat_s}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--redis-url must be a redis:// URL, got {self.redis_url!r}")

    def address(self, port: int) -> str:
        """Where others reach this service: --advertise-host, else --host; bound to every interface
        (0.0.0.0, ::) with no advertise host, this machine's own address (what its hostname resolves
        to)."""
        host = self.advertise_host or self.host
        if host in WILDCARD_HOSTS:
            host = socket.gethostbyname(socket.gethostname())
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def instance(self, role: str, port: int) -> str:
        return self.instance_id or f"{role}-{port}"


ENV_PREFIX = "PDMESH_"  # PDMESH_REDIS_URL=... is the default of --redis-url (a flag still wins)


def add_common_arguments(
    p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """The options every service takes. Each one's default can come from the environment as
    `PDMESH_<OPTION>` (e.g. PDMESH_REDIS_URL, PDMESH_ADVERTISE_HOST): how compose and Kubernetes
    configure a container without rewriting its command. This is the one place services read it."""
    env = os.environ if environ is None else environ

    def default(flag: str, value: Any) -> Any:
        return env.get(ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper(), value)

    g = p.add_argument_group("service (defaults also from PDMESH_<OPTION> environment variables)")
    g.add_argument(
        "--host",
        default=default("--host", "127.0.0.1"),
        help="address to bind (default: loopback only)",
    )
    g.add_argument(
        "--port", type=int, default=default("--port", 0), help="gRPC port (0: any free port)"
    )
    g.add_argument(
        "--advertise-host",
        default=default("--advertise-host", ""),
        help="host others use to reach this service (default: --host)",
    )
    g.add_argument("--redis-url", default=default("--redis-url", "redis://127.0.0.1:6379/0"))
    g.add_argument(
        "--deployment",
        default=default("--deployment", "default"),
        help="namespace of this mesh's Redis keys",
    )
    g.add_argument(
        "--instance-id",
        default=default("--instance-id", ""),
        help="registry id (default: ROLE-PORT)",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        default=default("--metrics-port", None),
        help="serve Prometheus metrics on this port",
    )
    g.add_argument("--heartbeat-s", type=float, default=default("--heartbeat-s", 1.0))
    g.add_argument("--log-level", default=default("--log-level", "INFO"))


def common_from_args(args: argparse.Namespace) -> CommonConfig:
    return CommonConfig(
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        redis_url=args.redis_url,
        deployment=args.deployment,
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
        heartbeat_s=args.heartbeat_s,
        log_level=args.log_level,
    )


def run_service(name: str, common: CommonConfig, main: Callable[[], Awaitable[None]]) -> int:
    """Run a service's `main()` until it returns or SIGINT/SIGTERM arrives (then cancel it cleanly);
    0, or 1 when `main()` raised `ServiceStopped`."""
    configure_logging(name, common.log_level)
    if common.metrics_port is not None:
        start_http_server(common.metrics_port, addr=common.host)

    async def runner() -> int:
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopped", service=name)
        except ServiceStopped as e:
            log.error("stopped", service=name, reason=str(e))
            return 1
        return 0

    return asyncio.run(runner())
