"""Liveness and readiness across a real mesh (agg: two decode ranks with small KV pools, run with
--drain-s): every service answers /health/live and /health/ready on its metrics port (the gateway on
its REST port) and gRPC health `liveness`/`readiness`; /mesh lists each instance's metrics URL,
which serves Prometheus text; a decode rank whose KV pool is full is live but not ready; a draining
one (SIGTERM with --drain-s) is live but not ready; with every decode rank killed the gateway is
not ready."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from meshlib import http_url, kill, start_mesh, worker_args

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NUM_BLOCKS = 24  # 8-token blocks: a few long requests fill the pool
WORKER_ARGS = (
    *(a if a != "160" else str(NUM_BLOCKS) for a in worker_args(8)),
    *("--drain-s", "120"),
)


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    mesh = start_mesh(
        tiny_model,
        tmp_path_factory.mktemp("logs-probes"),
        "test-probes",
        mode="agg",
        num_prefill=0,
        num_decode=2,
        worker_args=WORKER_ARGS,
    )
    yield mesh
    mesh.stop()


def _probe_base(mesh, name: str) -> str:
    [spec] = [s for s in mesh.specs if s.name == name]
    if spec.role == "gateway":
        return http_url(mesh)
    return f"http://{mesh.options.host}:{spec.metrics_port}"


def _get(url: str) -> tuple[int, dict[str, Any]]:
    response = httpx.get(url, timeout=10)
    return response.status_code, response.json()


def _grpc(address: str, name: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=name), timeout=10
        )
    return int(reply.status)


def _until(check, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s:g}s: {what}"
        time.sleep(0.2)


def test_every_service_is_live_and_ready_over_http_and_grpc(mesh) -> None:
    for spec in mesh.specs:
        base = _probe_base(mesh, spec.name)
        assert _get(f"{base}/health/live") == (200, {"status": "ok"}), spec.name
        _until(lambda b=base: _get(f"{b}/health/ready")[0] == 200, f"{spec.name} ready")
        for name in ("liveness", "readiness"):
            assert _grpc(spec.grpc_address, name) == SERVING, (spec.name, name)
    assert httpx.get(f"{http_url(mesh)}/health", timeout=10).json()["status"] == "ok"


def test_mesh_lists_each_instance_metrics_url(mesh) -> None:
    instances = httpx.get(f"{http_url(mesh)}/mesh", timeout=10).json()["instances"]
    assert {i["instance_id"] for i in instances} == {s.name for s in mesh.specs}
    for instance in instances:
        url = instance["metrics_url"]
        assert url and url.endswith("/metrics"), instance
        response = httpx.get(url, timeout=10)
        assert response.status_code == 200 and "# TYPE" in response.text, url
    decode = next(i for i in instances if i["role"] == "decode")
    assert "pdmesh_kv_blocks_free" in httpx.get(decode["metrics_url"], timeout=10).text


def _long_requests(mesh, count: int, stop: threading.Event) -> list[threading.Thread]:
    def one() -> None:
        body = {
            "prompt": "tell me a long story about " * 3,
            "max_tokens": 4 * NUM_BLOCKS,  # half a pool each
            "ignore_eos": True,
            "temperature": 0,
        }
        while not stop.is_set():
            try:
                httpx.post(f"{http_url(mesh)}/v1/completions", json=body, timeout=120)
            except httpx.HTTPError:
                return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def test_a_decode_rank_with_its_kv_pool_full_is_live_but_not_ready(mesh) -> None:
    decodes = [s for s in mesh.specs if s.role == "decode"]
    stop = threading.Event()
    threads = _long_requests(mesh, 12, stop)
    try:

        def full() -> Any:
            for spec in decodes:
                status, body = _get(f"{_probe_base(mesh, spec.name)}/health/ready")
                if status == 503 and "KV cache full" in body["reason"]:
                    return spec
            return None

        spec = _until(full, "a decode rank's KV pool full", timeout_s=120)
        assert _get(f"{_probe_base(mesh, spec.name)}/health/live")[0] == 200
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=150)
    for spec in decodes:  # the pool frees again
        base = _probe_base(mesh, spec.name)
        _until(lambda b=base: _get(f"{b}/health/ready")[0] == 200, f"{spec.name} ready again")
        assert _grpc(spec.grpc_address, "readiness") == SERVING


def test_draining_is_live_but_not_ready_and_no_decode_left_is_not_ready(mesh) -> None:
    first, second = [s for s in mesh.specs if s.role == "decode"]
    gateway = http_url(mesh)
    os.kill(mesh.pid_of(first.name), signal.SIGTERM)  # --drain-s 120: serves on, not ready
    base = _probe_base(mesh, first.name)
    status, body = _until(
        lambda: (r := _get(f"{base}/health/ready"))[0] == 503 and r, f"{first.name} draining"
    )
    assert body == {"status": "unavailable", "reason": "draining"}
    assert _get(f"{base}/health/live") == (200, {"status": "ok"})
    _until(lambda: _grpc(first.grpc_address, "readiness") == NOT_SERVING, "gRPC readiness")
    assert _grpc(first.grpc_address, "liveness") == SERVING
    assert _get(f"{gateway}/health/ready")[0] == 200  # another decode rank is there

    kill(mesh, first.name)
    kill(mesh, second.name)

    def gateway_unready() -> Any:
        status, body = _get(f"{gateway}/health/ready")
        return status == 503 and body

    body = _until(gateway_unready, "the gateway not ready", timeout_s=60)
    assert body["reason"] == "no decode rank is ready"
    assert _get(f"{gateway}/health/live")[0] == 200
    [spec] = [s for s in mesh.specs if s.role == "gateway"]
    _until(lambda: _grpc(spec.grpc_address, "readiness") == NOT_SERVING, "gateway gRPC readiness")
    assert _grpc(spec.grpc_address, "liveness") == SERVING
    assert httpx.get(f"{gateway}/health", timeout=10).status_code == 503  # /health: unchanged
