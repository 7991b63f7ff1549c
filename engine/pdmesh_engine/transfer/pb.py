"""`PoolLayout` ⇄ `common.v1.KVLayout`, `KVGroup` ⇄ `common.v1.KVGroup` (the wire form a decode
rank sends in its `KVTarget`)."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh_engine.transfer.layout import KVGroup, PoolLayout
from pdmesh_proto.common.v1 import common_pb2


def layout_to_pb(layout: PoolLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        base_address=layout.base_address,
        num_layers=layout.num_layers,
        num_blocks=layout.num_blocks,
        block_size=layout.block_size,
        block_bytes=layout.block_bytes,
        layer_stride_bytes=layout.layer_stride_bytes,
        device_id=layout.device_id,
        memory_type=layout.memory_type,
    )


def layout_from_pb(msg: common_pb2.KVLayout) -> PoolLayout:
    """Raises ValueError for an empty or inconsistent layout."""
    return PoolLayout(
        base_address=msg.base_address,
        num_layers=msg.num_layers,
        num_blocks=msg.num_blocks,
        block_size=msg.block_size,
        block_bytes=msg.block_bytes,
        layer_stride_bytes=msg.layer_stride_bytes,
        device_id=msg.device_id,
        memory_type=msg.memory_type or "DRAM",
    )


def group_to_pb(group: KVGroup, block_ids: Sequence[int] = ()) -> common_pb2.KVGroup:
    return common_pb2.KVGroup(
        name=group.name,
        pools=[layout_to_pb(p) for p in group.pools],
        block_ids=list(block_ids),
        span=group.span,
        block_size=group.block_size,
    )


def group_from_pb(msg: common_pb2.KVGroup) -> tuple[KVGroup, tuple[int, ...]]:
    """(the group, its block ids); ValueError for an inconsistent group or an id outside it."""
    pools = tuple(layout_from_pb(p) for p in msg.pools)
    group = KVGroup(msg.name, pools, msg.span, msg.block_size)
    group.pools[0].check_block_ids(msg.block_ids, f"KV group {msg.name!r} block")
    return group, tuple(msg.block_ids)
