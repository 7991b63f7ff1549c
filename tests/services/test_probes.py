"""Liveness and readiness (`pdmesh_service.probes`): the pure decision, the process state over it,
its HTTP app on the metrics port, the gRPC health names `liveness`/`readiness`, the HTTP mode of
`python -m pdmesh_service.healthcheck`, and the gateway's pieces (`metrics_url`, `mesh_problem`)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh_gateway.rest import mesh_problem, metrics_url
from pdmesh_gateway.router import Router
from pdmesh_service import healthcheck
from pdmesh_service.grpc_server import start_grpc_server
from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.probes import (
    LOOP_STALL_S,
    ProbeInputs,
    Probes,
    kv_reserve,
    liveness,
    probe_wsgi_app,
    readiness,
    start_probe_http_server,
)
from pdmesh_service.redis_server import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY = ProbeInputs(started=True, registry_silent_s=0.5, registry_bound_s=5.0)


# ----- the pure decision -----
def test_a_started_process_with_its_registry_is_live_and_ready() -> None:
    assert liveness(READY).ok and readiness(READY).ok


def test_starting_is_live_but_not_ready() -> None:
    p = ProbeInputs()
    assert liveness(p).ok
    assert readiness(p).reason == "starting"


def test_draining_is_live_but_not_ready() -> None:
    p = ProbeInputs(started=True, draining=True)
    assert liveness(p).ok
    assert not readiness(p).ok and readiness(p).reason == "draining"


def test_a_fatal_error_or_a_stalled_loop_is_not_live() -> None:
    dead = ProbeInputs(started=True, fatal=("the engine loop ended: crashed",))
    assert not liveness(dead).ok and "engine loop ended" in liveness(dead).reason
    assert readiness(dead).reason.startswith("not live")
    stalled = ProbeInputs(started=True, loop_silent_s=LOOP_STALL_S + 1)
    assert not liveness(stalled).ok and "event loop" in liveness(stalled).reason


@pytest.mark.parametrize("silent", [None, 5.1])
def test_a_silent_registry_is_not_ready(silent: float | None) -> None:
    p = ProbeInputs(started=True, registry_silent_s=silent, registry_bound_s=5.0)
    assert liveness(p).ok
    assert not readiness(p).ok and "registry" in readiness(p).reason


def test_an_unchecked_registry_does_not_count() -> None:
    assert readiness(ProbeInputs(started=True)).ok


def test_decode_kv_free_above_the_reserve_is_ready() -> None:
    assert kv_reserve(10) == 1 and kv_reserve(1000) == 20
    full = ProbeInputs(started=True, kv_free_blocks=0, kv_total_blocks=10)
    assert liveness(full).ok
    assert not readiness(full).ok and "KV cache full" in readiness(full).reason
    assert readiness(ProbeInputs(started=True, kv_free_blocks=1, kv_total_blocks=10)).ok
    assert not readiness(ProbeInputs(started=True, kv_free_blocks=19, kv_total_blocks=1000)).ok


def test_problems_are_reasons_not_to_be_ready() -> None:
    p = ProbeInputs(started=True, problems=("a", "b"))
    assert readiness(p).reason == "a; b" and liveness(p).ok


def test_the_first_reason_wins_in_order() -> None:
    p = ProbeInputs(draining=True, kv_free_blocks=0, kv_total_blocks=4, problems=("x",))
    assert readiness(p).reason == "draining"


# ----- the process state -----
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_probes_decide_from_what_the_process_reports() -> None:
    clock = Clock()
    probes = Probes("redis://127.0.0.1:1/0", heartbeat_s=1.0, clock=clock)
    assert probes.evaluate()[1].reason == "starting"
    probes.started = True
    assert "registry" in probes.evaluate()[1].reason  # never answered
    probes.registry_ok_at = clock.now
    assert probes.evaluate()[1].ok
    probes.kv = (0, 8)
    assert "KV cache full" in probes.evaluate()[1].reason
    probes.kv = (8, 8)
    probes.set_problem("engine", "silent")
    assert probes.evaluate()[1].reason == "silent"
    probes.set_problem("engine", None)
    flag = {"reason": None}
    probes.add_check(lambda: flag["reason"])
    assert probes.evaluate()[1].ok
    flag["reason"] = "no decode rank is ready"
    assert probes.evaluate()[1].reason == "no decode rank is ready"
    flag["reason"] = None
    clock.now += 6  # the registry silent past 5 beats
    assert "registry" in probes.evaluate()[1].reason
    probes.registry_ok_at = clock.now
    fatal = {"reason": None}
    probes.add_fatal_check(lambda: fatal["reason"])
    probes.loop_tick = clock.now
    assert probes.evaluate() == probes.verdicts()
    fatal["reason"] = "the engine loop ended"
    live, ready = probes.evaluate()
    assert not live.ok and not ready.ok


def test_other_threads_see_a_stalled_loop() -> None:
    clock = Clock()
    probes = Probes(clock=clock, started=True)
    probes.loop_tick = clock.now
    assert probes.evaluate() == (liveness(READY), readiness(ProbeInputs(started=True)))
    clock.now += LOOP_STALL_S + 1
    live, ready = probes.verdicts()
    assert not live.ok and not ready.ok


# ----- HTTP -----
def _call(app, path: str) -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, object] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET"}, start_response))
    return str(seen["status"]), seen["headers"], body  # type: ignore[return-value]


def test_the_wsgi_app_answers_probes_and_passes_the_rest_to_metrics() -> None:
    probes = Probes()

    def metrics(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"# metrics"]

    app = probe_wsgi_app(probes, metrics)
    probes.evaluate()
    status, headers, body = _call(app, "/health/live")
    assert status.startswith("200") and json.loads(body) == {"status": "ok"}
    status, headers, body = _call(app, "/health/ready")
    assert status.startswith("503") and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"status": "unavailable", "reason": "starting"}
    probes.started = True
    probes.evaluate()
    assert _call(app, "/health/ready")[0].startswith("200")
    assert _call(app, "/metrics")[2] == b"# metrics"
    assert _call(app, "/")[2] == b"# metrics"


def test_the_metrics_port_serves_probes_metrics_and_the_healthcheck_cli(capsys) -> None:
    probes = Probes()
    port = free_port()
    server = start_probe_http_server(port, "127.0.0.1", probes)
    try:
        base = f"http://127.0.0.1:{port}"
        text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        assert "python_info" in text or "process_" in text or "# HELP" in text
        probes.evaluate()
        assert healthcheck.main(["--url", f"{base}/health/live", "--quiet"]) == 0
        assert healthcheck.main(["--url", f"{base}/health/ready"]) == 1
        assert "HTTP 503 starting" in capsys.readouterr().err
        probes.started = True
        probes.evaluate()
        assert healthcheck.main(["--url", f"{base}/health/ready"]) == 0
        assert "HTTP 200" in capsys.readouterr().out
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck.main(["--url", f"http://127.0.0.1:{port}/health/live"]) == 1


def test_the_healthcheck_cli_takes_an_address_or_a_url_not_both() -> None:
    with pytest.raises(SystemExit) as e:
        healthcheck.main(["--url", "http://127.0.0.1:1/", "--address", "127.0.0.1:1"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        healthcheck.main(["--url", "ftp://x"])


# ----- gRPC -----
async def _check(address: str, name: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=name), timeout=5
        )
    return int(reply.status)


async def _until(address: str, name: str, status: int, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (seen := await _check(address, name)) != status:
        assert asyncio.get_running_loop().time() < deadline, (name, seen)
        await asyncio.sleep(0.05)


def test_grpc_health_answers_liveness_and_readiness() -> None:
    asyncio.run(asyncio.wait_for(_grpc_health(), 30))


async def _grpc_health() -> None:
    probes = Probes()
    server = await start_grpc_server("127.0.0.1", 0, [], ["pdmesh.test.v1.T"], probes=probes)
    address = f"127.0.0.1:{server.port}"
    try:
        assert server.probe_task is not None  # no process runner: the server runs the updater
        assert await _check(address, "liveness") == SERVING
        assert await _check(address, "readiness") == NOT_SERVING  # not started
        await server.set_serving(True)
        await _until(address, "readiness", SERVING)
        assert await _check(address, "pdmesh.test.v1.T") == SERVING
        probes.kv = (0, 16)
        await _until(address, "readiness", NOT_SERVING)
        probes.kv = (16, 16)
        await _until(address, "readiness", SERVING)
        probes.draining = True
        await _until(address, "readiness", NOT_SERVING)
        assert await _check(address, "liveness") == SERVING
    finally:
        await server.stop(0)
    assert server.probe_task is not None and server.probe_task.done()


# ----- the gateway's pieces -----
def test_metrics_url_is_the_metrics_port_on_the_grpc_host() -> None:
    worker = InstanceInfo("d", Role.DECODE, "10.0.0.5:50051", metrics_port=9090)
    assert metrics_url(worker) == "http://10.0.0.5:9090/metrics"
    v6 = InstanceInfo("d", Role.DECODE, "[::1]:50051", metrics_port=9090)
    assert metrics_url(v6) == "http://[::1]:9090/metrics"
    gateway = InstanceInfo("g", Role.GATEWAY, "gw:50051", http_port=8000)
    assert metrics_url(gateway) == "http://gw:8000/metrics"
    assert metrics_url(InstanceInfo("k", Role.KVSTORE, "kv:50051")) is None


def test_metrics_port_round_trips_through_the_registry_json() -> None:
    info = InstanceInfo("d", Role.DECODE, "h:1", metrics_port=9090)
    assert InstanceInfo.from_json(info.to_json()).metrics_port == 9090
    older = json.loads(info.to_json())
    del older["metrics_port"]  # a rank of an older release
    assert InstanceInfo.from_json(json.dumps(older)).metrics_port == 0


def test_the_gateway_is_ready_with_its_registry_and_a_decode_rank() -> None:
    router = Router()
    assert mesh_problem(router) == "no decode rank is ready"
    router.update([InstanceInfo("p", Role.PREFILL, "h:1", ready=True)])
    assert mesh_problem(router) == "no decode rank is ready"
    router.update([InstanceInfo("d", Role.DECODE, "h:2", ready=True)])
    assert mesh_problem(router) is None
    router.refresh_error = "ConnectionError: refused"
    assert "registry is unreachable" in (mesh_problem(router) or "")
