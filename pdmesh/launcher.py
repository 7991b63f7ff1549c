"""The local launcher behind `pdmesh up`: plan the mesh's processes, start them, supervise them,
stop them.

plan_mesh(MeshOptions) → [ServiceSpec] (pure: names, ports, argv) → Mesh.start(): Redis (embedded
unless a URL is given; password-protected) → kvstore → eplb → prefill and decode instances →
gateway, each waited for through the standard gRPC health service (every rank of a DEP instance)
→ Mesh.start_supervisor(): a thread restarts whatever dies (`pdmesh.supervisor`, policy in
`MeshOptions.restart_policy`) → Mesh.stop(): SIGTERM in reverse order, SIGKILL after a grace period.

Secrets never travel in argv (visible in `ps`): every child gets the Redis URL (with its password)
as PDMESH_REDIS_URL and the mesh token as PDMESH_MESH_TOKEN in its environment; the gateway alone
gets the API key as PDMESH_API_KEY. Children run in their own process group (a terminal's Ctrl-C
reaches the launcher only, which stops them in order) and get SIGTERM when the launcher dies, even
by SIGKILL (PR_SET_PDEATHSIG), so no process is orphaned; a DEP instance's ranks likewise die with
their instance process. A DEP instance (`--prefill-dep`/`--decode-dep` N > 1) is one `pdmesh serve
ROLE --dep N` process that runs its N ranks on N consecutive ports (`ServiceSpec.addresses`); it
exits when one rank dies and is restarted as a whole.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh.supervisor import REDIS, GrpcHealthProbe, RedisUnit, ServiceUnit, Supervisor, Unit
from pdmesh_engine.model.configs import check_mesh_model
from pdmesh_service.process import die_with_parent
from pdmesh_service.redis_server import EmbeddedRedis, PortPicker, free_port, free_port_block
from pdmesh_service.supervision import RestartPolicy, RestartRecord, record_restarts_sync

ROLE_ORDER = ("kvstore", "eplb", "prefill", "decode", "gateway")
REDIS_URL_ENV, MESH_TOKEN_ENV, API_KEY_ENV = (
    "PDMESH_REDIS_URL",
    "PDMESH_MESH_TOKEN",
    "PDMESH_API_KEY",
)


DEFAULT_WORKER_NICE = 5


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

    def __post_init__(self) -> None:
        check_mesh_model(self.model_dir)
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
    base = (sys.executable, "-m", "pdmesh.cli.main", "serve")

    def common(role: str, name: str, port: int, metrics: int | None) -> tuple[str, ...]:
        args = (
            *base,
            role,
            "--host",
            host,
            "--port",
            str(port),
            "--deployment",
            options.deployment,
            "--instance-id",
            name,
            "--log-level",
            options.log_level,
        )
        return args + (("--metrics-port", str(metrics)) if metrics is not None else ())

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
        size = options.dep(role)
        for index in range(count):
            name = f"{role}-{index}"
            port, metrics = picker.block(size), picker.block(size)
            argv = common(role, name, port, metrics) + (
                "--model",
                str(options.model_dir),
                "--kvstore",
                kvstore,
                *options.worker_args,
                *_dep_argv(options, size),
            )
            ranks = tuple(f"{host}:{port + r}" for r in range(size)) if size > 1 else ()
            specs.append(ServiceSpec(name, role, f"{host}:{port}", argv, metrics, ranks))
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
    gateway_argv += options.gateway_args
    specs.append(ServiceSpec("gateway-0", "gateway", f"{host}:{options.grpc_port}", gateway_argv))
    return specs


def _dep_argv(options: MeshOptions, size: int) -> tuple[str, ...]:
    if size == 1:
        return ()
    argv = ("--dep", str(size), "--num-redundant-experts", str(options.num_redundant_experts))
    return argv + (("--dp-sync", options.dp_sync) if options.dp_sync else ())


@dataclass
class Mesh:
    """A running mesh. `processes`: the current process of each planned service (replaced on a
    restart); `redis`: the embedded Redis (None with `MeshOptions.redis_url`); `redis_url`: the URL
    with its password; `restarts`: name → restarts so far (the embedded Redis as "redis").

    Use: `start()` (blocks until every service is SERVING), then `start_supervisor()` (a thread:
    restarts whatever dies, see `pdmesh.supervisor`; `wait_gave_up()` tells when it gave up), and
    `stop()` in the end, from any thread. The thread that called `start()` must live until `stop()`
    (a child dies with the thread that spawned it)."""

    options: MeshOptions
    specs: list[ServiceSpec] = field(default_factory=list)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    redis: EmbeddedRedis | None = None
    redis_url: str = field(default="", repr=False)
    mesh_token: str = field(default="", repr=False)
    restarts: dict[str, int] = field(default_factory=dict)
    progress: Callable[[str], None] = field(default=print, repr=False)
    startup_timeout_s: float = 300.0
    supervisor: Supervisor | None = field(default=None, init=False, repr=False)
    _stopped: bool = field(default=False, init=False, repr=False)

    def start(self, timeout_s: float = 300.0, progress=print) -> None:
        """Start everything and wait until each service reports SERVING; stops all on failure."""
        self.options.log_dir.mkdir(parents=True, exist_ok=True)
        self.progress, self.startup_timeout_s = progress, timeout_s
        self.mesh_token = self.options.mesh_token or secrets.token_urlsafe(32)
        try:
            if self.options.redis_url:
                self.redis_url = self.options.redis_url
            else:
                self.redis = EmbeddedRedis(
                    self.options.host, log_path=self.options.log_dir / f"{REDIS}.log"
                ).start()
                self.redis_url = self.redis.url
                progress(f"redis     embedded at {self.redis.display_url}")
            self.specs = plan_mesh(self.options)
            deadline = time.monotonic() + timeout_s
            for group in ROLE_ORDER:
                started = [s for s in self.specs if s.role == group]
                for spec in started:
                    self._spawn(spec)
                for spec in started:
                    for rank, address in enumerate(spec.addresses):
                        self._wait_serving(spec, address, deadline)
                        name = f"{spec.name}-r{rank}" if spec.rank_addresses else spec.name
                        progress(f"{spec.role:<9} {name} ready on {address}")
        except BaseException:
            self.stop()
            raise

    def environment(self, spec: ServiceSpec) -> dict[str, str]:
        """The environment of a service's process: the launcher's, plus the Redis URL and the mesh
        token (the API key for the gateway only)."""
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                REDIS_URL_ENV: self.redis_url,
                MESH_TOKEN_ENV: self.mesh_token,
            }
        )
        if spec.role == "gateway" and self.options.api_key:
            env[API_KEY_ENV] = self.options.api_key
        return env

    def _spawn(self, spec: ServiceSpec) -> None:
        with open(self.options.log_dir / f"{spec.name}.log", "ab") as log:
            self.processes[spec.name] = subprocess.Popen(
                spec.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(spec),
                stdin=subprocess.DEVNULL,
                process_group=0,
                preexec_fn=functools.partial(_child_setup, self._nice(spec)),
            )

    def _nice(self, spec: ServiceSpec) -> int:
        return self.options.worker_nice if spec.role in ("prefill", "decode") else 0

    def _wait_serving(self, spec: ServiceSpec, address: str, deadline: float) -> None:
        """Until `address` (one of the service's ranks) reports SERVING; raises if the process
        exits."""
        probe = GrpcHealthProbe([address])
        try:
            while not probe.poll():
                process = self.processes[spec.name]
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{spec.name} exited with code {process.returncode}; "
                        f"last log lines:\n{self.log_tail(spec.name)}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{spec.name} ({address}) was not ready in time; last log lines:\n"
                        f"{self.log_tail(spec.name)}"
                    )
                time.sleep(0.2)
        finally:
            probe.close()

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.options.log_dir / f"{name}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ----- what a chaos test needs -----
    def names(self, role: str) -> list[str]:
        """The services of a role ("kvstore", "eplb", "prefill", "decode", "gateway", or "redis":
        the embedded one), in start order."""
        if role == REDIS:
            return [REDIS] if self.redis is not None else []
        return [s.name for s in self.specs if s.role == role]

    def pid_of(self, name: str) -> int | None:
        """The pid of a service's current process (a DEP instance: its supervisor process), None
        while it is not running."""
        process = self.redis.process if name == REDIS and self.redis else self.processes.get(name)
        return process.pid if process is not None and process.poll() is None else None

    def failed(self) -> list[str]:
        """Services whose process has exited (and has not been restarted yet)."""
        return [name for name, p in self.processes.items() if p.poll() is not None]

    # ----- supervision -----
    def start_supervisor(self) -> Supervisor:
        """Restart whatever dies from now on, in a thread, under `options.restart_policy`; restart
        lines go to `progress`. After `start()`, once."""
        if self.supervisor is not None:
            raise RuntimeError("the supervisor is already running")
        units: list[Unit] = [RedisUnit(self.redis)] if self.redis is not None else []
        for spec in self.specs:
            units.append(
                ServiceUnit(
                    spec.name,
                    spec.addresses,
                    functools.partial(self.processes.get, spec.name),
                    functools.partial(self._spawn, spec),
                )
            )
        self.supervisor = Supervisor(
            units,
            self.options.restart_policy,
            self.restarts,
            progress=self.progress,
            record=self._record_restarts,
            startup_timeout_s=self.startup_timeout_s,
        )
        self.supervisor.start()
        return self.supervisor

    def wait_gave_up(self, timeout_s: float | None = None) -> str | None:
        """Block until the supervisor gave up on the mesh (the service whose restart budget ran
        out), or for `timeout_s` (None)."""
        if self.supervisor is None:
            raise RuntimeError("no supervisor: call start_supervisor() first")
        return self.supervisor.wait_gave_up(timeout_s)

    def _record_restarts(self, records: dict[str, RestartRecord]) -> None:
        from pdmesh_service.redis_client import connect_sync

        client = connect_sync(self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            record_restarts_sync(client, self.options.deployment, records)
        finally:
            client.close()

    # ----- stop -----
    def stop(self, grace_s: float = 10.0) -> None:
        """Stop supervising, then SIGTERM every service in reverse start order, SIGKILL what is left
        after the grace period, and stop the embedded Redis. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self.supervisor is not None:
            self.supervisor.stop(lambda: self._shutdown(grace_s))
        else:
            self._shutdown(grace_s)

    def _shutdown(self, grace_s: float) -> None:
        for name in reversed(list(self.processes)):
            if self.processes[name].poll() is None:
                self.processes[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def _child_setup(nice: int) -> None:
    """In the child before exec: die with the launcher, then lower its priority by `nice`."""
    die_with_parent(signal.SIGTERM)()
    if nice:
        os.nice(nice)
