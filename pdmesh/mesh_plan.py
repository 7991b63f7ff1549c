"""The processes of a local mesh (pure apart from picking free ports): `MeshOptions` (what
`pdmesh up` was asked for, validated here) → `plan_mesh` → [ServiceSpec] (names, ports, argv) in
start order; `plan_worker` plans one more prefill or decode instance beside running ones
(autoscaling) the way `plan_mesh` would have. `pdmesh.launcher` starts what is planned here.

No secret is in an argv: the Redis URL, the mesh token and the API key travel in the children's
environment (`Mesh.environment`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh_engine.model.configs import check_mesh_model
from pdmesh_service.redis_server import PortPicker, free_port, free_port_block
from pdmesh_service.scaling import PoolBounds, format_bounds
from pdmesh_service.supervision import RestartPolicy

DEFAULT_WORKER_NICE = 5
WORKER_ROLES = ("prefill", "decode")
# how long an autoscaled worker drains before it stops (unless `worker_args` give --drain-s); it
# stops sooner once idle (`pdmesh.autoscaler`)
DEFAULT_AUTOSCALE_DRAIN_S = 30.0


@dataclass(frozen=True)
class MeshOptions:
    model_dir: Path
    num_prefill: int = 1
    num_decode: int = 1
    mode: str = "disagg"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    redis_url: str | None = field(default=None, repr=False)  # may carry a password
    deployment: str = "default"
    log_dir: Path = Path("pdmesh-logs")
    worker_args: tuple[str, ...] = ()  # engine options passed to prefill and decode ranks
    log_level: str = "INFO"
    prefill_dep: int = 1  # ranks per prefill instance (DEP)
    decode_dep: int = 1  # ranks per decode instance (DEP)
    num_redundant_experts: int = 0  # extra expert slots per MoE layer of DEP instances
    dp_sync: str | None = None  # DEP instances' per-step all-reduce (None: the default)
    # gateway admission per prefill rank (None: the gateway's default)
    max_prefill_inflight: int | None = None
    eplb_args: tuple[str, ...] = ()  # options of the EPLB controller (`pdmesh serve eplb --help`)
    gateway_args: tuple[str, ...] = ()  # routing options of the gateway (`pdmesh serve gateway`)
    restart_policy: RestartPolicy = RestartPolicy()  # max_restarts=0: a death stops the mesh
    mesh_token: str = field(default="", repr=False)  # shared by the services; "": a random one
    api_key: str = field(default="", repr=False)  # the gateway's API key; "": none
    # the engine ranks' nice value: when they saturate the CPU, the front door and the control
    # plane still run at once (their latency is every request's); 0: the same priority
    worker_nice: int = DEFAULT_WORKER_NICE
    # pool -> its replica bounds: the gateway decides, the launcher starts and drains workers
    # (`pdmesh.autoscaler`); None: fixed counts
    autoscale: Mapping[str, PoolBounds] | None = None

    def __post_init__(self) -> None:
        check_mesh_model(self.model_dir)
        self._check_autoscale()
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"--worker-nice must be in [0, 19], got {self.worker_nice}")
        if self.mode not in ("disagg", "agg"):
            raise ValueError(f"--mode must be disagg or agg, got {self.mode!r}")
        if self.num_decode < 1:
            raise ValueError(f"--decode must be >= 1, got {self.num_decode}")
        if self.num_prefill < 0 or (self.mode == "disagg" and self.num_prefill < 1):
            raise ValueError(
                f"--prefill must be >= 1 in disagg mode (>= 0 in agg), got {self.num_prefill}"
            )
        if self.prefill_dep < 1 or self.decode_dep < 1:
            raise ValueError(
                f"--prefill-dep and --decode-dep must be >= 1, got {self.prefill_dep}, "
                f"{self.decode_dep}"
            )
        if self.num_redundant_experts and max(self.prefill_dep, self.decode_dep) == 1:
            raise ValueError("--num-redundant-experts needs --prefill-dep or --decode-dep > 1")

    def _check_autoscale(self) -> None:
        if self.autoscale is None:
            return
        if max(self.prefill_dep, self.decode_dep) > 1:
            raise ValueError(
                "--autoscale scales single-rank instances only: drop --prefill-dep/--decode-dep "
                "(DEP instances are not autoscaled)"
            )
        if self.mode == "agg" and "prefill" in self.autoscale:
            raise ValueError("--autoscale prefill=...: agg mode has no prefill pool (scale decode)")
        for pool, bounds in self.autoscale.items():
            count = self.num_prefill if pool == "prefill" else self.num_decode
            if bounds.clamp(count) != count:
                raise ValueError(f"{pool}: {count} instances is outside --autoscale {bounds}")

    @property
    def drain_s(self) -> float:
        """The workers' --drain-s: from `worker_args`, else DEFAULT_AUTOSCALE_DRAIN_S when
        autoscaling, else 0 (a SIGTERM stops them at once)."""
        args = self.worker_args
        if "--drain-s" in args[:-1]:
            return float(args[args.index("--drain-s") + 1])
        return DEFAULT_AUTOSCALE_DRAIN_S if self.autoscale is not None else 0.0

    def dep(self, role: str) -> int:
        return {"prefill": self.prefill_dep, "decode": self.decode_dep}.get(role, 1)

    @property
    def num_worker_processes(self) -> int:
        """Engine processes (ranks) of the mesh's prefill and decode instances."""
        prefill = self.num_prefill if self.mode == "disagg" else 0
        return prefill * self.prefill_dep + self.num_decode * self.decode_dep


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # instance id, also the log file's name
    role: str
    grpc_address: str
    argv: tuple[str, ...]
    metrics_port: int | None = None
    # a DEP instance: every rank's gRPC address (rank 0's is grpc_address)
    rank_addresses: tuple[str, ...] = ()

    @property
    def addresses(self) -> tuple[str, ...]:
        """The gRPC endpoints of this service: one per rank."""
        return self.rank_addresses or (self.grpc_address,)


def plan_mesh(
    options: MeshOptions, port_of=free_port, block_of=free_port_block
) -> list[ServiceSpec]:
    """The processes of a mesh, in start order (pure apart from picking free ports; no two picks
    overlap, nor the gateway's fixed ports). No secret is in an argv: the Redis URL comes with the
    environment (`Mesh.environment`)."""
    host = options.host
    picker = PortPicker(host, port_of, block_of, taken=(options.grpc_port, options.http_port))

    def common(role: str, name: str, port: int, metrics: int | None) -> tuple[str, ...]:
        return _common_argv(options, role, name, port, metrics)

    specs: list[ServiceSpec] = []
    kv_port, kv_metrics = picker.block(), picker.block()
    kvstore = f"{host}:{kv_port}"
    specs.append(
        ServiceSpec(
            "kvstore-0",
            "kvstore",
            kvstore,
            common("kvstore", "kvstore-0", kv_port, kv_metrics),
            kv_metrics,
        )
    )
    eplb_port, eplb_metrics = picker.block(), picker.block()
    specs.append(
        ServiceSpec(
            "eplb-0",
            "eplb",
            f"{host}:{eplb_port}",
            common("eplb", "eplb-0", eplb_port, eplb_metrics) + options.eplb_args,
            eplb_metrics,
        )
    )
    num_prefill = options.num_prefill if options.mode == "disagg" else 0
    for role, count in (("prefill", num_prefill), ("decode", options.num_decode)):
        specs += [worker_spec(options, role, f"{role}-{i}", picker, kvstore) for i in range(count)]
    gateway_argv = common("gateway", "gateway-0", options.grpc_port, None) + (
        "--model",
        str(options.model_dir),
        "--http-port",
        str(options.http_port),
        "--mode",
        options.mode,
    )
    if options.max_prefill_inflight is not None:
        gateway_argv += ("--max-prefill-inflight", str(options.max_prefill_inflight))
    if options.autoscale is not None and "--autoscale" not in options.gateway_args:
        gateway_argv += ("--autoscale", format_bounds(options.autoscale))
    gateway_argv += options.gateway_args
    specs.append(ServiceSpec("gateway-0", "gateway", f"{host}:{options.grpc_port}", gateway_argv))
    return specs


def _common_argv(
    options: MeshOptions, role: str, name: str, port: int, metrics: int | None
) -> tuple[str, ...]:
    args = (
        *(sys.executable, "-m", "pdmesh.cli.main", "serve", role),
        *("--host", options.host, "--port", str(port), "--deployment", options.deployment),
        *("--instance-id", name, "--log-level", options.log_level),
    )
    return args + (("--metrics-port", str(metrics)) if metrics is not None else ())


def worker_spec(
    options: MeshOptions, role: str, name: str, picker: PortPicker, kvstore: str
) -> ServiceSpec:
    """A prefill or decode instance named `name` on ports from `picker`."""
    size, host = options.dep(role), options.host
    port, metrics = picker.block(size), picker.block(size)
    drain = ("--drain-s", f"{options.drain_s:g}") if "--drain-s" not in options.worker_args else ()
    argv = _common_argv(options, role, name, port, metrics) + (
        *("--model", str(options.model_dir), "--kvstore", kvstore),
        *options.worker_args,
        *(drain if options.autoscale is not None else ()),
        *_dep_argv(options, size),
    )
    ranks = tuple(f"{host}:{port + r}" for r in range(size)) if size > 1 else ()
    return ServiceSpec(name, role, f"{host}:{port}", argv, metrics, ranks)


def plan_worker(options: MeshOptions, specs: list[ServiceSpec], role: str) -> ServiceSpec:
    """One more `role` instance beside `specs` (the mesh's services, those still stopping
    included), as `plan_mesh` would have planned it: the lowest index no service of the role has,
    ports apart from every one `specs` and the gateway use."""
    names = {s.name for s in specs}
    index = next(i for i in range(len(specs) + 1) if f"{role}-{i}" not in names)
    used = {options.grpc_port, options.http_port}
    for spec in specs:
        used |= {int(a.rsplit(":", 1)[1]) for a in spec.addresses}
        used |= {spec.metrics_port} if spec.metrics_port is not None else set()
    [kvstore] = [s.grpc_address for s in specs if s.role == "kvstore"]
    picker = PortPicker(options.host, taken=used)
    return worker_spec(options, role, f"{role}-{index}", picker, kvstore)


def _dep_argv(options: MeshOptions, size: int) -> tuple[str, ...]:
    if size == 1:
        return ()
    argv = ("--dep", str(size), "--num-redundant-experts", str(options.num_redundant_experts))
    return argv + (("--dp-sync", options.dp_sync) if options.dp_sync else ())
