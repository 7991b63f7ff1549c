"""`pdmesh serve eplb`: the EPLB controller (wiring only; see `servicer` and `planner`).

Start: connect Redis → gRPC server (health NOT_SERVING) → publish `InstanceInfo(role="eplb")`, then
heartbeat it → health SERVING → `ready` set. Cancelled: heartbeat stopped, registry entry removed,
health NOT_SERVING and server stopped, Redis closed (in that order).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass

from pdmesh_eplb.servicer import ControllerView, EplbServicer
from pdmesh_proto.eplb.v1 import eplb_pb2_grpc
from pdmesh_service.grpc_server import start_grpc_server
from pdmesh_service.logging import get_logger
from pdmesh_service.options import CommonConfig, add_common_arguments, common_from_args
from pdmesh_service.registry import InstanceInfo, Registry, connect, stay_registered

log = get_logger(__name__)
ROLE = "eplb"
SERVICE_NAME = "pdmesh.eplb.v1.Eplb"


@dataclass(frozen=True)
class EplbConfig:
    common: CommonConfig
    enabled: bool = True                 # periodic rebalancing on (`--no-rebalance` turns it off)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    g = parser.add_argument_group("eplb")
    g.add_argument("--no-rebalance", action="store_true", help="track placements but never rebalance by itself")


def config_from_args(args: argparse.Namespace) -> EplbConfig:
    return EplbConfig(common_from_args(args), enabled=not args.no_rebalance)


async def serve(config: EplbConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled; `ready` is set once requests are served and the registry lists us."""
    common = config.common
    redis = connect(common.redis_url)
    registry = Registry(redis, common.deployment)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(redis.aclose)
        view = ControllerView(instance_id="", enabled=config.enabled)
        servicer = EplbServicer(view)
        server = await start_grpc_server(
            common.host, common.port, [lambda s: eplb_pb2_grpc.add_EplbServicer_to_server(servicer, s)],
            [SERVICE_NAME])
        stack.push_async_callback(server.stop)
        instance_id = view.instance_id = common.instance(ROLE, server.port)
        info = InstanceInfo(instance_id, ROLE, common.address(server.port), ready=True)
        await stay_registered(stack, registry, lambda: info, common.heartbeat_s)
        await server.set_serving(True)
        log.info("serving", role=ROLE, instance=instance_id, address=info.address)
        if ready is not None:
            ready.set()
        await asyncio.Future()           # until cancelled
