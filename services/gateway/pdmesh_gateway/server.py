"""The gateway process: gRPC `pdmesh.gateway.v1.Generate` + the OpenAI REST API, one event loop.

`pdmesh serve gateway` calls `add_arguments`, `config_from_args` and `run_service(..., serve)`.
`serve(config, ready)` sets `ready` once both servers accept requests and runs until cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from prometheus_client import REGISTRY

from pdmesh_engine.model.configs import read_model_config
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.admission import QUEUED_PER_SLOT, QueueLimits
from pdmesh_gateway.auth import ApiKeyMiddleware, Keys, api_key_interceptor
from pdmesh_gateway.autoscale_loop import (
    AutoscaleConfig,
    AutoscaleLoop,
    add_autoscale_arguments,
    autoscale_from_args,
)
from pdmesh_gateway.collector import QueueAwareCollector
from pdmesh_gateway.core import ModelInfo
from pdmesh_gateway.fair_queue import DEFAULT_STARVATION_S, FairQueueConfig
from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.migration import DEFAULT_MAX_MIGRATIONS
from pdmesh_gateway.orchestrator import (
    DEFAULT_LOAD_WINDOW_S,
    DEFAULT_MAX_PREFILL_INFLIGHT,
    DEFAULT_UNROUTABLE_WAIT_S,
    Mode,
    Orchestrator,
)
from pdmesh_gateway.rest import DEFAULT_MAX_BODY_BYTES, create_app, eplb_view, restarts_view
from pdmesh_gateway.router import Router, refresh_forever
from pdmesh_gateway.routing import DecodeBalance, LocalPrefill, PrefillRouting, RoutingConfig
from pdmesh_gateway.servicer import SERVICE_NAME, GenerateServicer, add_to_server
from pdmesh_gateway.tenants import PriorityClass, Tenants
from pdmesh_gateway.upstream import WorkerClient
from pdmesh_service.grpc_server import MeshAuth, start_grpc_server
from pdmesh_service.logging import get_logger
from pdmesh_service.options import (
    CommonConfig,
    add_common_arguments,
    check_metadata_secret,
    common_from_args,
    read_secret_file,
)
from pdmesh_service.registry import (
    TTL_BEATS,
    InstanceInfo,
    Load,
    Registry,
    Role,
    connect,
    heartbeat_forever,
)

log = get_logger(__name__)
API_KEY_ENV = "PDMESH_API_KEY"


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: Path
    common: CommonConfig = field(default_factory=CommonConfig)
    served_model_name: str = ""  # default: the model directory's name
    http_port: int = 8000  # 0 picks a free port
    mode: Mode = Mode.DISAGG
    request_timeout_s: float = 300.0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    refresh_s: float = 0.5  # how often the registry is read for routing
    # per prefill rank, Reserve to end of Prefill
    max_prefill_inflight: int = DEFAULT_MAX_PREFILL_INFLIGHT
    max_body_mb: float = DEFAULT_MAX_BODY_BYTES / (1 << 20)  # REST bodies over this get 413
    max_migrations: int = DEFAULT_MAX_MIGRATIONS  # continuations of a request after rank losses
    unroutable_wait_s: float = DEFAULT_UNROUTABLE_WAIT_S  # wait for a decode rank before 503
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    queue: QueueLimits = field(default_factory=QueueLimits)  # --max-queued, --max-queue-wait-s
    # REST /v1 and /mesh and the gRPC API need `Bearer <api_key>` (auth.py); "": open
    api_key: str = field(default="", repr=False)
    tenants: Tenants | None = None  # --api-keys-file: keys → tenants and their limits
    fair_queue: FairQueueConfig = field(default_factory=FairQueueConfig)
    queue_timeout_s: float | None = None  # the longest wait in the fair queue (then 408)
    autoscale: AutoscaleConfig | None = None  # --autoscale: the desired replicas loop; None: off

    @property
    def keys(self) -> Keys | None:
        """What the front doors accept: None when they are open."""
        if not self.api_key and self.tenants is None:
            return None
        return Keys(self.api_key, self.tenants)

    def __post_init__(self) -> None:
        if self.api_key:
            check_metadata_secret(self.api_key, "the API key")
        try:
            object.__setattr__(self, "mode", Mode(self.mode))  # frozen: normalise a str once, here
        except ValueError:
            raise ValueError(
                f"--mode must be one of {[m.value for m in Mode]}, got {self.mode!r}"
            ) from None
        if not 0 <= self.http_port < 65536:
            raise ValueError(f"--http-port must be in [0, 65535], got {self.http_port}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"--request-timeout-s must be positive, got {self.request_timeout_s}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_prefill_inflight < 1:
            raise ValueError(
                f"--max-prefill-inflight must be >= 1, got {self.max_prefill_inflight}"
            )
        if not self.max_body_mb > 0:
            raise ValueError(f"--max-body-mb must be positive, got {self.max_body_mb}")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if not self.unroutable_wait_s >= 0:
            raise ValueError(f"--unroutable-wait-s must be >= 0, got {self.unroutable_wait_s}")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise ValueError(f"--queue-timeout-s must be positive, got {self.queue_timeout_s}")
        if self.autoscale and self.mode is Mode.AGG and "prefill" in self.autoscale.bounds:
            raise ValueError("--autoscale prefill=...: agg mode has no prefill pool (scale decode)")

    @property
    def load_window_s(self) -> float:
        """The orchestrator's window on the load (what the autoscaler reads)."""
        return self.autoscale.settings.window_s if self.autoscale else DEFAULT_LOAD_WINDOW_S

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    _add_api_key_arguments(p)
    _add_tenant_arguments(p)
    add_autoscale_arguments(p)
    g = p.add_argument_group("gateway")
    g.add_argument(
        "--model", type=Path, required=True, help="Hugging Face model directory (tokenizer, config)"
    )
    g.add_argument(
        "--served-model-name", default="", help="name clients use (default: the directory's name)"
    )
    g.add_argument(
        "--http-port", type=int, default=8000, help="OpenAI REST port (0: any free port)"
    )
    g.add_argument(
        "--mode",
        type=Mode,
        choices=list(Mode),
        default=Mode.DISAGG,
        help="disagg: prefill ranks compute prompts (decode prefills itself when none is up); "
        "agg: decode ranks do everything",
    )
    g.add_argument("--request-timeout-s", type=float, default=300.0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--max-prefill-inflight",
        type=int,
        default=DEFAULT_MAX_PREFILL_INFLIGHT,
        help="requests per prefill rank between their decode Reserve and the end of their Prefill; "
        "the others wait at the gateway (FCFS) without holding decode blocks",
    )
    g.add_argument(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
        help="largest REST request body in MiB (larger: 413)",
    )
    g.add_argument(
        "--max-migrations",
        type=int,
        default=DEFAULT_MAX_MIGRATIONS,
        help="times a request goes on on another decode rank after its rank died mid-stream "
        "(then it ends with an error event)",
    )
    g.add_argument(
        "--prefill-routing",
        type=PrefillRouting,
        choices=list(PrefillRouting),
        default=PrefillRouting.CACHE_AWARE,
        help="cache-aware: the prefill rank with the least work for the prompt (the tokens it "
        "does not hold, from the kvstore's prefix index, plus its queue); least-loaded: fewest "
        "requests in flight (default: %(default)s)",
    )
    g.add_argument(
        "--local-prefill-tokens",
        type=LocalPrefill.parse,
        default=LocalPrefill(),
        metavar="off|auto|N",
        help="conditional disaggregation: a prompt whose uncached part on its decode rank is at "
        "most N tokens is prefilled there, with no hand-off; auto: N = the measured hand-off "
        "overhead x prefill speed; off: every prompt goes to a prefill rank (default: off)",
    )
    g.add_argument(
        "--decode-balance",
        type=DecodeBalance,
        choices=list(DecodeBalance),
        default=DecodeBalance.REQUESTS,
        help="rank decode ranks by requests (running + waiting) or by KV tokens held "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--unroutable-wait-s",
        type=float,
        default=DEFAULT_UNROUTABLE_WAIT_S,
        help="how long a request waits for a decode rank to be up (restarting) before 503",
    )
    g.add_argument(
        "--max-queued",
        type=int,
        default=None,
        help="requests that may wait at the gateway for a prefill slot; more are refused at once "
        f"with 429 and Retry-After (default: {QUEUED_PER_SLOT} x the slots of the ready prefill "
        "ranks, --max-prefill-inflight each)",
    )
    g.add_argument(
        "--max-queue-wait-s",
        type=float,
        default=None,
        help="also refuse (429) a request whose estimated wait for a prefill slot, at the rate "
        "slots were granted lately, is longer than this (default: no such bound)",
    )


def _add_tenant_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tenants and priorities (fair queue)")
    g.add_argument(
        "--api-keys-file",
        metavar="PATH",
        default=None,
        help='JSON (or .yaml) {"keys": {KEY: {"tenant", "max_priority", "max_concurrency", '
        '"max_queued", "max_tokens_per_s", "cache_salt"}}}: each key is a tenant\'s, with its '
        "limits (every field but tenant optional); --api-key may be given too (no limits)",
    )
    g.add_argument(
        "--max-starting",
        type=int,
        default=None,
        help="requests between their grant by the fair queue and their first byte (default: "
        "--max-prefill-inflight per prefill and decode rank)",
    )
    g.add_argument(
        "--queue-timeout-s",
        type=float,
        default=None,
        help="a request waiting longer in the fair queue is answered 408 (default: only the "
        "request timeout)",
    )
    g.add_argument(
        "--class-max-queued",
        type=parse_class_bounds,
        default={},
        metavar="CLASS=N,...",
        help="waiting requests per priority class (system, interactive, default, batch); more "
        "are refused with 429 and Retry-After (default: only --max-queued)",
    )
    g.add_argument(
        "--hold-slots-until-end",
        action="store_true",
        help="a fair-queue slot is held until the request ends, not its first byte: "
        "--max-starting then bounds the requests in the mesh (set it to the decode batch), so "
        "classes and tenants' shares decide who runs, not only who starts",
    )
    g.add_argument(
        "--reserved-slots",
        type=int,
        default=0,
        help="fair-queue slots only system and interactive requests may take",
    )
    g.add_argument(
        "--starvation-s",
        type=float,
        default=DEFAULT_STARVATION_S,
        help="a request of a lower class that waited this long starts before higher ones",
    )


def parse_class_bounds(text: str) -> dict[PriorityClass, int]:
    """`batch=100,default=50` → {BATCH: 100, DEFAULT: 50}."""
    bounds: dict[PriorityClass, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected CLASS=N, got {item!r}")
        try:
            bounds[PriorityClass.parse(name.strip(), "the class")] = int(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return bounds


def _add_api_key_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("front door")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        help=f"clients must send 'Authorization: Bearer KEY' to /v1, /mesh and the gRPC API "
        f"(default: ${API_KEY_ENV}; none: open)",
    )
    g.add_argument(
        "--api-key-file", metavar="PATH", default="", help="read the API key from this file"
    )


def api_key_from(args: argparse.Namespace) -> str:
    """--api-key-file's content (stripped) when given, else --api-key (or its default)."""
    if args.api_key_file:
        return read_secret_file(args.api_key_file, "the API key")
    return str(args.api_key).strip()


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        model_dir=args.model,
        common=common_from_args(args),
        served_model_name=args.served_model_name,
        http_port=args.http_port,
        mode=args.mode,
        request_timeout_s=args.request_timeout_s,
        max_model_len=args.max_model_len,
        max_prefill_inflight=args.max_prefill_inflight,
        max_body_mb=args.max_body_mb,
        max_migrations=args.max_migrations,
        unroutable_wait_s=args.unroutable_wait_s,
        routing=RoutingConfig(args.prefill_routing, args.local_prefill_tokens, args.decode_balance),
        queue=QueueLimits(args.max_queued, args.max_queue_wait_s),
        api_key=api_key_from(args),
        tenants=Tenants.from_file(args.api_keys_file) if args.api_keys_file else None,
        fair_queue=FairQueueConfig(
            capacity=args.max_starting,
            class_max_queued=args.class_max_queued,
            starvation_s=args.starvation_s,
            hold_until_end=args.hold_slots_until_end,
            reserved_slots=args.reserved_slots,
        ),
        queue_timeout_s=args.queue_timeout_s,
        autoscale=autoscale_from_args(args),
    )


def load_model_info(config: GatewayConfig) -> ModelInfo:
    """Name, context length and vocabulary from config.json (no weights, no torch)."""
    mc = read_model_config(config.model_dir)
    max_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    created = int(Path(config.model_dir, "config.json").stat().st_mtime)
    return ModelInfo(
        config.model_name, Path(config.model_dir).resolve().name, max_len, mc.vocab_size, created
    )


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: the process runner owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _start_http(app, host: str, port: int) -> tuple[_UvicornServer, asyncio.Task, int]:
    server = _UvicornServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
    )
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()  # re-raise a bind failure
            raise OSError(f"HTTP server on {host}:{port} exited during startup")
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, task, bound


async def serve(config: GatewayConfig, ready: asyncio.Event | None = None) -> None:
    common = config.common
    tokenizer = Tokenizer.from_dir(config.model_dir)
    model = load_model_info(config)
    redis = connect(common.redis_url)
    registry = Registry(redis, common.deployment)
    router = Router(decode_balance=config.routing.decode_balance)
    # the one set of this process (/metrics exposes REGISTRY)
    metrics = GatewayMetrics(REGISTRY, model)
    orchestrator = Orchestrator(
        router,
        tokenizer,
        metrics=metrics,
        mode=config.mode,
        request_timeout_s=config.request_timeout_s,
        max_prefill_inflight=config.max_prefill_inflight,
        max_migrations=config.max_migrations,
        unroutable_wait_s=config.unroutable_wait_s,
        routing=config.routing,
        queue_limits=config.queue,
        workers=WorkerClient(MeshAuth.from_config(common)),
        tenants=config.tenants,
        fair_queue=config.fair_queue,
        queue_timeout_s=config.queue_timeout_s,
        tenant_registry=REGISTRY,
        load_window_s=config.load_window_s,
    )
    servicer = GenerateServicer(orchestrator, tokenizer, model)
    keys = config.keys
    grpc_server = await start_grpc_server(
        common.host,
        common.port,
        [lambda s: add_to_server(servicer, s)],
        [SERVICE_NAME],
        interceptors=[api_key_interceptor(keys)] if keys is not None else (),
    )
    app = create_app(
        orchestrator,
        tokenizer,
        model,
        REGISTRY,
        eplb=eplb_view(redis, common.deployment),
        restarts=restarts_view(redis, common.deployment),
        max_body_bytes=int(config.max_body_mb * (1 << 20)),
        api_key=config.api_key if config.tenants is None else "",
        probes=grpc_server.probes,
    )
    if config.tenants is not None:  # any tenant's key (or the single one) opens /v1 and /mesh
        app.add_middleware(ApiKeyMiddleware, api_key=keys)
    http, http_task, http_port = await _start_http(app, common.host, config.http_port)
    instance_id = common.instance(Role.GATEWAY, grpc_server.port)

    def report() -> InstanceInfo:
        load = Load(num_running=orchestrator.active, num_waiting=orchestrator.waiting)
        return InstanceInfo(
            instance_id=instance_id,
            role=Role.GATEWAY,
            address=common.address(grpc_server.port),
            model=model.name,
            ready=True,
            stats=load,
            http_port=http_port,
            metrics_port=common.metrics_port or 0,
        )

    tasks = [
        asyncio.ensure_future(refresh_forever(router, registry.instances, config.refresh_s)),
        asyncio.ensure_future(
            heartbeat_forever(registry, report, common.heartbeat_s, TTL_BEATS * common.heartbeat_s)
        ),
        asyncio.ensure_future(metrics.watch_loop_lag()),
    ]
    if config.autoscale is not None:
        scaler = AutoscaleLoop(config.autoscale, orchestrator, router, redis, common.deployment)
        tasks.append(asyncio.ensure_future(scaler.run()))
    try:
        await grpc_server.set_serving(True)
        log.info(
            "gateway ready",
            grpc_port=grpc_server.port,
            http_port=http_port,
            mode=config.mode.value,
            model=model.name,
            max_model_len=model.max_model_len,
        )
        if ready is not None:
            ready.set()
        # what start-up made (modules, tokenizer, channels) lives as long as the process: out of
        # the collector's sight, so its full collections (every token waits on them) stay short;
        # while a long queue waits, they wait too (`QueueAwareCollector`)
        gc.freeze()
        collector = QueueAwareCollector()
        tasks.append(asyncio.ensure_future(collector.run(lambda: orchestrator.waiting)))
        done, _ = await asyncio.wait([http_task, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a component crashed: raise its error
        raise RuntimeError("the gateway's HTTP server stopped on its own")
    finally:
        await _shutdown(http, http_task, tasks, grpc_server, orchestrator)
        with contextlib.suppress(Exception):
            await registry.remove(instance_id)
        await redis.aclose()


async def _shutdown(
    http: _UvicornServer,
    http_task: asyncio.Task,
    tasks: list[asyncio.Task],
    grpc_server,
    orchestrator: Orchestrator,
) -> None:
    started = time.monotonic()
    for t in tasks:
        t.cancel()
    http.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(http_task), timeout=5.0)
    await grpc_server.stop(grace=2.0)
    await orchestrator.close()
    log.info("gateway stopped", seconds=round(time.monotonic() - started, 3))
