"""DeepSeek-V4 as the model runner sees it: load the weights, size and allocate the cache.

The engine's block pool hands out block ids; a V4 block holds, for its `block_size` tokens, every
layer's window entry and compressor rows, and the block's compressed entries (kv.py). So a
prefix-cache hit, a preemption's recompute and a chunk boundary need nothing beyond the blocks
(the open windows' state is the rows of their tokens). The window entries and rows of tokens that
left every window are still held with their block: a separate window pool that releases them is
the next step (see the KV report at start: `KVBytes.describe`).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdmesh_engine import huge_pages
from pdmesh_engine.checkpoint import iter_tensors
from pdmesh_engine.config import EngineConfig
from pdmesh_engine.model.deepseek_v4.config import V4Config
from pdmesh_engine.model.deepseek_v4.kv import (
    V4Cache,
    check_block_size,
    default_block_size,
    kv_bytes,
)
from pdmesh_engine.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdmesh_engine.model.experts import to_row_tables

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class V4KVLayout:
    num_blocks: int
    block_size: int
    dtype: torch.dtype
    bytes_per_block: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size


def engine_config(config: V4Config, engine: EngineConfig) -> EngineConfig:
    """The engine settings V4 runs with: the model's block size unless one was given (checked),
    no speculative decoding yet."""
    if engine.speculative_method is not None:
        raise ValueError(
            "speculative decoding is not available for DeepSeek-V4 yet (its MTP layer is not "
            "loaded); run without --speculative-method"
        )
    if engine.block_size is None:
        return replace(engine, block_size=default_block_size(config))
    check_block_size(config, engine.block_size)
    return engine


def plan_kv(config: V4Config, engine: EngineConfig, dtype: torch.dtype) -> V4KVLayout:
    assert engine.block_size is not None
    size = torch.tensor([], dtype=dtype).element_size()
    per_block = V4Cache.bytes_per_block(config, engine.block_size, size)
    num_blocks = engine.num_blocks or engine.kv_cache_memory_bytes // per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory_bytes={engine.kv_cache_memory_bytes} holds fewer than 2 V4 blocks "
            f"({per_block} bytes each at block size {engine.block_size})"
        )
    return V4KVLayout(num_blocks, engine.block_size, dtype, per_block)


def allocate_kv(config: V4Config, layout: V4KVLayout, device: torch.device) -> V4Cache:
    """The cache tensors; logs what a token costs per layer kind."""
    cache = V4Cache(config, layout.num_blocks, layout.block_size, layout.dtype, device)
    size = torch.tensor([], dtype=layout.dtype).element_size()
    log.info(
        "%s; %d blocks of %d tokens, %.0f bytes per block-token as held now",
        kv_bytes(config, size).describe(config),
        layout.num_blocks,
        layout.block_size,
        layout.bytes_per_token,
    )
    huge_pages.advise_all(cache.tensors())
    return cache


@torch.no_grad()
def load_model(
    model_dir: Path, config: V4Config, device: torch.device, dtype: torch.dtype
) -> DeepseekV4ForCausalLM:
    """The checkpoint's model on `device`: matrices in `dtype`, what transformers keeps in fp32
    (hyper-connections, norms, sinks, position biases, routers) in fp32."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    model = model.to_empty(device=device)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dim() >= 2 and not _keeps_fp32(module, name):
                param.data = param.data.to(dtype)
    model.materialize()
    model.load_weights(iter_tensors(model_dir))
    if device.type == "cpu":  # the routed experts in the embedding-bag layout (experts.py)
        for moe in model.moe_experts:
            moe.w13.data, moe.w2.data = to_row_tables(moe.w13.data), to_row_tables(moe.w2.data)
        huge_pages.advise_all(itertools.chain(model.parameters(), model.buffers()))
    return model.eval()


def _keeps_fp32(module: torch.nn.Module, name: str) -> bool:
    from pdmesh_engine.model.deepseek_v4.blocks import HyperConnection, HyperHead, Router

    return isinstance(module, (HyperConnection, HyperHead, Router))
