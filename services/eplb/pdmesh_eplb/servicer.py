"""gRPC adapter of the controller: convert, call the `Balancer`, convert."""

from __future__ import annotations

import grpc

from pdmesh_eplb.balancer import Balancer
from pdmesh_eplb.controller import Skip
from pdmesh_eplb.convert import placement_to_pb, record_to_pb, status_to_pb
from pdmesh_proto.eplb.v1 import eplb_pb2, eplb_pb2_grpc
from pdmesh_service.errors import InvalidArgument, NotFound


def _names(instance: str, model: str = "target") -> None:
    if not instance or not model or ":" in instance or ":" in model:
        raise InvalidArgument("instance and model must be non-empty and free of ':'")


class EplbServicer(eplb_pb2_grpc.EplbServicer):
    def __init__(self, balancer: Balancer, instance_id: str = "") -> None:
        self.balancer, self.instance_id = balancer, instance_id

    async def Status(
        self, request: eplb_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.EplbStatus:
        models = [status_to_pb(s) for s in await self.balancer.status()]
        return eplb_pb2.EplbStatus(
            instance_id=self.instance_id, enabled=self.balancer.default_enabled, models=models
        )

    async def Rebalance(
        self, request: eplb_pb2.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.RebalanceResponse:
        _names(request.instance, request.model)
        outcome = await self.balancer.rebalance(
            request.instance, request.model, "manual", request.force
        )
        if isinstance(outcome, Skip):
            return eplb_pb2.RebalanceResponse(rebalanced=False, reason=outcome.reason)
        return eplb_pb2.RebalanceResponse(rebalanced=True, record=record_to_pb(outcome))

    async def SetEnabled(
        self, request: eplb_pb2.SetEnabledRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.SetEnabledResponse:
        _names(request.instance)
        await self.balancer.set_enabled(request.instance, request.enabled)
        return eplb_pb2.SetEnabledResponse(
            instance=request.instance, enabled=await self.balancer.is_enabled(request.instance)
        )

    async def GetPlacement(
        self, request: eplb_pb2.GetPlacementRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.GetPlacementResponse:
        _names(request.instance, request.model)
        placement, history = await self.balancer.placement(
            request.instance, request.model, request.version
        )
        if placement is None:
            raise NotFound(
                f"no placement version {request.version or 'current'} of "
                f"{request.instance}/{request.model}"
            )
        return placement_to_pb(placement, history)
