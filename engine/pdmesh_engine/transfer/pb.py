"""`PoolLayout` ⇄ `common.v1.KVLayout` (the wire form a decode rank sends in its `KVTarget`)."""

from __future__ import annotations

from pdmesh_engine.transfer.layout import PoolLayout
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
