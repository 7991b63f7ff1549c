"""eplb_protocol / controller dataclasses ⇄ eplb.proto messages (no logic)."""

from __future__ import annotations

from pdmesh_proto.eplb.v1 import eplb_pb2
from pdmesh_service.eplb_protocol import EplbSummary, Placement, RebalanceRecord


def record_to_pb(r: RebalanceRecord) -> eplb_pb2.RebalanceRecord:
    return eplb_pb2.RebalanceRecord(
        version=r.version,
        created_ms=r.created_ms,
        reason=r.reason,
        num_slots_moved=r.num_slots_moved,
        num_bytes_moved=r.num_bytes_moved,
        balancedness_before=r.balancedness_before,
        balancedness_after=r.balancedness_after,
        plan_ms=r.plan_ms,
    )


def status_to_pb(s: EplbSummary) -> eplb_pb2.TrackedModel:
    ranks = [
        eplb_pb2.RankVersion(
            rank=r.rank,
            running_version=r.running_version,
            staged_version=r.staged_version,
            step=r.step,
        )
        for r in s.reports
    ]
    first = s.reports[0] if s.reports else None
    out = eplb_pb2.TrackedModel(
        instance=s.instance,
        model=s.model,
        placement_version=s.version,
        ranks=ranks,
        balancedness=s.balancedness or 0.0,
        has_balancedness=s.balancedness is not None,
        enabled=s.is_enabled,
    )
    if first is not None:
        out.num_layers, out.num_slots = first.num_layers, first.num_slots
        out.num_logical, out.num_ranks = first.num_logical, first.dp_size
    if s.last_rebalance is not None:
        out.last_rebalance.CopyFrom(record_to_pb(s.last_rebalance))
    return out


def placement_to_pb(p: Placement, history: list[RebalanceRecord]) -> eplb_pb2.GetPlacementResponse:
    layers = [eplb_pb2.LayerSlots(logical=row) for row in p.physical_to_logical]
    return eplb_pb2.GetPlacementResponse(
        instance=p.instance,
        model=p.model,
        version=p.version,
        num_ranks=p.num_ranks,
        layers=layers,
        created_ms=p.created_ms,
        history=[record_to_pb(r) for r in history],
    )
