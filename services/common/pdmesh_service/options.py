"""Options every service takes, read and validated in one place, and the process runner.

A service's `server.py` defines `add_arguments(parser)`, `config_from_args(args)` and
`async serve(config, ready: asyncio.Event | None)`; `pdmesh serve ROLE` and the launcher call them.

Secrets: the mesh token comes from `--mesh-token-file` or the environment (PDMESH_MESH_TOKEN), never
from a flag's value (argv is visible to every user of the host); `CommonConfig`'s repr leaves it out
and shows the Redis URL through `redacted_url`, so a logged config leaks neither.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pdmesh_service.logging import configure_logging, get_logger
from pdmesh_service.probes import Probes, set_process_probes, start_probe_http_server
from pdmesh_service.redis_client import check_redis_url

log = get_logger(__name__)


class ServiceStopped(Exception):
    """A service's `main()` ended on its own (e.g. a DEP rank whose instance stopped): the process
    exits 1."""


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
MASK = "***"
# Query parameters of a URL that carry credentials (redis-py takes `password` and `username` there;
# a Sentinel URL also `sentinel_password` and `sentinel_username`).
SECRET_QUERY_KEYS = frozenset({"password", "username", "sentinel_password", "sentinel_username"})
MESH_TOKEN_ENV = "PDMESH_MESH_TOKEN"


def redacted_url(url: str) -> str:
    """`url` fit to print: its user and password become `***` (redis://***@host:port/0), as do
    credentials in its query; a URL that does not parse is masked whole."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rpartition('@')[2]}"
    query = parts.query
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(key.lower() in SECRET_QUERY_KEYS for key, _ in pairs):
        masked = [(k, MASK if k.lower() in SECRET_QUERY_KEYS else v) for k, v in pairs]
        query = urlencode(masked, safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def read_secret_file(path: str, what: str) -> str:
    """The secret in file `path`, stripped; ValueError when it cannot be read or is empty (the
    message names the file, never its content)."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} from {path}: {type(e).__name__}") from None
    if not secret:
        raise ValueError(f"{what} file {path} is empty")
    return secret


def check_metadata_secret(secret: str, what: str) -> str:
    """`secret`, when it can travel as an ASCII gRPC metadata or HTTP header value (printable ASCII,
    no spaces); else ValueError."""
    if not all("!" <= ch <= "~" for ch in secret):
        raise ValueError(f"{what} must be printable ASCII without spaces")
    return secret


@dataclass(frozen=True)
class CommonConfig:
    host: str = "127.0.0.1"
    port: int = 0  # gRPC port; 0 picks a free one
    advertise_host: str = ""  # address others use to reach us (default: host)
    redis_url: str = "redis://127.0.0.1:6379/0"
    deployment: str = "default"  # Redis key namespace
    instance_id: str = ""  # registry id; default: ROLE-PORT
    # Prometheus endpoint, with /health/live and /health/ready; None: no separate endpoint
    metrics_port: int | None = None
    heartbeat_s: float = 1.0
    log_level: str = "INFO"
    # Internal RPCs must carry it (gRPC metadata x-pdmesh-mesh-token); "": none asked, none sent.
    mesh_token: str = field(default="", repr=False)
    # PEM files; all three: mTLS on this service's gRPC server and on its channels to the mesh.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # after SIGTERM, serve this long not ready (draining) before stopping; 0: stop at once
    drain_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"--heartbeat-s must be positive, got {self.heartbeat_s}")
        if self.drain_s < 0:
            raise ValueError(f"--drain-s must be >= 0, got {self.drain_s}")
        try:
            check_redis_url(self.redis_url)
        except ValueError as e:
            raise ValueError(f"{e}, got {redacted_url(self.redis_url)!r}") from None
        if self.mesh_token:
            check_metadata_secret(self.mesh_token, "the mesh token")
        self._check_tls()

    def _check_tls(self) -> None:
        files = {"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--tls-ca": self.tls_ca}
        given = [flag for flag, path in files.items() if path]
        if given and len(given) != len(files):
            missing = sorted(set(files) - set(given))
            raise ValueError(f"mTLS takes --tls-cert, --tls-key and --tls-ca together: {missing}")
        for flag, path in files.items():
            if path and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file {path}")

    @property
    def has_tls(self) -> bool:
        return bool(self.tls_cert)

    def __repr__(self) -> str:
        """The generated repr, less the mesh token and the Redis URL's credentials."""
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["redis_url"] = redacted_url(self.redis_url)
        return f"CommonConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

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
    g.add_argument(
        "--redis-url",
        default=default("--redis-url", "redis://127.0.0.1:6379/0"),
        help="the coordination Redis: redis://[:password@]host:port/db, or Redis Sentinel as "
        "redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db]"
        "[?sentinel_password=...]",
    )
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
        help="serve Prometheus metrics, /health/live and /health/ready on this port",
    )
    g.add_argument("--heartbeat-s", type=float, default=default("--heartbeat-s", 1.0))
    g.add_argument(
        "--drain-s",
        type=float,
        default=default("--drain-s", 0.0),
        help="after SIGTERM, keep serving this long while not ready (draining); a second signal "
        "stops at once (default: 0, stop at once)",
    )
    g.add_argument("--log-level", default=default("--log-level", "INFO"))
    _add_security_arguments(p, default)


def _add_security_arguments(p: argparse.ArgumentParser, default: Callable[[str, Any], Any]) -> None:
    g = p.add_argument_group(
        "mesh security (the mesh token itself: a file, or the PDMESH_MESH_TOKEN environment "
        "variable; never a flag's value)"
    )
    g.add_argument(
        "--mesh-token-file",
        metavar="PATH",
        default=default("--mesh-token-file", ""),
        help="file holding the token internal RPCs must carry (wins over PDMESH_MESH_TOKEN)",
    )
    for flag, what in (
        ("--tls-cert", "this service's certificate"),
        ("--tls-key", "its private key"),
        ("--tls-ca", "the CA that signs the mesh's certificates"),
    ):
        g.add_argument(
            flag,
            metavar="PEM",
            default=default(flag, ""),
            help=f"mTLS: {what} (give all three)",
        )


def mesh_token_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> str:
    """The mesh token: the content of --mesh-token-file, else $PDMESH_MESH_TOKEN (stripped), else
    "" (no token)."""
    if args.mesh_token_file:
        return read_secret_file(args.mesh_token_file, "the mesh token")
    env = os.environ if environ is None else environ
    return env.get(MESH_TOKEN_ENV, "").strip()


def common_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> CommonConfig:
    """The validated options (ValueError); the mesh token is read here (`mesh_token_from`)."""
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
        mesh_token=mesh_token_from(args, environ),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        drain_s=args.drain_s,
    )


def run_service(name: str, common: CommonConfig, main: Callable[[], Awaitable[None]]) -> int:
    """Run a service's `main()` until it returns or SIGINT/SIGTERM arrives (then cancel it cleanly);
    0, or 1 when `main()` raised `ServiceStopped`.

    The process's probes (`pdmesh_service.probes`) are made here: served on the metrics port
    (/health/live, /health/ready, Prometheus everywhere else) and, through `start_grpc_server`, as
    gRPC health `liveness` and `readiness`. The first signal makes the process draining (live, not
    ready) and cancels `main()` after `common.drain_s`; a second one cancels it at once."""
    configure_logging(name, common.log_level)
    log.info(
        "starting",
        service=name,
        redis=redacted_url(common.redis_url),
        deployment=common.deployment,
        mesh_token=bool(common.mesh_token),
        tls=common.has_tls,
    )
    probes = Probes(common.redis_url, common.heartbeat_s)
    set_process_probes(probes)
    if common.metrics_port is not None:
        start_probe_http_server(common.metrics_port, common.host, probes)

    async def runner() -> int:
        updater = probes.start()
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            again, probes.draining = probes.draining, True
            if again or common.drain_s <= 0:
                task.cancel()
                return
            log.info("draining", service=name, seconds=common.drain_s)
            loop.call_later(common.drain_s, task.cancel)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopped", service=name)
        except ServiceStopped as e:
            log.error("stopped", service=name, reason=str(e))
            return 1
        finally:
            if updater is not None:
                updater.cancel()
                await asyncio.gather(updater, return_exceptions=True)
        return 0

    return asyncio.run(runner())
