"""The launcher's supervision loop: a service that dies comes back with the same argv (same instance
id, same ports) after a backoff, as `pdmesh_service.supervision.RestartPolicy` says.

Per service (`Unit`: a planned service, or the embedded Redis), every `tick(now)`:

    running  --exit--> RestartTracker.on_exit → waiting (restart due at now + delay) | gave up
    waiting  --due---> spawn the same argv → starting (probe: gRPC health of every rank, or PING)
    starting --probe answers SERVING--> running (healthy since now)
    starting --exit--> as running's exit;  --no SERVING within the startup timeout--> SIGKILL

A tick never blocks on a service: probes are non-blocking (gRPC futures; Redis: one short PING),
so every process is watched while others start. Once any service spent its restart budget the
supervisor gives up (`gave_up` names it) and restarts nothing more; the caller stops the mesh.
Restart records go to Redis (`pdmesh_service.supervision`) whenever something restarted or came
back; a failed write (Redis down, maybe restarting) is retried at the next tick, and every record is
written each time, since a restarted embedded Redis lost them.

Services come and go while it runs (`pdmesh up --autoscale`, from its `hooks`, which run at the end
of every tick in its thread): `add` watches a new one as starting (its first SERVING is reported as
such), `remove` stops watching one the autoscaler drains, so its exit is not a death.

Threading: `Supervisor.start()` runs the ticks in a thread. A child's PR_SET_PDEATHSIG fires when
the *thread* that spawned it ends, so that thread must outlive what it restarted: `stop(shutdown)`
has the supervisor thread itself run `shutdown` (stop every process) before it ends.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdmesh_service.redis_server import EmbeddedRedis
from pdmesh_service.supervision import RestartPolicy, RestartRecord, RestartTracker

TICK_S = 0.5
REDIS = "redis"  # the embedded Redis's name among the supervised services


class Probe(Protocol):
    def poll(self) -> bool:
        """Whether the service answers SERVING now (never blocks for long)."""
        ...

    def close(self) -> None: ...


class Unit(Protocol):
    """One supervised service."""

    name: str

    def current(self) -> subprocess.Popen[bytes] | None:
        """Its process now."""
        ...

    def spawn(self) -> None:
        """Start it again, the same way as at first."""
        ...

    def probe(self) -> Probe: ...


class GrpcHealthProbe:
    """SERVING on the standard gRPC health service of every address (all ranks of an instance),
    asked through futures: `poll()` looks at the answers so far and asks again where needed."""

    def __init__(self, addresses: Sequence[str], rpc_timeout_s: float = 1.0) -> None:
        _no_grpc_fork_handlers()
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._grpc, self._request = grpc, health_pb2.HealthCheckRequest(service="")
        self._serving = health_pb2.HealthCheckResponse.SERVING
        self._timeout = rpc_timeout_s
        self._channels = {a: grpc.insecure_channel(a) for a in addresses}
        self._stubs = {a: health_pb2_grpc.HealthStub(c) for a, c in self._channels.items()}
        self._pending: dict[str, object] = {}
        self._done: set[str] = set()

    def poll(self) -> bool:
        for address, stub in self._stubs.items():
            if address in self._done:
                continue
            future = self._pending.get(address)
            if future is None:
                self._pending[address] = stub.Check.future(self._request, timeout=self._timeout)
                continue
            if not future.done():  # type: ignore[attr-defined]
                continue
            del self._pending[address]
            try:
                if future.result().status == self._serving:  # type: ignore[attr-defined]
                    self._done.add(address)
            except self._grpc.RpcError:
                pass
        return len(self._done) == len(self._stubs)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def _no_grpc_fork_handlers() -> None:
    """Before this process first uses gRPC: no gRPC fork handlers. The launcher forks (and execs
    at once: they serve no purpose) while its probes' gRPC threads run, and a fork while gRPC shut a
    probe's channel down was seen waiting forever in gRPC's prefork handler. gRPC reads the setting
    once, when it initialises; a value already in the environment is kept."""
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


@dataclass
class ServiceUnit:
    """A planned service: its process now (`current`), how to start it again (`spawn`), and its
    gRPC addresses (every rank of a DEP instance), all SERVING once it is back."""

    name: str
    addresses: Sequence[str]
    current: Callable[[], subprocess.Popen[bytes] | None]
    spawn: Callable[[], None]

    def probe(self) -> Probe:
        return GrpcHealthProbe(self.addresses)


@dataclass
class RedisUnit:
    """The embedded Redis: started again on the same port with the same password (empty)."""

    redis: EmbeddedRedis
    name: str = REDIS

    def current(self) -> subprocess.Popen[bytes] | None:
        return self.redis.process

    def spawn(self) -> None:
        self.redis.spawn()

    def probe(self) -> Probe:
        return _RedisProbe(self.redis)


@dataclass
class _RedisProbe:
    redis: EmbeddedRedis

    def poll(self) -> bool:
        return self.redis.is_ready(timeout_s=0.1)

    def close(self) -> None:
        pass


@dataclass
class _Watch:
    """What the supervisor knows of one service."""

    tracker: RestartTracker
    state: str = "running"  # running | waiting | starting
    due: float = 0.0  # waiting: when to restart; starting: the startup deadline
    healthy_since: float | None = None
    probe: Probe | None = None
    last_exit_code: int = 0
    at_ms: int = 0  # wall clock (ms) when the last exit that led to a restart was seen


@dataclass
class Supervisor:
    """Restarts the `units` (see the module docstring). `restarts` is shared with the caller:
    name → restarts so far."""

    units: list[Unit]
    policy: RestartPolicy
    restarts: dict[str, int]
    progress: Callable[[str], None] = print
    record: Callable[[dict[str, RestartRecord]], None] = lambda records: None
    startup_timeout_s: float = 600.0
    gave_up: str | None = None
    _watches: dict[str, _Watch] = field(default_factory=dict)
    _unrecorded: bool = False
    _given_up: threading.Event = field(default_factory=threading.Event)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _shutdown: Callable[[], None] = lambda: None
    # run at the end of every tick, in the supervisor's thread (what they spawn lives as long)
    hooks: list[Callable[[float], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        now = time.monotonic()
        for unit in self.units:
            self._watches[unit.name] = _Watch(RestartTracker(self.policy), healthy_since=now)

    # ----- the loop -----
    def tick(self, now: float) -> None:
        """Look at every service once: restart what is due, notice exits and recoveries."""
        if self.gave_up is not None:
            return
        for unit in self.units:
            self._tick_unit(unit, self._watches[unit.name], now)
            if self.gave_up is not None:
                return
        if self._unrecorded:
            self._write_records()
        for hook in self.hooks:
            hook(now)

    def add(self, unit: Unit, now: float) -> None:
        """Watch a service started just now (not yet SERVING): as a restart is watched, under the
        same policy and startup timeout."""
        if unit.name in self._watches:
            raise ValueError(f"{unit.name} is supervised already")
        self.units.append(unit)
        watch = _Watch(RestartTracker(self.policy), state="starting")
        watch.due = now + self.startup_timeout_s
        self._watches[unit.name] = watch

    def remove(self, name: str) -> None:
        """Stop watching a service (its exit from now on is not a death, nor restarted)."""
        self.units = [u for u in self.units if u.name != name]
        watch = self._watches.pop(name, None)
        if watch is not None and watch.probe is not None:
            watch.probe.close()

    def is_serving(self, name: str) -> bool:
        """Whether a supervised service runs and has reported SERVING (since its last start)."""
        watch = self._watches.get(name)
        return watch is not None and watch.state == "running"

    def _tick_unit(self, unit: Unit, watch: _Watch, now: float) -> None:
        if watch.state == "waiting":
            if now >= watch.due:
                self._restart(unit, watch, now)
            return
        process = unit.current()
        code = process.poll() if process is not None else -1
        if code is not None:
            self._exited(unit, watch, code, now)
        elif watch.state == "starting":
            watch.probe = watch.probe or unit.probe()
            if watch.probe.poll():
                self._back(unit, watch, now)
            elif now > watch.due and process is not None:
                self.progress(f"pdmesh up: {unit.name} not SERVING in time; killing it")
                process.kill()

    def _restart(self, unit: Unit, watch: _Watch, now: float) -> None:
        watch.state, watch.due, watch.probe = "starting", now + self.startup_timeout_s, None
        try:
            unit.spawn()
        except OSError as e:  # e.g. the log folder went away: a failed run like any other
            self.progress(f"pdmesh up: {unit.name} could not start: {e}")
            self._exited(unit, watch, -1, now)

    def _exited(self, unit: Unit, watch: _Watch, code: int, now: float) -> None:
        if watch.probe is not None:
            watch.probe.close()
            watch.probe = None
        delay = watch.tracker.on_exit(
            now, watch.healthy_since if watch.state == "running" else None
        )
        if delay is None:
            budget = self.policy.max_restarts
            why = (
                f"after {budget} restarts within {self.policy.window_s:g} s"
                if budget
                else "and restarts are off"
            )
            self.progress(
                f"pdmesh up: {unit.name} exited (code {code}) {why} (--max-restarts {budget}): "
                "giving up on the mesh"
            )
            self.gave_up = unit.name
            self._given_up.set()
            return
        self.restarts[unit.name] = watch.tracker.restarts
        watch.state, watch.due, watch.last_exit_code = "waiting", now + delay, code
        watch.at_ms = int(time.time() * 1000)
        watch.healthy_since = None
        self._unrecorded = True
        self.progress(
            f"pdmesh up: {unit.name} exited (code {code}); "
            f"restart {watch.tracker.restarts} in {delay:g} s"
        )

    def _back(self, unit: Unit, watch: _Watch, now: float) -> None:
        if watch.probe is not None:
            watch.probe.close()
        watch.state, watch.healthy_since, watch.probe = "running", now, None
        self._unrecorded = True  # a restarted Redis has lost the records: write them all again
        if watch.tracker.restarts == 0:  # added while running (`add`): its first start
            self.progress(f"pdmesh up: {unit.name} is SERVING")
        else:
            self.progress(
                f"pdmesh up: {unit.name} is back (SERVING, restart {watch.tracker.restarts})"
            )

    def _write_records(self) -> None:
        try:
            self.record(self.records())
            self._unrecorded = False
        except Exception:  # noqa: BLE001 - Redis down or restarting: the next tick retries
            pass

    def records(self) -> dict[str, RestartRecord]:
        """name → its restart record, for the services that restarted."""
        return {
            name: RestartRecord(w.tracker.restarts, w.last_exit_code, w.at_ms)
            for name, w in self._watches.items()
            if w.tracker.restarts
        }

    # ----- the thread -----
    def start(self) -> None:
        """Tick every TICK_S in a thread until `stop`."""
        self._thread = threading.Thread(target=self._run, name="pdmesh-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(TICK_S):
            try:
                self.tick(time.monotonic())
            except Exception as e:  # noqa: BLE001 - the loop must go on watching
                self.progress(f"pdmesh up: supervision error: {type(e).__name__}: {e}")
        self._shutdown()

    def wait_gave_up(self, timeout_s: float | None = None) -> str | None:
        """Block until a service spent its restart budget (its name), or `timeout_s` passed
        (None)."""
        self._given_up.wait(timeout_s)
        return self.gave_up

    def stop(self, shutdown: Callable[[], None]) -> None:
        """End the thread, which runs `shutdown` (stop every process) as its last act."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            shutdown()
            return
        self._shutdown = shutdown
        self._stopping.set()
        thread.join()
