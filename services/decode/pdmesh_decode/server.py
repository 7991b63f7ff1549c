"""`pdmesh serve decode`: a decode rank (wiring only; see `worker.runtime.run_worker`)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdmesh_decode.connector import DEFAULT_QUARANTINE_S, DecodeConnector
from pdmesh_decode.servicer import DecodeServicer
from pdmesh_engine.config import EngineConfig
from pdmesh_engine.transfer.pb import group_to_pb
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2_grpc
from pdmesh_service.options import CommonConfig, add_common_arguments, common_from_args
from pdmesh_service.worker.dep_instance import (
    DEPOptions,
    add_dep_arguments,
    dep_from_args,
    rank_common,
    run_instance,
)
from pdmesh_service.worker.engine_options import (
    KVIntegrityOptions,
    add_engine_options,
    add_kv_integrity_options,
    add_speculative_options,
    kv_integrity_from_args,
    resolve_model,
    worker_engine_config,
)
from pdmesh_service.worker.runtime import Worker, WorkerParts, WorkerSpec, run_worker

ROLE = "decode"
SERVICE_NAME = "pdmesh.decode.v1.Decode"


@dataclass(frozen=True)
class DecodeConfig:
    common: CommonConfig
    model_dir: Path
    engine: EngineConfig
    kvstore: str = ""  # host:port of the kvstore; empty: find it in the registry
    lease_ms: int = 10000  # default reservation lease
    # cap on holding blocks a late KV write may land in
    kv_quarantine_s: float = DEFAULT_QUARANTINE_S
    dep: DEPOptions = DEPOptions()  # --dep N: N rank processes (see worker.dep_instance)
    integrity: KVIntegrityOptions = KVIntegrityOptions()  # --kv-digest (the fault hook: unused)

    def __post_init__(self) -> None:
        if not 0 < self.lease_ms < 2**32:
            raise ValueError(f"--lease-ms must be positive, got {self.lease_ms}")
        if not self.kv_quarantine_s > 0:
            raise ValueError(f"--kv-quarantine-s must be positive, got {self.kv_quarantine_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_engine_options(parser)
    add_speculative_options(parser)
    add_kv_integrity_options(parser)
    add_dep_arguments(parser)
    g = parser.add_argument_group("decode")
    g.add_argument(
        "--kvstore", default="", help="kvstore address host:port (default: from the registry)"
    )
    g.add_argument(
        "--lease-ms", type=int, default=10000, help="how long reserved blocks wait for their KV"
    )
    g.add_argument(
        "--kv-quarantine-s",
        type=float,
        default=DEFAULT_QUARANTINE_S,
        help="at most this long, blocks of an ended reservation whose KV write may still land stay "
        "out of the pool (freed as soon as the write's notification arrives)",
    )


def config_from_args(args: argparse.Namespace) -> DecodeConfig:
    dep = dep_from_args(args)
    engine = worker_engine_config(args)  # DEP ranks speculate too (in lockstep)
    return DecodeConfig(
        rank_common(common_from_args(args), ROLE, dep),
        resolve_model(args.model),
        engine,
        args.kvstore,
        args.lease_ms,
        args.kv_quarantine_s,
        dep,
        kv_integrity_from_args(args),
    )


def build_worker(config: DecodeConfig) -> Callable[[WorkerParts], Worker[DecodeServicer]]:
    """The connector (the engine loop's role) and the servicer over it, from a rank's parts."""

    def build(parts: WorkerParts) -> Worker[DecodeServicer]:
        connector = DecodeConnector(
            parts.engine,
            parts.agent,
            parts.kvstore,
            parts.instance_id,
            config.kv_quarantine_s,
            digest=config.integrity.digest,
        )
        target = common_pb2.KVTarget(
            agent_name=parts.agent.name,
            instance_id=parts.instance_id,
            speculative=parts.engine.engine.speculative,
            groups=[group_to_pb(g) for g in parts.agent.groups],
            revision=parts.revision.fingerprint,
            revision_parts=dict(parts.revision.parts),
        )
        return Worker(
            connector,
            DecodeServicer(parts.engine, connector, parts.instance_id, target, config.lease_ms),
        )

    return build


async def serve(config: DecodeConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled; `ready` is set once the rank takes requests."""
    spec = WorkerSpec(
        ROLE, SERVICE_NAME, build_worker(config), decode_pb2_grpc.add_DecodeServicer_to_server
    )
    await run_worker(
        spec, config.common, config.model_dir, config.engine, config.kvstore, ready, config.dep
    )


def supervise(role: str, argv: list[str], config: DecodeConfig) -> int:
    """`--dep N` without `--dep-rank`: run and watch the instance's N rank processes."""
    return run_instance(role, argv, config.common, config.model_dir, config.dep)
