"""Helpers for the end-to-end tests: addresses of a running mesh, its workers' status, killing,
restarting and replacing (a rolling update) its services, the heartbeat they run with."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import grpc

from pdmesh.launcher import Mesh


def worker_args(block_size: int) -> tuple[str, ...]:
    """Small KV pools so leaks show up; a small token budget so chunked prefill happens."""
    return (
        *("--block-size", str(block_size)),
        *("--num-blocks", "160"),
        *("--max-num-batched-tokens", "64"),
        *("--max-num-seqs", "16"),
        *("--torch-threads", "1"),
    )


WORKER_ARGS = worker_args(8)
# a DeepSeek-V4 block covers a multiple of every compress rate (the tiny preset's 4 and 16)
V4_WORKER_ARGS = worker_args(16)


def block_size_of(mesh: Mesh) -> int:
    """The KV block size the mesh's workers run with (their `--block-size`)."""
    args = mesh.options.worker_args
    return int(args[args.index("--block-size") + 1])


def http_url(mesh: Mesh) -> str:
    return f"http://{mesh.options.host}:{mesh.options.http_port}"


def abandon_stream(mesh: Mesh, body: dict[str, Any], chunks: int = 3) -> None:
    """POST a streaming completion and hang up after its first `chunks` SSE events, with the
    request still decoding."""
    import httpx

    url = f"{http_url(mesh)}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen >= chunks:
                return


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


def kill(mesh: Mesh, name: str, timeout_s: float = 10.0) -> int:
    """SIGKILL a service's current process and reap it; its pid."""
    pid = mesh.pid_of(name)
    assert pid is not None, f"{name} is not running"
    os.kill(pid, signal.SIGKILL)
    mesh.processes[name].wait(timeout_s)
    return pid


def respawn(mesh: Mesh, name: str) -> int:
    """Start a service again with the argv and environment the launcher gave it (what the
    supervisor does after a death); the new pid. The caller waits for it to serve."""
    [spec] = [s for s in mesh.specs if s.name == name]
    mesh._spawn(spec)
    pid = mesh.pid_of(name)
    assert pid is not None, mesh.log_tail(name)
    return pid


def with_options(argv: tuple[str, ...], options: dict[str, str]) -> tuple[str, ...]:
    """`argv` with each `--flag value` of `options` set (its value replaced, or appended)."""
    out = list(argv)
    for flag, value in options.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return tuple(out)


def replace_service(
    mesh: Mesh, name: str, new_name: str, options: dict[str, str], timeout_s: float = 120.0
) -> str:
    """A rolling update of one worker, surge first: start `new_name` with the argv of `name` and
    `options` set (e.g. another --block-size: a new revision) on fresh ports, wait until it serves,
    then SIGTERM `name` (it drains for its --drain-s) and wait for it to exit; `name` leaves the
    mesh's services. The new service's gRPC address."""
    from pdmesh.launcher import ServiceSpec
    from pdmesh_service.redis_server import free_port

    [old] = [s for s in mesh.specs if s.name == name]
    port, metrics = free_port(), free_port()
    argv = with_options(
        old.argv,
        {
            "--instance-id": new_name,
            "--port": str(port),
            "--metrics-port": str(metrics),
            **options,
        },
    )
    spec = ServiceSpec(new_name, old.role, f"{mesh.options.host}:{port}", argv, metrics)
    mesh.specs.append(spec)
    mesh._spawn(spec)
    mesh._wait_serving(spec, spec.grpc_address, time.monotonic() + timeout_s)
    process = mesh.processes.pop(name)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout_s)
    mesh.specs.remove(old)
    return spec.grpc_address


def heartbeat_s(mesh: Mesh, name: str) -> float:
    """The heartbeat interval a service runs with: its --heartbeat-s as the service parses it from
    the argv and environment the launcher gives it (PDMESH_HEARTBEAT_S, else the default)."""
    from pdmesh_service.options import add_common_arguments

    [spec] = [s for s in mesh.specs if s.name == name]
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_common_arguments(parser, environ=mesh.environment(spec))
    role_args = spec.argv[spec.argv.index("serve") + 2 :]
    args, _ = parser.parse_known_args(role_args)
    return float(args.heartbeat_s)


def start_mesh(model: Path, log_dir: Path, deployment: str, **options: Any) -> Mesh:
    """A started mesh on loopback: free ports, the tests' worker options (`WORKER_ARGS` unless
    `options` give others), and `options` (other `MeshOptions` fields: roles, mode, gateway
    arguments, ...)."""
    from pdmesh.launcher import MeshOptions
    from pdmesh_service.redis_server import free_port

    mesh = Mesh(
        MeshOptions(
            model_dir=model,
            http_port=free_port(),
            grpc_port=free_port(),
            deployment=deployment,
            log_dir=log_dir,
            **{"worker_args": WORKER_ARGS, **options},
        )
    )
    mesh.start(timeout_s=240, progress=lambda line: None)
    return mesh
