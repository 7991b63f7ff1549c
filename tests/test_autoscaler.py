"""The launcher's side of autoscaling (`pdmesh.autoscaler`, `pdmesh.mesh_plan`, `pdmesh up
--autoscale`): the steps from desired counts, the plan of one more worker, the options it refuses,
and the scaler's state machine over real processes, a real Redis and the real supervisor: it starts
a worker when the gateway asks, drains the newest when it asks for fewer (SIGTERM, then SIGINT
once the registry shows it draining and idle), and the supervisor never restarts what was
drained."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from pdmesh.autoscaler import MIN_DRAIN_S, PoolScaler, scale_steps
from pdmesh.cli.main import main
from pdmesh.mesh_plan import MeshOptions, ServiceSpec, plan_mesh, plan_worker
from pdmesh.supervisor import Supervisor
from pdmesh_service.instance import InstanceInfo, Load, Role
from pdmesh_service.redis_client import connect_sync
from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.registry import instance_key
from pdmesh_service.scaling import DesiredReplicas, PoolBounds, autoscale_key, parse_bounds
from pdmesh_service.supervision import RestartPolicy

BOUNDS = {"prefill": PoolBounds(1, 3), "decode": PoolBounds(1, 2)}


@pytest.mark.parametrize(
    ("desired", "members", "steps"),
    [
        ({"prefill": 2}, {"prefill": ["prefill-0"]}, [("prefill", None)]),
        (
            {"prefill": 1},
            {"prefill": ["prefill-0", "prefill-2", "prefill-10"]},
            [
                ("prefill", "prefill-10"),
                ("prefill", "prefill-2"),
            ],
        ),
        ({"prefill": 9}, {"prefill": ["prefill-0"]}, [("prefill", None)] * 2),  # max 3
        ({"decode": 0}, {"decode": ["decode-0", "decode-1"]}, [("decode", "decode-1")]),  # min 1
        ({}, {"prefill": ["prefill-0", "prefill-1"]}, []),  # nothing published: keep
        ({"prefill": 2}, {"prefill": ["prefill-0", "prefill-1"]}, []),
    ],
)
def test_scale_steps(desired, members, steps) -> None:
    assert scale_steps(desired, members, BOUNDS) == steps


def _options(**kw) -> MeshOptions:
    return MeshOptions(Path("m"), autoscale=BOUNDS, **kw)


def test_plan_worker_takes_the_next_name_and_ports_nobody_uses() -> None:
    options = _options(worker_args=("--num-blocks", "64"))
    specs = plan_mesh(options)
    used = {int(a.rsplit(":", 1)[1]) for s in specs for a in s.addresses}
    used |= {s.metrics_port for s in specs if s.metrics_port} | {options.grpc_port}
    spec = plan_worker(options, specs, "prefill")
    assert spec.name == "prefill-1" and spec.role == "prefill"
    port = int(spec.grpc_address.rsplit(":", 1)[1])
    assert port not in used and spec.metrics_port not in used | {port}
    [first] = [s for s in specs if s.name == "prefill-0"]
    # the argv of prefill-0 but for its name and ports
    differs = [(a, b) for a, b in zip(first.argv, spec.argv, strict=True) if a != b]
    assert {a for a, _ in differs} == {
        "prefill-0",
        first.grpc_address.rsplit(":", 1)[1],
        str(first.metrics_port),
    }
    assert "--drain-s" in spec.argv and spec.argv[spec.argv.index("--drain-s") + 1] == "30"
    # a name still draining is not reused; the gap below it is
    later = plan_worker(options, [*specs, replace(spec, name="prefill-2")], "prefill")
    assert later.name == "prefill-1"
    gateway = next(s for s in specs if s.role == "gateway")
    assert gateway.argv[gateway.argv.index("--autoscale") + 1] == "prefill=1..3,decode=1..2"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prefill_dep": 2}, "DEP instances are not autoscaled"),
        ({"mode": "agg", "num_prefill": 0}, "agg mode has no prefill pool"),
        ({"num_prefill": 4}, "outside --autoscale"),
    ],
)
def test_mesh_options_refuse(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        _options(**kw)


def test_drain_s_comes_from_the_worker_args_or_the_default() -> None:
    assert _options().drain_s == 30.0
    assert _options(worker_args=("--drain-s", "4")).drain_s == 4.0
    assert MeshOptions(Path("m")).drain_s == 0.0
    assert (
        "--drain-s"
        not in next(s for s in plan_mesh(MeshOptions(Path("m"))) if s.role == "decode").argv
    )


def test_up_refuses_autoscale_with_dep_instances(capsys, tmp_path) -> None:
    code = main(
        [
            "up",
            *("--autoscale", "prefill=1..2", "--prefill-dep", "2"),
            *("--log-dir", str(tmp_path)),
        ]
    )
    assert code == 2
    assert "DEP instances are not autoscaled" in capsys.readouterr().err
    assert main(["up", "--autoscale", "prefill=1..x", "--log-dir", str(tmp_path)]) == 2
    assert "POOL=MIN..MAX" in capsys.readouterr().err


# ----- the scaler over real processes and a real Redis -----

# a worker: SIGTERM starts its drain (ignored here: it goes on), SIGINT stops it; it creates the
# file its argument names once its handlers are in place
WORKER = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: None)\n"
    "signal.signal(signal.SIGINT, lambda *a: sys.exit(0))\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "while True: time.sleep(0.02)\n"
)


@dataclass
class Ready:
    def poll(self) -> bool:
        return True

    def close(self) -> None:
        pass


@dataclass
class WorkerUnit:
    name: str
    mesh: FakeMesh

    def current(self) -> subprocess.Popen | None:
        return self.mesh.processes.get(self.name)

    def spawn(self) -> None:
        self.mesh.spawns.append(self.name)
        ready = self.mesh.folder / f"{self.name}-{len(self.mesh.spawns)}"
        self.mesh.processes[self.name] = subprocess.Popen([sys.executable, "-c", WORKER, ready])
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def probe(self) -> Ready:
        return Ready()


@dataclass
class FakeMesh:
    """`ScaledMesh` over `WORKER` processes (the planning is `plan_worker`'s)."""

    options: MeshOptions
    redis_url: str
    folder: Path
    specs: list[ServiceSpec] = field(default_factory=list)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    retiring: dict[str, ServiceSpec] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    spawns: list[str] = field(default_factory=list)

    @property
    def progress(self):
        return self.lines.append

    def add_worker(self, role: str) -> ServiceSpec:
        spec = plan_worker(self.options, [*self.specs, *self.retiring.values()], role)
        self.specs.append(spec)
        WorkerUnit(spec.name, self).spawn()
        return spec

    def retire(self, name: str) -> subprocess.Popen | None:
        [spec] = [s for s in self.specs if s.name == name]
        self.specs.remove(spec)
        self.retiring[name] = spec
        return self.processes.get(name)

    def forget(self, name: str) -> None:
        self.retiring.pop(name, None)
        self.processes.pop(name, None)

    def unit(self, spec: ServiceSpec) -> WorkerUnit:
        return WorkerUnit(spec.name, self)


def _beat(client, deployment: str, name: str, at_ms: int, *, running: int = 0) -> None:
    """The registry entry a draining worker's heartbeat writes."""
    info = InstanceInfo(
        name, Role.PREFILL, "x:1", ready=True, draining=True, stats=Load(num_running=running)
    )
    client.set(instance_key(deployment, name), replace(info, updated_ms=at_ms).to_json())


def _desired(client, deployment: str, **counts: int) -> None:
    key = autoscale_key(deployment)
    client.delete(key)
    client.hset(key, mapping={p: DesiredReplicas(n, "test").to_json() for p, n in counts.items()})


def test_the_scaler_starts_then_drains_and_the_drained_worker_is_not_restarted(tmp_path) -> None:
    with EmbeddedRedis() as redis:
        options = MeshOptions(Path("m"), autoscale={"prefill": PoolBounds(1, 2)}, deployment="as")
        mesh = FakeMesh(options, redis.url, tmp_path, specs=plan_mesh(options))
        first = next(s.name for s in mesh.specs if s.role == "prefill")
        WorkerUnit(first, mesh).spawn()
        supervisor = Supervisor(
            [mesh.unit(s) for s in mesh.specs if s.role == "prefill"], RestartPolicy(), {}
        )
        scaler = PoolScaler(mesh, supervisor, poll_s=0.0)
        client = connect_sync(redis.url)
        try:
            now = 100.0
            scaler.tick(now)  # nothing published yet: nothing happens
            assert scaler.members("prefill") == ["prefill-0"] and not scaler.events
            _desired(client, "as", prefill=5)  # clamped to 2
            scaler.tick(now)
            supervisor.tick(now + 0.5)  # probe: SERVING
            scaler.tick(now + 0.5)
            assert [(e.action, e.name) for e in scaler.events] == [
                ("start", "prefill-1"),
                ("serving", "prefill-1"),
            ] and scaler.members("prefill") == ["prefill-0", "prefill-1"]
            _desired(client, "as", prefill=1)
            scaler.tick(now + 1)
            drained = mesh.processes["prefill-1"]
            assert scaler.events[-1].action == "drain" and scaler.members("prefill") == [
                "prefill-0"
            ]
            time.sleep(0.3)
            assert drained.poll() is None  # draining: SIGTERM does not stop it
            supervisor.tick(now + 1.5)
            since_ms = int(time.time() * 1000)
            # busy, then idle beats but too early (before MIN_DRAIN_S), then two idle ones
            _beat(client, "as", "prefill-1", since_ms + 4000, running=1)
            scaler.tick(now + 1 + MIN_DRAIN_S)
            _beat(client, "as", "prefill-1", since_ms + 5000)
            scaler.tick(now + 1.5 + MIN_DRAIN_S)
            assert drained.poll() is None  # one idle beat is not enough
            _beat(client, "as", "prefill-1", since_ms + 6000)
            scaler.tick(now + 2 + MIN_DRAIN_S)
            assert drained.wait(10) == 0  # SIGINT: stopped
            scaler.tick(now + 2.5 + MIN_DRAIN_S)
            supervisor.tick(now + 10)
            assert scaler.events[-1].action == "stopped" and "prefill-1" not in mesh.processes
            assert mesh.spawns == ["prefill-0", "prefill-1"] and supervisor.restarts == {}
            assert mesh.lines == [
                "pdmesh up: autoscale prefill 1 -> 2 (test): starting prefill-1 on "
                + scaler.events[0].detail.removeprefix("on "),
                "pdmesh up: autoscale prefill 2 -> 1 (test): draining prefill-1 (up to 30 s)",
                "pdmesh up: prefill-1 drained (idle); stopping it",
                mesh.lines[-1],
            ]
            assert mesh.lines[-1].startswith("pdmesh up: prefill-1 stopped after ")
        finally:
            client.close()
            scaler.close()
            for process in mesh.processes.values():
                process.send_signal(signal.SIGKILL)
                process.wait()


def test_parse_bounds_round_trips_through_the_gateway_flag() -> None:
    from pdmesh_service.scaling import format_bounds

    assert parse_bounds(format_bounds(BOUNDS)) == BOUNDS
