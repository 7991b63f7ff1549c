"""gRPC adapter of the controller: convert, call the controller state, convert."""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from pdmesh_proto.eplb.v1 import eplb_pb2, eplb_pb2_grpc


@dataclass
class ControllerView:
    """What `Status` reports: this controller's id, whether it balances, and the tracked versions."""

    instance_id: str
    enabled: bool = True
    versions: dict[tuple[str, str], int] = field(default_factory=dict)   # (instance, model) -> version


class EplbServicer(eplb_pb2_grpc.EplbServicer):
    def __init__(self, view: ControllerView) -> None:
        self.view = view

    async def Status(self, request: eplb_pb2.StatusRequest,
                     context: grpc.aio.ServicerContext) -> eplb_pb2.EplbStatus:
        models = [eplb_pb2.TrackedModel(instance=instance, model=model, placement_version=version)
                  for (instance, model), version in sorted(self.view.versions.items())]
        return eplb_pb2.EplbStatus(instance_id=self.view.instance_id, enabled=self.view.enabled, models=models)
