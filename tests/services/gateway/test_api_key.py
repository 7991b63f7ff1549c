"""The gateway's API key, for real: a gateway process (`python -m pdmesh_gateway`, its key and mesh
token from PDMESH_API_KEY and PDMESH_MESH_TOKEN) in front of kvstore, decode and prefill that want
the mesh token (served in this process, tiny random model, real Redis and NIXL).

REST routes under /v1 and /mesh answer 401 in the OpenAI shape without the key or with a wrong one,
/health and /metrics stay open; every gRPC front-door RPC (read off the proto descriptor) is
UNAUTHENTICATED without it. With the key, the openai SDK, the pdmesh SDK and `pdmesh client` get
completions, which also crossed the mesh with the token (a disaggregated request: gateway → decode,
prefill → decode over NIXL, both workers → kvstore).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.tools.model_init import init_model
from pdmesh_gateway.auth import InvalidApiKey, check_authorization, is_protected
from pdmesh_proto.gateway.v1 import gateway_pb2
from pdmesh_service.redis_server import EmbeddedRedis, free_port

pytest.importorskip("nixl")
_COMMON = str(Path(__file__).resolve().parents[1] / "common")
if _COMMON not in sys.path:
    sys.path.append(_COMMON)  # the worker mesh helpers of tests/services/common/test_workers.py
from test_workers import WORKER_ARGS, ServiceHost  # noqa: E402

API_KEY = f"sk-{secrets.token_hex(12)}"
MESH_TOKEN = secrets.token_hex(16)
START_TIMEOUT_S = 90.0
GENERATE = gateway_pb2.DESCRIPTOR.services_by_name["Generate"]
PROTECTED = [
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/mesh"),
    ("GET", "/mesh/eplb"),
]


@dataclass
class Gateway:
    http: str  # base URL
    grpc: str  # HOST:PORT
    model: str  # served model name


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from pdmesh_decode import server as decode_server
    from pdmesh_kvstore import server as kvstore_server
    from pdmesh_prefill import server as prefill_server

    root = tmp_path_factory.mktemp("api-key")
    model = init_model(root / "tiny", preset="tiny", seed=0, verbose=False)
    token_file = root / "mesh-token"
    token_file.write_text(MESH_TOKEN)
    redis = EmbeddedRedis().start()
    host = ServiceHost()
    deployment = f"key-{uuid.uuid4().hex[:8]}"
    kvstore = f"127.0.0.1:{free_port()}"
    process: subprocess.Popen[bytes] | None = None

    def args(role: str, port: int) -> list[str]:
        return [
            *("--host", "127.0.0.1", "--port", str(port), "--redis-url", redis.url),
            *("--deployment", deployment, "--instance-id", f"{role}-key"),
            *("--heartbeat-s", "0.5", "--log-level", "WARNING"),
            *("--mesh-token-file", str(token_file)),
        ]

    worker = ["--model", str(model), "--kvstore", kvstore, *WORKER_ARGS]
    grpc_port, http_port = free_port(), free_port()
    try:
        host.start(kvstore_server, args("kvstore", int(kvstore.rpartition(":")[2])))
        host.start(decode_server, [*args("decode", free_port()), *worker])
        host.start(prefill_server, [*args("prefill", free_port()), *worker])
        env = {**os.environ, "PDMESH_API_KEY": API_KEY, "PDMESH_MESH_TOKEN": MESH_TOKEN}
        gateway_args = [*args("gateway", grpc_port), "--http-port", str(http_port)]
        gateway_args.remove("--mesh-token-file")  # the gateway's token: the environment's
        gateway_args.remove(str(token_file))
        process = subprocess.Popen(
            [sys.executable, "-m", "pdmesh_gateway", *gateway_args, "--model", str(model)],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{http_port}"
        _wait_routable(base, process)
        yield Gateway(base, f"127.0.0.1:{grpc_port}", model.name)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
        host.stop()
        redis.stop()


def _wait_routable(base: str, process: subprocess.Popen[bytes]) -> None:
    """Until /health (open: no key) says a decode rank is ready."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert process.poll() is None, f"the gateway exited {process.returncode}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway did not become routable in time"
        time.sleep(0.2)


# ----- the pure check ---------------------------------------------------------------------


def test_check_authorization_wants_bearer_and_the_exact_key() -> None:
    check_authorization("Bearer k-1", "k-1")
    check_authorization("bearer  k-1 ", "k-1")
    for header in (None, "", "k-1", "Bearer", "Bearer ", "Basic k-1", "Bearer k-2", "Bearer k-1x"):
        with pytest.raises(InvalidApiKey) as refused:
            check_authorization(header, "k-1")
        assert refused.value.http_status == 401 and refused.value.code == "invalid_api_key"
        assert "k-1" not in str(refused.value)


def test_only_v1_and_mesh_routes_are_protected() -> None:
    for path in ("/v1", "/v1/models", "/v1/chat/completions", "/mesh", "/mesh/eplb"):
        assert is_protected(path), path
    for path in ("/health", "/metrics", "/openapi.json", "/v10/models", "/meshy", "/"):
        assert not is_protected(path), path


def test_the_key_comes_from_its_file_and_is_never_in_the_config_repr(tmp_path: Path) -> None:
    from pdmesh_gateway import server

    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    base = ["--model", str(tmp_path)]
    config = server.config_from_args(parser.parse_args([*base, "--api-key-file", str(key_file)]))
    assert config.api_key == "sk-from-file" and "sk-from-file" not in repr(config)
    assert server.config_from_args(parser.parse_args([*base, "--api-key", "k"])).api_key == "k"


# ----- REST -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_protected_routes_answer_401_in_the_openai_shape(
    gateway: Gateway, method: str, path: str
) -> None:
    body = {"model": gateway.model, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        reply = httpx.request(method, gateway.http + path, json=body, headers=headers, timeout=30)
        assert reply.status_code == 401, (headers, reply.text)
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error",
            None,
            "invalid_api_key",
        )
        assert reply.headers["www-authenticate"] == "Bearer"


def test_health_and_metrics_stay_open_and_mesh_opens_with_the_key(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.http}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{gateway.http}/metrics", timeout=10)
    assert metrics.status_code == 200 and "pdmesh_" in metrics.text
    auth = {"Authorization": f"Bearer {API_KEY}"}
    mesh = httpx.get(f"{gateway.http}/mesh", headers=auth, timeout=10)
    assert mesh.status_code == 200
    assert {i["role"] for i in mesh.json()["instances"]} >= {"decode", "prefill", "kvstore"}


def test_the_openai_sdk_with_the_key_gets_completions(gateway: Gateway) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{gateway.http}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [gateway.model]
    completion = client.completions.create(
        model=gateway.model, prompt="The mesh", max_tokens=4, temperature=0
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    chunks = client.chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        temperature=0,
        stream=True,
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    wrong = openai.OpenAI(base_url=f"{gateway.http}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


# ----- gRPC front door ------------------------------------------------------------------------


def _call(channel: grpc.Channel, method, metadata: tuple = ()) -> grpc.StatusCode:
    """`method` of the gateway's API with an empty request; its status."""
    path = f"/{GENERATE.full_name}/{method.name}"
    call = channel.unary_stream(path) if method.server_streaming else channel.unary_unary(path)
    try:
        reply = call(b"", metadata=metadata, timeout=30)
        if method.server_streaming:
            list(reply)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_grpc_rpc_needs_the_key_and_health_does_not(gateway: Gateway) -> None:
    with grpc.insecure_channel(gateway.grpc) as channel:
        for method in GENERATE.methods:
            assert _call(channel, method) == grpc.StatusCode.UNAUTHENTICATED, method.name
            wrong = (("authorization", "Bearer wrong"),)
            assert _call(channel, method, wrong) == grpc.StatusCode.UNAUTHENTICATED, method.name
            right = (("authorization", f"Bearer {API_KEY}"),)
            assert _call(channel, method, right) != grpc.StatusCode.UNAUTHENTICATED, method.name
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=GENERATE.full_name), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_sdk_sends_its_api_key(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdmesh_client import AsyncClient, Client, Unauthenticated

    monkeypatch.delenv("PDMESH_API_KEY", raising=False)
    with Client(gateway.grpc, api_key=API_KEY, max_retries=0) as client:
        completion = client.generate("The mesh", max_tokens=4, temperature=0)
        assert len(completion.token_ids) == 4
        assert [c.finish_reason for c in client.stream("Hi", max_tokens=2)][-1] == "length"
    with Client(gateway.grpc, max_retries=0) as client, pytest.raises(Unauthenticated):
        client.models()
    monkeypatch.setenv("PDMESH_API_KEY", API_KEY)  # the default of api_key=
    with Client(gateway.grpc, max_retries=0) as client:
        assert client.models() == [gateway.model]

    async def models() -> list[str]:
        async with AsyncClient(gateway.grpc, api_key=API_KEY, max_retries=0) as client:
            return await client.models()

    assert asyncio.run(models()) == [gateway.model]


def test_pdmesh_client_passes_the_key(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdmesh.cli.main import main

    monkeypatch.delenv("PDMESH_API_KEY", raising=False)
    argv = ["client", "generate", "--address", gateway.grpc, "--prompt", "Hi", "--max-tokens", "2"]
    assert main([*argv, "--api-key", API_KEY, "--json"]) == 0
    assert '"finish_reason": "length"' in capsys.readouterr().out
    assert main(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
