"""`pdmesh serve kvstore`: the KV-metadata service (wiring only; see `store` and `servicer`).

Start: connect Redis → gRPC server (health NOT_SERVING) → publish `InstanceInfo(role="kvstore")`
once, then heartbeat it → health SERVING → `ready` set. Cancelled: heartbeat stopped, registry entry
removed, health NOT_SERVING and server stopped, Redis closed (in that order).

The prefix index (`prefix_index`) lives in this process's memory: a restarted kvstore starts empty
and asks every rank for a snapshot (resync). Every heartbeat it drops the ranks the registry no
longer lists, so a rank that died leaves the index within its registry TTL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass

from redis.exceptions import RedisError

from pdmesh_kvstore.prefix_index import PrefixIndex, ranks_to_drop
from pdmesh_kvstore.servicer import KVStoreServicer
from pdmesh_kvstore.store import KVStore
from pdmesh_proto.kvstore.v1 import kvstore_pb2_grpc
from pdmesh_service.grpc_server import MeshAuth, start_grpc_server
from pdmesh_service.logging import get_logger
from pdmesh_service.options import CommonConfig, add_common_arguments, common_from_args
from pdmesh_service.registry import InstanceInfo, Registry, connect, stay_registered
from pdmesh_service.tasks import pause, stop_with

log = get_logger(__name__)
ROLE = "kvstore"
SERVICE_NAME = "pdmesh.kvstore.v1.KVStore"


@dataclass(frozen=True)
class KVStoreConfig:
    common: CommonConfig
    handoff_retention_s: float = 60.0  # how long a finished hand-off stays readable
    handoff_grace_s: float = 30.0  # how long a live hand-off outlives its lease (swept after that)

    def __post_init__(self) -> None:
        if not self.handoff_retention_s >= 0.001:
            raise ValueError(
                f"--handoff-retention-s must be >= 0.001, got {self.handoff_retention_s}"
            )
        if not self.handoff_grace_s >= 0:
            raise ValueError(f"--handoff-grace-s must be >= 0, got {self.handoff_grace_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    g = parser.add_argument_group("kvstore")
    g.add_argument(
        "--handoff-retention-s",
        type=float,
        default=60.0,
        help="keep finished hand-off records this long",
    )
    g.add_argument(
        "--handoff-grace-s",
        type=float,
        default=30.0,
        help="live hand-off records last their lease plus this long (decode expires them before)",
    )


def config_from_args(args: argparse.Namespace) -> KVStoreConfig:
    return KVStoreConfig(common_from_args(args), args.handoff_retention_s, args.handoff_grace_s)


async def serve(config: KVStoreConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled; `ready` is set once requests are served and the registry lists us."""
    common = config.common
    redis = connect(common.redis_url)
    registry = Registry(redis, common.deployment)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(redis.aclose)
        store = KVStore(
            redis,
            common.deployment,
            retention_ms=int(config.handoff_retention_s * 1000),
            grace_ms=int(config.handoff_grace_s * 1000),
        )
        servicer = KVStoreServicer(store)
        server = await start_grpc_server(
            common.host,
            common.port,
            [lambda s: kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, s)],
            [SERVICE_NAME],
            auth=MeshAuth.from_config(common),
        )
        stack.push_async_callback(server.stop)
        instance_id = common.instance(ROLE, server.port)
        info = InstanceInfo(
            instance_id,
            ROLE,
            common.address(server.port),
            ready=True,
            metrics_port=common.metrics_port or 0,
        )
        await stay_registered(stack, registry, lambda: info, common.heartbeat_s)
        _start_index_sweep(stack, servicer.index, registry, common.heartbeat_s)
        await server.set_serving(True)
        log.info("serving", role=ROLE, instance=instance_id, address=info.address)
        if ready is not None:
            ready.set()
        await asyncio.Future()  # until cancelled


async def sweep_index(index: PrefixIndex, registry: Registry) -> set[str]:
    """Drop the index's ranks the registry no longer lists; returns them."""
    gone = ranks_to_drop(index.ranks(), (i.instance_id for i in await registry.instances()))
    for rank_id in gone:
        index.drop(rank_id)
    return gone


async def _sweep_forever(index: PrefixIndex, registry: Registry, interval_s: float) -> None:
    while True:
        await pause(interval_s)
        try:
            gone = await sweep_index(index, registry)
        except (RedisError, OSError) as e:  # Redis restarting: the next sweep tries again
            log.warning("prefix index sweep failed", error=str(e))
            continue
        if gone:
            log.info("dropped ranks gone from the registry", ranks=sorted(gone))


def _start_index_sweep(
    stack: contextlib.AsyncExitStack, index: PrefixIndex, registry: Registry, interval_s: float
) -> None:
    """Run `sweep_index` every `interval_s` until `stack` closes."""
    stop_with(stack, _sweep_forever(index, registry, interval_s))
