"""Helpers for the end-to-end tests: addresses of a running mesh and its workers' status."""

from __future__ import annotations

import time

import grpc

from pdmesh.launcher import Mesh

# Small KV pools so leaks show up; a small token budget so chunked prefill happens.
WORKER_ARGS = (
    "--block-size",
    "8",
    "--num-blocks",
    "160",
    "--max-num-batched-tokens",
    "64",
    "--max-num-seqs",
    "16",
    "--torch-threads",
    "1",
)


def http_url(mesh: Mesh) -> str:
    return f"http://{mesh.options.host}:{mesh.options.http_port}"


def grpc_address(mesh: Mesh) -> str:
    return f"{mesh.options.host}:{mesh.options.grpc_port}"


def mesh_metadata(mesh: Mesh) -> tuple[tuple[str, str], ...]:
    """What an internal RPC to the mesh's services must carry (the token `pdmesh up` generated)."""
    from pdmesh_service.grpc_server import MESH_TOKEN_METADATA

    return ((MESH_TOKEN_METADATA, mesh.mesh_token),) if mesh.mesh_token else ()


def worker_status(mesh: Mesh, role: str) -> list:
    """Status of every rank of a role, with the KV pool's integrity check run."""
    from pdmesh_proto.common.v1 import common_pb2
    from pdmesh_proto.decode.v1 import decode_pb2_grpc
    from pdmesh_proto.prefill.v1 import prefill_pb2_grpc

    stub_class = decode_pb2_grpc.DecodeStub if role == "decode" else prefill_pb2_grpc.PrefillStub
    statuses = []
    for address in (
        a for s in mesh.specs if s.role == role for a in s.addresses
    ):  # every rank of DEP instances
        with grpc.insecure_channel(address) as channel:
            statuses.append(
                stub_class(channel).Status(
                    common_pb2.StatusRequest(check_integrity=True),
                    timeout=30,
                    metadata=mesh_metadata(mesh),
                )
            )
    return statuses


def wait_idle(mesh: Mesh, timeout_s: float = 30.0) -> dict[str, list]:
    """Every worker rank's status once none runs, waits or holds a block (or the last seen at the
    timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = {role: worker_status(mesh, role) for role in ("prefill", "decode")}
        busy = [
            s
            for group in statuses.values()
            for s in group
            if s.num_running or s.num_waiting or s.kv_blocks_used
        ]
        if not busy or time.monotonic() > deadline:
            return statuses
        time.sleep(0.2)
