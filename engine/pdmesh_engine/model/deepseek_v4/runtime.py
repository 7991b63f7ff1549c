"""DeepSeek-V4 as the model runner sees it: load the weights, size and allocate the cache.

Two pools (pdmesh_engine.kv_window): the full pool's blocks hold the compressed entries, for the
whole context; the window pool's blocks hold every layer's window entry and compressor rows, and
a request holds them only for the last `V4Config.window_span` positions and the step's chunk (the
open windows' state is the rows of their tokens, so a chunk boundary needs nothing more). The
window pool is sized for every running request plus one step's tokens plus a retention margin
(window blocks kept for prefix hits); the full pool gets the rest of the memory.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdmesh_engine import huge_pages
from pdmesh_engine.config import EngineConfig
from pdmesh_engine.kv_window import WindowedKVManager
from pdmesh_engine.model.deepseek_v4.config import V4Config
from pdmesh_engine.model.deepseek_v4.kv import (
    V4Cache,
    check_block_size,
    default_block_size,
    kv_bytes,
)
from pdmesh_engine.model.deepseek_v4.model import DeepseekV4ForCausalLM
from pdmesh_engine.model.deepseek_v4.quant import iter_v4_tensors
from pdmesh_engine.model.experts import to_row_tables
from pdmesh_engine.transfer.layout import KVMemory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class V4KVLayout:
    num_blocks: int  # full pool
    num_window_blocks: int
    block_size: int
    dtype: torch.dtype
    bytes_per_block: int  # one full-pool block
    bytes_per_window_block: int
    span: int  # positions before a step's first token that it reads (window pool)

    @property
    def bytes_per_token(self) -> float:
        """What a token of context costs (the full pool: its share of the compressed entries)."""
        return self.bytes_per_block / self.block_size


def num_window_blocks(config: V4Config, engine: EngineConfig) -> int:
    """NULL + every running request's window + one step's chunk of tokens + as many again as
    the windows for retention (prefix hits)."""
    assert engine.block_size is not None
    window = -(-config.window_span // engine.block_size) + 1
    chunk = -(-engine.max_num_batched_tokens // engine.block_size)
    return 1 + 2 * engine.max_num_seqs * window + chunk


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
    """The window pool first (`num_window_blocks`), the full pool from the rest of
    `kv_cache_memory_bytes` (or `num_blocks` when given)."""
    assert engine.block_size is not None
    size = torch.tensor([], dtype=dtype).element_size()
    per_block, per_window_block = V4Cache.block_bytes(config, engine.block_size, size)
    windows = num_window_blocks(config, engine)
    left = engine.kv_cache_memory_bytes - windows * per_window_block
    num_blocks = engine.num_blocks or max(left, 0) // per_block
    if num_blocks < 2:
        raise ValueError(
            f"kv_cache_memory_bytes={engine.kv_cache_memory_bytes} holds fewer than 2 V4 blocks "
            f"after the window pool ({windows} x {per_window_block} bytes; a full block is "
            f"{per_block} bytes at block size {engine.block_size})"
        )
    return V4KVLayout(
        num_blocks,
        windows,
        engine.block_size,
        dtype,
        per_block,
        per_window_block,
        config.window_span,
    )


def make_kv_manager(layout: V4KVLayout, enable_caching: bool) -> WindowedKVManager:
    return WindowedKVManager(
        layout.num_blocks, layout.num_window_blocks, layout.block_size, layout.span, enable_caching
    )


def allocate_kv(config: V4Config, layout: V4KVLayout, device: torch.device) -> V4Cache:
    """The cache tensors; logs what a token costs per layer kind."""
    cache = V4Cache(
        config,
        layout.num_blocks,
        layout.block_size,
        layout.dtype,
        device,
        layout.num_window_blocks,
    )
    size = torch.tensor([], dtype=layout.dtype).element_size()
    log.info(
        "%s; pools of %d tokens per block: %d full blocks (%d bytes each), %d window blocks "
        "(%d bytes each)",
        kv_bytes(config, size).describe(config),
        layout.block_size,
        layout.num_blocks,
        layout.bytes_per_block,
        layout.num_window_blocks,
        layout.bytes_per_window_block,
    )
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
    model.load_weights(iter_v4_tensors(model_dir, dtype))
    if device.type == "cpu":  # the routed experts in the embedding-bag layout (experts.py)
        for moe in model.moe_experts:
            moe.w13.data, moe.w2.data = to_row_tables(moe.w13.data), to_row_tables(moe.w2.data)
        huge_pages.advise_all(itertools.chain(model.parameters(), model.buffers()))
    return model.eval()


def _keeps_fp32(module: torch.nn.Module, name: str) -> bool:
    from pdmesh_engine.model.deepseek_v4.blocks import HyperConnection, HyperHead, Router

    return isinstance(module, (HyperConnection, HyperHead, Router))


class V4Family:
    """DeepSeek-V4 as the model runner sees it (the functions above; the runner's interface is
    V3Family's)."""

    def __init__(self, model_config: V4Config) -> None:
        self.model_config = model_config

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        return engine_config(self.model_config, config)

    def load(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        model_kwargs: dict[str, object],
    ) -> DeepseekV4ForCausalLM:
        if model_kwargs:
            raise ValueError("DeepSeek-V4 does not run under DEP yet")
        return load_model(model_dir, self.model_config, device, dtype)

    def plan_kv(
        self, config: EngineConfig, dtype: torch.dtype, extra_bytes_per_block: int
    ) -> V4KVLayout:
        return plan_kv(self.model_config, config, dtype)

    def make_kv_manager(
        self, layout: V4KVLayout, num_blocks: int, enable_caching: bool, recompute_last_hit: bool
    ) -> WindowedKVManager:
        return make_kv_manager(layout, enable_caching)

    def allocate_kv(self, layout: V4KVLayout, device: torch.device) -> V4Cache:
        return allocate_kv(self.model_config, layout, device)

    def kv_memory(self, kv: V4Cache, draft: torch.Tensor | None) -> list[KVMemory]:
        if draft is not None:
            raise ValueError("speculative decoding does not run on DeepSeek-V4 yet")
        return kv.memory()
