"""The local launcher behind `pdmesh up`: plan the mesh's processes, start them, supervise them,
stop them.

plan_mesh(MeshOptions) → [ServiceSpec] (`pdmesh.mesh_plan`: names, ports, argv) → Mesh.start():
Redis (embedded unless a URL is given; password-protected) → kvstore → eplb → prefill and decode
instances → gateway, each waited for through the standard gRPC health service (every rank of a
DEP instance) → Mesh.start_supervisor(): a thread restarts whatever dies (`pdmesh.supervisor`,
policy in `MeshOptions.restart_policy`) → Mesh.stop(): SIGTERM in reverse order, SIGKILL after a
grace period.

Secrets never travel in argv (visible in `ps`): every child gets the Redis URL (with its password)
as PDMESH_REDIS_URL and the mesh token as PDMESH_MESH_TOKEN in its environment; the gateway alone
gets the API key as PDMESH_API_KEY. Children run in their own process group (a terminal's Ctrl-C
reaches the launcher only, which stops them in order) and get SIGTERM when the launcher dies, even
by SIGKILL (PR_SET_PDEATHSIG), so no process is orphaned; a DEP instance's ranks likewise die with
their instance process. A DEP instance (`--prefill-dep`/`--decode-dep` N > 1) is one `pdmesh serve
ROLE --dep N` process that runs its N ranks on N consecutive ports (`ServiceSpec.addresses`); it
exits when one rank dies and is restarted as a whole.

Autoscaling (`MeshOptions.autoscale`, `pdmesh up --autoscale prefill=1..3,decode=1..2`): the mesh
starts its scaled pools as given (`pdmesh up`: at their lower bounds), the gateway decides, and
`pdmesh.autoscaler` (a hook of the supervisor's thread) starts workers planned as `plan_mesh`
would (`plan_worker`: the next name, free ports) or drains the newest ones. Its workers run with
`--drain-s` (SIGTERM: not ready, finishing what they hold); stopping the mesh sends them SIGINT
after SIGTERM, which ends a drain at once.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdmesh.mesh_plan import (
    DEFAULT_AUTOSCALE_DRAIN_S,
    DEFAULT_WORKER_NICE,
    WORKER_ROLES,
    MeshOptions,
    ServiceSpec,
    plan_mesh,
    plan_worker,
    worker_spec,
)
from pdmesh.supervisor import REDIS, GrpcHealthProbe, RedisUnit, ServiceUnit, Supervisor, Unit
from pdmesh_service.process import die_with_parent
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.supervision import RestartRecord, record_restarts_sync

ROLE_ORDER = ("kvstore", "eplb", "prefill", "decode", "gateway")
REDIS_URL_ENV, MESH_TOKEN_ENV, API_KEY_ENV = (
    "PDMESH_REDIS_URL",
    "PDMESH_MESH_TOKEN",
    "PDMESH_API_KEY",
)


if TYPE_CHECKING:
    from pdmesh.autoscaler import PoolScaler

__all__ = [
    "DEFAULT_AUTOSCALE_DRAIN_S",
    "DEFAULT_WORKER_NICE",
    "Mesh",
    "MeshOptions",
    "ServiceSpec",
    "plan_mesh",
    "plan_worker",
    "worker_spec",
]


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
    # workers the autoscaler is draining: out of `specs`, in `processes` until they exit
    retiring: dict[str, ServiceSpec] = field(default_factory=dict, repr=False)
    scaler: PoolScaler | None = field(default=None, init=False, repr=False)
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

    # ----- autoscaling (`pdmesh.autoscaler`) -----
    def add_worker(self, role: str) -> ServiceSpec:
        """Plan (`plan_worker`) and start one more `role` instance; the caller watches it."""
        spec = plan_worker(self.options, [*self.specs, *self.retiring.values()], role)
        self.specs.append(spec)
        self._spawn(spec)
        return spec

    def retire(self, name: str) -> subprocess.Popen[bytes] | None:
        """Take a worker out of the mesh's services (it is drained): its process, kept in
        `processes` until `forget`."""
        [spec] = [s for s in self.specs if s.name == name]
        self.specs.remove(spec)
        self.retiring[name] = spec
        return self.processes.get(name)

    def forget(self, name: str) -> None:
        """A retired worker exited: no trace of it is left."""
        self.retiring.pop(name, None)
        self.processes.pop(name, None)

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
        units += [self.unit(spec) for spec in self.specs]
        self.supervisor = Supervisor(
            units,
            self.options.restart_policy,
            self.restarts,
            progress=self.progress,
            record=self._record_restarts,
            startup_timeout_s=self.startup_timeout_s,
        )
        if self.options.autoscale is not None:
            from pdmesh.autoscaler import PoolScaler

            self.scaler = PoolScaler(self, self.supervisor)
            self.supervisor.hooks.append(self.scaler.tick)
        self.supervisor.start()
        return self.supervisor

    def unit(self, spec: ServiceSpec) -> ServiceUnit:
        """What the supervisor watches of a planned service."""
        return ServiceUnit(
            spec.name,
            spec.addresses,
            functools.partial(self.processes.get, spec.name),
            functools.partial(self._spawn, spec),
        )

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
        if self.scaler is not None:
            self.scaler.close()
        draining = {
            s.name for s in [*self.specs, *self.retiring.values()] if s.role in WORKER_ROLES
        }
        for name in reversed(list(self.processes)):
            if self.processes[name].poll() is None:
                self.processes[name].send_signal(signal.SIGTERM)
                if self.options.drain_s > 0 and name in draining:
                    self.processes[name].send_signal(signal.SIGINT)  # no drain: stop at once
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
