"""DeepSeek-V4 as the model runner sees it: load the weights, size and allocate the cache.

Two pools (pdmesh_engine.kv_window): the full pool's blocks hold the compressed entries, for the
whole context; the window pool's blocks hold every layer's window entry and compressor rows, and
a request holds them only for the last `V4Config.window_span` positions and the step's chunk (the
open windows' state is the rows of their tokens, so a chunk boundary needs nothing more). The
window pool is sized for every running request plus one step's tokens plus a retention margin
(window blocks kept for prefix hits); the full pool gets the rest of the memory. A DEP rank keeps
the last block of each pool as the scratch its dummy passes write (`make_kv_manager`).

Speculative decoding (`speculative_method="mtp"`, pdmesh_engine.spec_proposer `V4MTPProposer`):
the checkpoint's MTP layer is loaded beside the model, and its own state, the K=V entries of its
sliding-window block, is a third tensor of window-pool blocks (`[1, num_window_blocks, B,
head_dim]`), addressed by the same window tables: its bytes per block are added to the window
pool's when sizing it, and the hand-off moves it as a further KV group (`draft`, on the `window`
table, with the window's span). The window manager reads a request's next start from its last
allocation, which reaches past the step's verified tokens by the drafts and the lookahead (up to
2K - 1 positions a step may not keep), so it keeps that many positions more behind each step
(`spec_slack`). A draft model is not supported on V4.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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


def spec_slack(engine: EngineConfig) -> int:
    """Positions a request's last allocation may reach past where its next step starts: K drafts
    verified (all but none rejected) and K - 1 lookahead positions; 0 without speculation."""
    k = engine.num_spec_tokens
    return 2 * k - 1 if k else 0


def num_window_blocks(config: V4Config, engine: EngineConfig) -> int:
    """NULL + every running request's window (with the speculation slack) + one step's chunk of
    tokens + as many again as the windows for retention (prefix hits)."""
    assert engine.block_size is not None
    window = -(-(config.window_span + spec_slack(engine)) // engine.block_size) + 1
    chunk = -(-engine.max_num_batched_tokens // engine.block_size)
    return 1 + 2 * engine.max_num_seqs * window + chunk


def engine_config(config: V4Config, engine: EngineConfig) -> EngineConfig:
    """The engine settings V4 runs with: the model's block size unless one was given (checked);
    speculative decoding by the MTP layer only."""
    if engine.speculative_method == "draft_model":
        raise ValueError(
            "speculative_method 'draft_model' is not available for DeepSeek-V4 (a draft model's "
            "V4 state is not kept); use speculative_method='mtp', the checkpoint's MTP layer"
        )
    if engine.block_size is None:
        return replace(engine, block_size=default_block_size(config))
    check_block_size(config, engine.block_size)
    return engine


def plan_kv(
    config: V4Config,
    engine: EngineConfig,
    dtype: torch.dtype,
    extra_bytes_per_window_block: int = 0,
) -> V4KVLayout:
    """The window pool first (`num_window_blocks`; a block also pays for a proposer's
    `extra_bytes_per_window_block`), the full pool from the rest of `kv_cache_memory_bytes` (or
    `num_blocks` when given)."""
    assert engine.block_size is not None
    size = torch.tensor([], dtype=dtype).element_size()
    per_block, per_window_block = V4Cache.block_bytes(config, engine.block_size, size)
    per_window_block += extra_bytes_per_window_block
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
        config.window_span + spec_slack(engine),
    )


def make_kv_manager(
    layout: V4KVLayout,
    enable_caching: bool,
    recompute_last_hit: bool = False,
    num_blocks: int | None = None,
) -> WindowedKVManager:
    """The manager of both pools. `num_blocks` below the layout's: the runner keeps the full
    pool's last block as its scratch (`ModelRunner.scratch_block`, DEP's dummy passes), and the
    window pool's last block with it (`ModelRunner.scratch_window_block`): neither is handed to a
    request."""
    num_blocks = layout.num_blocks if num_blocks is None else num_blocks
    return WindowedKVManager(
        num_blocks,
        layout.num_window_blocks - (layout.num_blocks - num_blocks),
        layout.block_size,
        layout.span,
        enable_caching,
        recompute_last_hit,
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
    model_dir: Path,
    config: V4Config,
    device: torch.device,
    dtype: torch.dtype,
    load_mtp: bool = False,
    model_kwargs: dict[str, Any] | None = None,
) -> DeepseekV4ForCausalLM:
    """The checkpoint's model on `device` (its first MTP layer too with `load_mtp`): matrices in
    `dtype`, what transformers keeps in fp32 (hyper-connections, norms, sinks, position biases,
    routers) in fp32. `model_kwargs` go to `DeepseekV4ForCausalLM` (DEP: placements, this rank's
    slots, the dispatcher); each routed expert is read into the local slots that hold it."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, load_mtp, **(model_kwargs or {}))
    model = model.to_empty(device=device)
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dim() >= 2 and not _keeps_fp32(module, name):
                param.data = param.data.to(dtype)
    for moe in model.moe_experts:  # the placements' tables on the experts' device
        moe.set_placement(moe.placement)
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
        self.load_mtp = False  # set by `engine_config`: the engine speculates with the MTP layer

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """`engine_config`; also decides whether `load` loads the MTP layer."""
        config = engine_config(self.model_config, config)
        self.load_mtp = config.speculative_method == "mtp"
        return config

    def load(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        model_kwargs: dict[str, Any],
    ) -> DeepseekV4ForCausalLM:
        """`model_kwargs`: DEP's (`DEPContext.model_kwargs`), empty on a single rank."""
        return load_model(model_dir, self.model_config, device, dtype, self.load_mtp, model_kwargs)

    def plan_kv(
        self, config: EngineConfig, dtype: torch.dtype, extra_bytes_per_block: int
    ) -> V4KVLayout:
        """`extra_bytes_per_block`: the proposer's, per window-pool block (module docstring)."""
        return plan_kv(self.model_config, config, dtype, extra_bytes_per_block)

    def make_kv_manager(
        self, layout: V4KVLayout, num_blocks: int, enable_caching: bool, recompute_last_hit: bool
    ) -> WindowedKVManager:
        return make_kv_manager(layout, enable_caching, recompute_last_hit, num_blocks)

    def allocate_kv(self, layout: V4KVLayout, device: torch.device) -> V4Cache:
        return allocate_kv(self.model_config, layout, device)

    def kv_memory(self, kv: V4Cache, draft: torch.Tensor | None) -> list[KVMemory]:
        """The hand-off's KV groups: `full` and `window` (`V4Cache.memory`), and the MTP layer's
        window entries (`draft`) on the window table, over the window group's span."""
        groups = kv.memory()
        if draft is None:
            return groups
        return [*groups, KVMemory("draft", (draft,), span=kv.window_span + 1, table="window")]
