"""`pdmesh serve eplb`: the EPLB controller (wiring only; see `balancer`, `controller` and
`planner`).

Start: connect Redis → gRPC server (health NOT_SERVING) → publish `InstanceInfo(role="eplb")`, then
heartbeat it → the balancing loop (every `--poll-s`) → health SERVING → `ready` set. Cancelled: loop
stopped, heartbeat stopped, registry entry removed, health NOT_SERVING and server stopped, Redis
closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass, field

from pdmesh_eplb.balancer import Balancer
from pdmesh_eplb.controller import Policy
from pdmesh_eplb.metrics import default_metrics
from pdmesh_eplb.servicer import EplbServicer
from pdmesh_proto.eplb.v1 import eplb_pb2_grpc
from pdmesh_service.grpc_server import MeshAuth, start_grpc_server
from pdmesh_service.logging import get_logger
from pdmesh_service.options import CommonConfig, add_common_arguments, common_from_args
from pdmesh_service.registry import InstanceInfo, Registry, Role, connect, stay_registered
from pdmesh_service.tasks import stop_with

log = get_logger(__name__)
ROLE = Role.EPLB
SERVICE_NAME = "pdmesh.eplb.v1.Eplb"


@dataclass(frozen=True)
class EplbConfig:
    common: CommonConfig
    enabled: bool = True  # default of every instance's switch (`--no-rebalance`: off)
    policy: Policy = field(default_factory=Policy)
    poll_s: float = 1.0  # how often the tracked (instance, model) pairs are checked

    def __post_init__(self) -> None:
        if self.poll_s <= 0:
            raise ValueError(f"--poll-s must be positive, got {self.poll_s}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    g = parser.add_argument_group("eplb")
    g.add_argument(
        "--no-rebalance",
        action="store_true",
        help="instances start with rebalancing off (SetEnabled turns it on per instance)",
    )
    g.add_argument(
        "--eplb-window-steps",
        type=int,
        default=1000,
        help="steps the loads cover; a version runs this long before it is re-planned",
    )
    g.add_argument(
        "--eplb-step-interval", type=int, default=3000, help="steps between periodic rebalances"
    )
    g.add_argument(
        "--eplb-min-gain",
        type=float,
        default=0.01,
        help="least rise in window balancedness worth a new version",
    )
    g.add_argument(
        "--eplb-move-budget",
        type=float,
        default=0.2,
        help="fraction of a layer's slots one rebalance may rewrite",
    )
    g.add_argument(
        "--poll-s", type=float, default=1.0, help="seconds between checks of the tracked instances"
    )


def config_from_args(args: argparse.Namespace) -> EplbConfig:
    policy = Policy(
        window_steps=args.eplb_window_steps,
        step_interval=args.eplb_step_interval,
        min_gain=args.eplb_min_gain,
        move_budget=args.eplb_move_budget,
    )
    return EplbConfig(
        common_from_args(args), enabled=not args.no_rebalance, policy=policy, poll_s=args.poll_s
    )


async def serve(config: EplbConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled; `ready` is set once requests are served and the registry lists us."""
    common = config.common
    redis = connect(common.redis_url)
    registry = Registry(redis, common.deployment)
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(redis.aclose)
        balancer = Balancer(
            redis,
            common.deployment,
            config.policy,
            default_metrics(),
            default_enabled=config.enabled,
        )
        servicer = EplbServicer(balancer)
        server = await start_grpc_server(
            common.host,
            common.port,
            [lambda s: eplb_pb2_grpc.add_EplbServicer_to_server(servicer, s)],
            [SERVICE_NAME],
            auth=MeshAuth.from_config(common),
        )
        stack.push_async_callback(server.stop)
        instance_id = servicer.instance_id = common.instance(ROLE, server.port)
        info = InstanceInfo(
            instance_id,
            ROLE,
            common.address(server.port),
            ready=True,
            metrics_port=common.metrics_port or 0,
        )
        await stay_registered(stack, registry, lambda: info, common.heartbeat_s)
        stop_with(stack, balancer.run(config.poll_s))
        await server.set_serving(True)
        log.info(
            "serving", role=ROLE, instance=instance_id, address=info.address, enabled=config.enabled
        )
        if ready is not None:
            ready.set()
        await asyncio.Future()  # until cancelled
