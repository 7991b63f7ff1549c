"""Liveness and readiness of a service process: one pure decision over what the process knows of
itself (`liveness`, `readiness` over `ProbeInputs`), served three ways:

- gRPC: the standard health service answers for the service names `liveness` and `readiness`
  (SERVING / NOT_SERVING, kept up to date by `Probes.run` every `TICK_S`; Check and Watch both);
- HTTP on a service's metrics port (`probe_wsgi_app`, served by `options.run_service`):
  `GET /health/live` and `GET /health/ready` answer 200 `{"status": "ok"}` or 503
  `{"status": "unavailable", "reason": ...}`; every other path is the Prometheus exposition;
- the gateway's REST port: the same two routes (`pdmesh_gateway.rest`), its readiness adding
  "a decode rank is routable".

Live: the process can still serve, now or later: its event loop turns (it ticked within
`LOOP_STALL_S`) and nothing fatal happened (a worker's engine thread ended: a device fault). A
process that is not live should be restarted.
Ready: it should get traffic now: live, started (model loaded, servers up:
`GrpcServer.set_serving`), not draining (from the first SIGTERM on: `options.run_service`, and while
its gRPC server stops), the registry answered within `registry_bound_s` (Redis PING, every
heartbeat), for a decode rank KV blocks free above a small reserve (`kv_reserve`), and no other
problem reported (`set_problem`, `add_check`).

`/health` of the gateway keeps its meaning ("ok" / "degraded" with 200, "unavailable" 503).

One `Probes` per process: `options.run_service` makes it (`process_probes` returns it to whoever
asks within that run: `start_grpc_server`, the gateway's REST app); code that starts servers without
`run_service` (tests) gets one per asyncio context on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from grpc_health.v1 import health_pb2

from pdmesh_service.logging import get_logger

log = get_logger(__name__)
LIVENESS, READINESS = "liveness", "readiness"  # gRPC health service names
LIVE_PATH, READY_PATH = "/health/live", "/health/ready"
LOOP_STALL_S = 60.0  # an event loop silent this long: the process is not live
TICK_S = 0.25  # how often the loop ticks and the gRPC statuses are brought up to date
KV_RESERVE_FRACTION = 0.02  # a decode rank with fewer free KV blocks than this (min 1) is full
REGISTRY_BOUND_BEATS = 5  # Redis silent this many heartbeats: the registry is unreachable


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""

    def body(self) -> dict[str, str]:
        """The JSON of an HTTP probe's answer."""
        return {"status": "ok"} if self.ok else {"status": "unavailable", "reason": self.reason}

    @property
    def http_status(self) -> int:
        return 200 if self.ok else 503


@dataclass(frozen=True)
class ProbeInputs:
    """What a process knows of itself when asked (pure data)."""

    loop_silent_s: float = 0.0  # since the event loop last ticked
    fatal: tuple[str, ...] = ()  # why it cannot serve again (not live)
    started: bool = False  # model loaded, servers up
    draining: bool = False
    registry_silent_s: float | None = None  # since Redis last answered; None: never
    registry_bound_s: float | None = None  # None: the registry is not checked
    kv_free_blocks: int | None = None  # a decode rank's free KV blocks (None: not a decode rank)
    kv_total_blocks: int = 0
    problems: tuple[str, ...] = ()  # other reasons not to take traffic now


def kv_reserve(total_blocks: int) -> int:
    """Free blocks below which a decode rank counts as full: 2% of its pool, at least one."""
    return max(1, math.ceil(total_blocks * KV_RESERVE_FRACTION))


def liveness(p: ProbeInputs) -> Verdict:
    if p.fatal:
        return Verdict(False, "; ".join(p.fatal))
    if p.loop_silent_s > LOOP_STALL_S:
        return Verdict(False, f"the event loop has not turned for {p.loop_silent_s:.0f}s")
    return Verdict(True)


def readiness(p: ProbeInputs) -> Verdict:
    live = liveness(p)
    if not live.ok:
        return Verdict(False, f"not live: {live.reason}")
    if p.draining:
        return Verdict(False, "draining")
    if not p.started:
        return Verdict(False, "starting")
    if p.registry_bound_s is not None and (
        p.registry_silent_s is None or p.registry_silent_s > p.registry_bound_s
    ):
        since = "" if p.registry_silent_s is None else f" for {p.registry_silent_s:.1f}s"
        return Verdict(False, f"the registry (Redis) has not answered{since}")
    if p.kv_free_blocks is not None:
        reserve = kv_reserve(p.kv_total_blocks)
        if p.kv_free_blocks < reserve:
            return Verdict(
                False,
                f"KV cache full: {p.kv_free_blocks} of {p.kv_total_blocks} blocks free "
                f"(reserve {reserve})",
            )
    if p.problems:
        return Verdict(False, "; ".join(p.problems))
    return Verdict(True)


Check = Callable[[], str | None]  # a reason, or None when all is well


@dataclass
class Probes:
    """A process's probe state. Written on its event loop (or plain attribute writes from anywhere);
    `verdicts()` may be called from any thread (the metrics HTTP server's)."""

    redis_url: str = field(default="", repr=False)  # "": the registry is not checked
    heartbeat_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    started: bool = False
    draining: bool = False
    kv: tuple[int, int] | None = None  # a decode rank's (free, total) KV blocks
    registry_ok_at: float | None = None
    loop_tick: float = 0.0
    _problems: dict[str, str] = field(default_factory=dict)
    _fatal_checks: list[Check] = field(default_factory=list)
    _checks: list[Check] = field(default_factory=list)
    _servicers: list[Any] = field(default_factory=list)  # grpc_health aio HealthServicers
    _pushed: dict[int, tuple[bool, bool]] = field(default_factory=dict)
    _cached: tuple[Verdict, Verdict] = (Verdict(True), Verdict(False, "starting"))
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.loop_tick = self.clock()

    # ----- what the process reports -----
    def set_problem(self, source: str, reason: str | None) -> None:
        """A reason not to be ready, from `source` (None clears it)."""
        if reason is None:
            self._problems.pop(source, None)
        else:
            self._problems[source] = reason

    def add_fatal_check(self, check: Check) -> None:
        """`check()` (on the event loop, every tick) names what makes the process not live."""
        self._fatal_checks.append(check)

    def add_check(self, check: Check) -> None:
        """`check()` (on the event loop, every tick) names a reason not to be ready."""
        self._checks.append(check)

    # ----- the decision -----
    def inputs(self) -> ProbeInputs:
        """On the event loop: runs the checks."""
        now = self.clock()
        free, total = self.kv if self.kv is not None else (None, 0)
        return ProbeInputs(
            loop_silent_s=max(0.0, now - self.loop_tick),
            fatal=tuple(r for c in self._fatal_checks if (r := c())),
            started=self.started,
            draining=self.draining,
            registry_silent_s=None if self.registry_ok_at is None else now - self.registry_ok_at,
            registry_bound_s=REGISTRY_BOUND_BEATS * self.heartbeat_s if self.redis_url else None,
            kv_free_blocks=free,
            kv_total_blocks=total,
            problems=(*self._problems.values(), *(r for c in self._checks if (r := c()))),
        )

    def evaluate(self) -> tuple[Verdict, Verdict]:
        """On the event loop: decide now, and keep the answer for other threads."""
        p = self.inputs()
        self._cached = (liveness(p), readiness(p))
        return self._cached

    def verdicts(self) -> tuple[Verdict, Verdict]:
        """From any thread: the last decision, unless the event loop stopped turning since."""
        silent = self.clock() - self.loop_tick
        if silent > LOOP_STALL_S:
            dead = liveness(ProbeInputs(loop_silent_s=silent))
            return dead, Verdict(False, f"not live: {dead.reason}")
        return self._cached

    # ----- serving it over gRPC health -----
    async def attach(self, servicer: Any) -> None:
        """Answer `liveness` and `readiness` in `servicer` (a grpc_health aio HealthServicer)."""
        self._servicers.append(servicer)
        await self._push(servicer, *self.evaluate())

    def detach(self, servicer: Any) -> None:
        with contextlib.suppress(ValueError):
            self._servicers.remove(servicer)
        self._pushed.pop(id(servicer), None)

    async def _push(self, servicer: Any, live: Verdict, ready: Verdict) -> None:
        if self._pushed.get(id(servicer)) == (live.ok, ready.ok):
            return
        self._pushed[id(servicer)] = (live.ok, ready.ok)
        for name, verdict in ((LIVENESS, live), (READINESS, ready)):
            await servicer.set(name, _status(verdict.ok))

    async def update(self) -> tuple[Verdict, Verdict]:
        """Tick, decide, and bring every attached servicer up to date (on the event loop)."""
        self.loop_tick = self.clock()
        live, ready = self.evaluate()
        for servicer in list(self._servicers):
            await self._push(servicer, live, ready)
        return live, ready

    # ----- the updater -----
    def start(self) -> asyncio.Task[None] | None:
        """Run the updater on the running loop unless it runs already; the task when started."""
        if self._task is not None and not self._task.done():
            return None
        self._task = asyncio.ensure_future(self.run())
        return self._task

    async def run(self) -> None:
        """Until cancelled: `update()` every `TICK_S`, and (with a Redis URL) PING the registry
        every heartbeat."""
        pinger = asyncio.ensure_future(self._ping_forever()) if self.redis_url else None
        try:
            while True:
                try:
                    await self.update()
                except Exception as e:  # noqa: BLE001 - a broken check must not stop the probes
                    log.warning("probe update failed", error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(TICK_S)
        finally:
            if pinger is not None:
                pinger.cancel()
                await asyncio.gather(pinger, return_exceptions=True)

    async def _ping_forever(self) -> None:
        import redis.asyncio as aioredis

        from pdmesh_service.redis_client import connect

        timeout = max(1.0, self.heartbeat_s)
        client = connect(self.redis_url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            while True:
                try:
                    await client.ping()
                    self.registry_ok_at = self.clock()
                except (aioredis.RedisError, OSError):
                    pass  # the verdict says how long it has been silent
                await asyncio.sleep(self.heartbeat_s)
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()


def _status(ok: bool) -> int:
    return int(
        health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
    )


_PROCESS: contextvars.ContextVar[Probes | None] = contextvars.ContextVar(
    "pdmesh_probes", default=None
)


def process_probes() -> Probes:
    """This process's `Probes` (the one `run_service` made), else one for this asyncio context,
    made on first use."""
    probes = _PROCESS.get()
    if probes is None:
        probes = Probes()
        _PROCESS.set(probes)
    return probes


def set_process_probes(probes: Probes) -> None:
    """Make `probes` the process's (`run_service`, before its event loop starts)."""
    _PROCESS.set(probes)


# ----- HTTP on the metrics port -----
WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def probe_wsgi_app(probes: Probes, metrics: WsgiApp) -> WsgiApp:
    """/health/live and /health/ready from `probes`; every other path goes to `metrics`."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in (LIVE_PATH, READY_PATH):
            return metrics(environ, start_response)
        live, ready = probes.verdicts()
        verdict = live if path == LIVE_PATH else ready
        body = json.dumps(verdict.body()).encode()
        status = "200 OK" if verdict.ok else "503 Service Unavailable"
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        start_response(status, headers)
        return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]

    return app


def start_probe_http_server(port: int, addr: str, probes: Probes) -> Any:
    """Serve `probe_wsgi_app` over the process's Prometheus registry on `addr:port`, in daemon
    threads (what prometheus_client's `start_http_server` did for the metrics alone); the server."""
    import socket
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    infos = socket.getaddrinfo(addr or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family = infos[0][0]

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
            pass

    server = make_server(
        addr,
        port,
        probe_wsgi_app(probes, make_wsgi_app()),
        server_class=Server,
        handler_class=QuietHandler,
    )
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
