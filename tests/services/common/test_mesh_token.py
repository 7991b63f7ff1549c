"""The mesh token on every internal RPC, for real: kvstore, EPLB controller, decode and prefill with
`--mesh-token-file`, over gRPC on loopback, real Redis and NIXL and a tiny random model.

The RPCs are read off each service's proto descriptor, so a new RPC is covered without editing this
file: without the token or with a wrong one each is UNAUTHENTICATED (its request is not even parsed:
an empty message is sent), with it none is; the standard health service stays open. The workers
start only if their own kvstore calls carry the token (they register their NIXL agents through it).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.tools.model_init import init_model
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.eplb.v1 import eplb_pb2, eplb_pb2_grpc
from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdmesh_service.grpc_server import MESH_TOKEN_METADATA
from pdmesh_service.healthcheck import check
from pdmesh_service.redis_server import EmbeddedRedis, free_port

pytest.importorskip("nixl")
from test_workers import WORKER_ARGS, ServiceHost  # noqa: E402 - after the skip, as pytest imports it

TOKEN = secrets.token_hex(16)
RPC_TIMEOUT_S = 30.0
SERVICES: dict[str, ServiceDescriptor] = {
    "kvstore": kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"],
    "eplb": eplb_pb2.DESCRIPTOR.services_by_name["Eplb"],
    "decode": decode_pb2.DESCRIPTOR.services_by_name["Decode"],
    "prefill": prefill_pb2.DESCRIPTOR.services_by_name["Prefill"],
}


@dataclass
class Mesh:
    addresses: dict[str, str]  # role -> HOST:PORT
    channels: dict[str, grpc.Channel]  # role -> a channel that sends no token

    def instance(self, role: str) -> str:
        return f"{role}-auth"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    from pdmesh_decode import server as decode_server
    from pdmesh_eplb import server as eplb_server
    from pdmesh_kvstore import server as kvstore_server
    from pdmesh_prefill import server as prefill_server

    root = tmp_path_factory.mktemp("mesh-token")
    model = init_model(root / "tiny", preset="tiny", seed=0, verbose=False)
    token_file = root / "mesh-token"
    token_file.write_text(TOKEN + "\n")  # stripped when read
    addresses = {role: f"127.0.0.1:{free_port()}" for role in SERVICES}
    redis = EmbeddedRedis().start()
    host = ServiceHost()
    channels: dict[str, grpc.Channel] = {}
    deployment = f"auth-{uuid.uuid4().hex[:8]}"

    def args(role: str) -> list[str]:
        return [
            *("--host", "127.0.0.1", "--port", addresses[role].rpartition(":")[2]),
            *("--redis-url", redis.url, "--deployment", deployment),
            *("--instance-id", f"{role}-auth", "--heartbeat-s", "0.5", "--log-level", "WARNING"),
            *("--mesh-token-file", str(token_file)),
        ]

    worker = ["--model", str(model), "--kvstore", addresses["kvstore"], *WORKER_ARGS]
    try:
        host.start(kvstore_server, args("kvstore"))
        host.start(eplb_server, [*args("eplb"), "--no-rebalance"])
        host.start(decode_server, [*args("decode"), *worker])
        host.start(prefill_server, [*args("prefill"), *worker])
        channels = {role: grpc.insecure_channel(a) for role, a in addresses.items()}
        yield Mesh(addresses, channels)
    finally:
        for channel in channels.values():
            channel.close()
        host.stop()
        redis.stop()


def with_token(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return ((MESH_TOKEN_METADATA, token),)


def call_raw(
    channel: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[grpc.StatusCode, str]:
    """Call `method` with an empty request (raw bytes: no stub needed); its status and details."""
    path = f"/{service.full_name}/{method.name}"
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    request = iter([b""]) if method.client_streaming else b""
    try:
        reply = kind(path)(request, metadata=metadata, timeout=RPC_TIMEOUT_S)
        if method.server_streaming:
            for _ in reply:
                pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize("role", sorted(SERVICES))
def test_every_rpc_without_the_token_or_with_a_wrong_one_is_unauthenticated(
    mesh: Mesh, role: str
) -> None:
    service = SERVICES[role]
    assert len(service.methods) >= 2, service.full_name
    for method in service.methods:
        missing = call_raw(mesh.channels[role], service, method)
        wrong = call_raw(mesh.channels[role], service, method, with_token(TOKEN[:-1] + "x"))
        assert missing == (grpc.StatusCode.UNAUTHENTICATED, "missing mesh token"), method.name
        assert wrong == (grpc.StatusCode.UNAUTHENTICATED, "wrong mesh token"), method.name


@pytest.mark.parametrize("role", sorted(SERVICES))
def test_with_the_token_no_rpc_is_refused(mesh: Mesh, role: str) -> None:
    """Empty requests are mostly invalid: any answer but UNAUTHENTICATED passed the check."""
    service = SERVICES[role]
    for method in service.methods:
        code, details = call_raw(mesh.channels[role], service, method, with_token())
        assert code != grpc.StatusCode.UNAUTHENTICATED, (method.name, details)


@pytest.mark.parametrize("role", sorted(SERVICES))
def test_health_needs_no_token(mesh: Mesh, role: str) -> None:
    name = SERVICES[role].full_name
    reply = health_pb2_grpc.HealthStub(mesh.channels[role]).Check(
        health_pb2.HealthCheckRequest(service=name), timeout=RPC_TIMEOUT_S
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert check(mesh.addresses[role], name, 5.0).is_serving  # the probe the deployments run


def test_real_calls_with_the_token(mesh: Mesh) -> None:
    md = with_token()
    kvstore = kvstore_pb2_grpc.KVStoreStub(mesh.channels["kvstore"])
    # registered by the decode worker at start, through its own token-carrying kvstore client
    agent = kvstore.GetAgent(
        kvstore_pb2.GetAgentRequest(agent_name=mesh.instance("decode")),
        metadata=md,
        timeout=RPC_TIMEOUT_S,
    )
    assert agent.instance_id == mesh.instance("decode") and agent.metadata
    eplb = eplb_pb2_grpc.EplbStub(mesh.channels["eplb"])
    status = eplb.Status(eplb_pb2.StatusRequest(), metadata=md, timeout=RPC_TIMEOUT_S)
    assert status.instance_id == mesh.instance("eplb") and status.enabled is False
    decode = decode_pb2_grpc.DecodeStub(mesh.channels["decode"])
    request = decode_pb2.GenerateRequest(
        request_id="auth-gen",
        prompt_token_ids=[5, 6, 7, 8, 9],
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0),
    )
    chunks = list(decode.Generate(request, metadata=md, timeout=RPC_TIMEOUT_S))
    assert len([t for c in chunks for t in c.token_ids]) == 4
    prefill = prefill_pb2_grpc.PrefillStub(mesh.channels["prefill"])
    worker = prefill.Status(common_pb2.StatusRequest(check_integrity=True), metadata=md)
    assert worker.integrity_checked and worker.integrity_error == ""
