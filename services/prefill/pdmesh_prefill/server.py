"""`pdmesh serve prefill`: a prefill rank (wiring only; see `worker.runtime.run_worker`)."""

from __future__ import annotations

import argparse
import asyncio
import functools
from dataclasses import dataclass
from pathlib import Path

from pdmesh_engine.config import EngineConfig
from pdmesh_prefill.connector import KVPusher, PrefillConnector
from pdmesh_prefill.servicer import PrefillServicer
from pdmesh_proto.prefill.v1 import prefill_pb2_grpc
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

ROLE = "prefill"
SERVICE_NAME = "pdmesh.prefill.v1.Prefill"


@dataclass(frozen=True)
class PrefillConfig:
    common: CommonConfig
    model_dir: Path
    engine: EngineConfig
    kvstore: str = ""  # host:port of the kvstore; empty: find it in the registry
    dep: DEPOptions = DEPOptions()  # --dep N: N rank processes (see worker.dep_instance)
    integrity: KVIntegrityOptions = KVIntegrityOptions()  # --kv-digest, the fault hook


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    add_engine_options(parser)
    add_speculative_options(parser)
    add_kv_integrity_options(parser)
    add_dep_arguments(parser)
    g = parser.add_argument_group("prefill")
    g.add_argument(
        "--kvstore", default="", help="kvstore address host:port (default: from the registry)"
    )


def config_from_args(args: argparse.Namespace) -> PrefillConfig:
    dep = dep_from_args(args)
    engine = worker_engine_config(args)
    return PrefillConfig(
        rank_common(common_from_args(args), ROLE, dep),
        resolve_model(args.model),
        engine,
        args.kvstore,
        dep,
        kv_integrity_from_args(args),
    )


def _make_worker(parts: WorkerParts, integrity: KVIntegrityOptions) -> Worker[PrefillServicer]:
    """The connector (the loop's role, with its pusher) and the servicer over it."""
    fault = integrity.fault(parts.instance_id)
    pusher = KVPusher(parts.engine, parts.agent, integrity.digest, fault)
    connector = PrefillConnector(parts.engine, pusher, parts.kvstore, parts.instance_id)
    return Worker(
        connector,
        PrefillServicer(
            connector,
            parts.engine,
            parts.instance_id,
            parts.agent.groups,
            parts.engine.engine.speculative,
            parts.revision,
        ),
    )


async def serve(config: PrefillConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled; `ready` is set once the rank takes requests."""
    spec = WorkerSpec(
        ROLE,
        SERVICE_NAME,
        functools.partial(_make_worker, integrity=config.integrity),
        prefill_pb2_grpc.add_PrefillServicer_to_server,
    )
    await run_worker(
        spec, config.common, config.model_dir, config.engine, config.kvstore, ready, config.dep
    )


def supervise(role: str, argv: list[str], config: PrefillConfig) -> int:
    """`--dep N` without `--dep-rank`: run and watch the instance's N rank processes."""
    return run_instance(role, argv, config.common, config.model_dir, config.dep)
