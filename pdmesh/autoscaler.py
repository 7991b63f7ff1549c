"""`pdmesh up --autoscale`: the launcher's side of autoscaling. The gateway decides how many
prefill and decode instances the mesh should run; this starts and drains them.

Chain (every POLL_S, in the supervisor's thread: a hook of its tick, so what it spawns lives as long
as that thread): Redis hash `pdmesh:{deployment}:autoscale` (the gateway's desired counts,
`pdmesh_service.scaling`) → `scale_steps(desired, members, bounds)` (pure) → per step:
- start: `Mesh.add_worker(role)` (the next name, free ports: as `plan_mesh` would have planned
  it), supervised as starting (`Supervisor.add`): restarted like any worker if it dies, reported
  once SERVING;
- stop: the pool's newest worker leaves the supervision first (`Supervisor.remove`: its exit is no
  death, it is never restarted) and the mesh's services (`Mesh.retire`), then gets SIGTERM: it
  drains (live, not ready: the gateway sends it nothing new and lets its calls finish; a request
  still decoding there when the drain ends is continued on another rank by the gateway). Once the
  registry shows it draining and idle in IDLE_BEATS heartbeats taken MIN_DRAIN_S or more after the
  SIGTERM (by then the gateway has seen it draining), it gets SIGINT, which ends the drain; past its
  --drain-s plus KILL_GRACE_S, SIGKILL. A worker not yet SERVING is stopped at once.
Nothing happens while no desired count is published (gateway down: the counts stay as they are).
Each event is a `progress` line and a `ScaleEvent` in `events`.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdmesh.mesh_plan import MeshOptions, ServiceSpec
from pdmesh.supervisor import Supervisor, Unit
from pdmesh_service.instance import InstanceInfo
from pdmesh_service.scaling import DesiredReplicas, PoolBounds, read_desired_sync

POLL_S = 1.0  # how often the desired counts are read
MIN_DRAIN_S = 3.0  # a heartbeat plus a gateway refresh, with a margin: the gateway saw `draining`
IDLE_BEATS = 2  # idle heartbeats (of a draining worker) before it is stopped
KILL_GRACE_S = 10.0  # past --drain-s: SIGKILL


class ScaledMesh(Protocol):
    """What the scaler needs of `pdmesh.launcher.Mesh`."""

    options: MeshOptions
    specs: list[ServiceSpec]
    redis_url: str

    @property
    def progress(self) -> Callable[[str], None]: ...
    def add_worker(self, role: str) -> ServiceSpec: ...
    def retire(self, name: str) -> subprocess.Popen[bytes] | None: ...
    def forget(self, name: str) -> None: ...
    def unit(self, spec: ServiceSpec) -> Unit: ...


@dataclass(frozen=True)
class ScaleEvent:
    """`action`: start (the worker was spawned), serving (it answered SERVING), drain (SIGTERM),
    stopped (it exited); `replicas`: the pool's desired count then (time.monotonic `at`)."""

    at: float
    pool: str
    replicas: int
    action: str
    name: str
    detail: str = ""


def _index(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


def scale_steps(
    desired: Mapping[str, int],
    members: Mapping[str, Sequence[str]],
    bounds: Mapping[str, PoolBounds],
) -> list[tuple[str, str | None]]:
    """The steps that bring each scaled pool to its desired count (clamped to its bounds):
    (pool, None) starts one worker, (pool, name) drains that one (the newest first). A pool with no
    desired count keeps its workers."""
    steps: list[tuple[str, str | None]] = []
    for pool, bound in bounds.items():
        if pool not in desired:
            continue
        names = sorted(members.get(pool, ()), key=_index)
        target = bound.clamp(desired[pool])
        steps += [(pool, None)] * max(target - len(names), 0)
        steps += [(pool, name) for name in reversed(names[target:])]
    return steps


@dataclass
class _Drain:
    pool: str
    process: subprocess.Popen[bytes] | None
    since: float  # time.monotonic of the SIGTERM
    since_ms: int  # wall clock, to compare with heartbeats
    deadline: float  # when the worker stops by itself (its --drain-s)
    last_beat_ms: int = 0
    idle_beats: int = 0
    is_stopping: bool = False  # SIGINT sent


class PoolScaler:
    """Starts and drains workers as the gateway wants (module docstring); `tick(now)` is the
    supervisor's hook, `close()` ends it."""

    def __init__(
        self,
        mesh: ScaledMesh,
        supervisor: Supervisor,
        poll_s: float = POLL_S,
        connect: Callable[[str], Any] | None = None,
    ) -> None:
        if mesh.options.autoscale is None:
            raise ValueError("the mesh has no --autoscale bounds")
        self.mesh, self.supervisor, self.poll_s = mesh, supervisor, poll_s
        self.bounds: Mapping[str, PoolBounds] = mesh.options.autoscale
        self._connect = connect or _connect_sync
        self._client: Any = None
        self._next_poll = 0.0
        self.desired: dict[str, DesiredReplicas] = {}
        self.draining: dict[str, _Drain] = {}
        self.starting: set[str] = set()
        self.events: list[ScaleEvent] = []

    # ----- the hook -----
    def tick(self, now: float) -> None:
        self._watch_starts(now)
        self._watch_drains(now)
        if now < self._next_poll:
            return
        self._next_poll = now + self.poll_s
        desired = self._read_desired()
        if desired is None:
            return
        self.desired = desired
        counts = {pool: d.replicas for pool, d in desired.items()}
        members = {pool: self.members(pool) for pool in self.bounds}
        for pool, name in scale_steps(counts, members, self.bounds):
            if name is None:
                self._start(pool, now)
            else:
                self._drain(pool, name, now)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def members(self, pool: str) -> list[str]:
        """The pool's workers now (starting ones included, draining ones not)."""
        return [s.name for s in self.mesh.specs if s.role == pool]

    # ----- steps -----
    def _start(self, pool: str, now: float) -> None:
        before = len(self.members(pool))
        spec = self.mesh.add_worker(pool)
        self.supervisor.add(self.mesh.unit(spec), now)
        self.starting.add(spec.name)
        self._event(now, pool, "start", spec.name, f"on {spec.grpc_address}")
        self._say_step(pool, before, f"starting {spec.name} on {spec.grpc_address}")

    def _drain(self, pool: str, name: str, now: float) -> None:
        before = len(self.members(pool))
        is_serving = self.supervisor.is_serving(name)
        self.supervisor.remove(name)  # first: its exit is no death
        self.starting.discard(name)
        process = self.mesh.retire(name)
        drain_s = self.mesh.options.drain_s if is_serving else 0.0
        drain = _Drain(pool, process, now, int(time.time() * 1000), now + drain_s)
        self.draining[name] = drain
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            if not is_serving:  # nothing to drain: stop at once
                process.send_signal(signal.SIGINT)
                drain.is_stopping = True
        what = f"up to {drain_s:g} s" if is_serving else "not serving yet: stopped at once"
        self._event(now, pool, "drain", name, what)
        self._say_step(pool, before, f"draining {name} ({what})")

    # ----- watching -----
    def _watch_starts(self, now: float) -> None:
        for name in sorted(self.starting):
            if self.supervisor.is_serving(name):
                self.starting.discard(name)
                pool = next(s.role for s in self.mesh.specs if s.name == name)
                self._event(now, pool, "serving", name)

    def _watch_drains(self, now: float) -> None:
        for name, drain in list(self.draining.items()):
            process = drain.process
            code = process.poll() if process is not None else -1
            if process is None or code is not None:
                del self.draining[name]
                self.mesh.forget(name)
                took = f"after {now - drain.since:.1f} s of draining (exit code {code})"
                self._event(now, drain.pool, "stopped", name, took)
                self.mesh.progress(f"pdmesh up: {name} stopped {took}")
            elif now >= drain.deadline + KILL_GRACE_S:
                process.kill()
            elif drain.is_stopping or now < drain.since + MIN_DRAIN_S:
                continue
            elif self._idle(name, drain):
                process.send_signal(signal.SIGINT)
                drain.is_stopping = True
                self.mesh.progress(f"pdmesh up: {name} drained (idle); stopping it")

    def _idle(self, name: str, drain: _Drain) -> bool:
        """Whether IDLE_BEATS heartbeats since MIN_DRAIN_S after the SIGTERM showed the worker
        draining with nothing running or waiting."""
        info = self._instance(name)
        if info is None or info.updated_ms <= drain.last_beat_ms:
            return False
        drain.last_beat_ms = info.updated_ms
        is_idle = info.draining and not (info.stats.num_running or info.stats.num_waiting)
        if is_idle and info.updated_ms >= drain.since_ms + MIN_DRAIN_S * 1000:
            drain.idle_beats += 1
        elif not is_idle:
            drain.idle_beats = 0
        return drain.idle_beats >= IDLE_BEATS

    # ----- Redis -----
    def _redis(self) -> Any:
        if self._client is None:
            self._client = self._connect(self.mesh.redis_url)
        return self._client

    def _read_desired(self) -> dict[str, DesiredReplicas] | None:
        from redis.exceptions import RedisError

        try:
            return read_desired_sync(self._redis(), self.mesh.options.deployment)
        except (RedisError, OSError):
            return None  # Redis restarting: next poll

    def _instance(self, name: str) -> InstanceInfo | None:
        from redis.exceptions import RedisError

        from pdmesh_service.registry import instance_key

        try:
            raw = self._redis().get(instance_key(self.mesh.options.deployment, name))
        except (RedisError, OSError):
            return None
        return InstanceInfo.from_json(raw) if raw is not None else None

    def _event(self, now: float, pool: str, action: str, name: str, detail: str = "") -> None:
        desired = self.desired.get(pool)
        replicas = desired.replicas if desired is not None else len(self.members(pool))
        self.events.append(ScaleEvent(now, pool, replicas, action, name, detail))

    def _say_step(self, pool: str, before: int, what: str) -> None:
        """The progress line of a scale step: the pool's count, the gateway's reason, the act."""
        after = len(self.members(pool))
        desired = self.desired.get(pool)
        why = f" ({desired.reason})" if desired is not None and desired.reason else ""
        self.mesh.progress(f"pdmesh up: autoscale {pool} {before} -> {after}{why}: {what}")


def _connect_sync(url: str) -> Any:
    from pdmesh_service.redis_client import connect_sync

    return connect_sync(url, socket_timeout=1.0, socket_connect_timeout=1.0)
