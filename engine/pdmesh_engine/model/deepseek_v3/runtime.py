"""DeepSeek-V3 as the model runner sees it: load the weights, size and allocate the KV pool.

One pool `[num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` holds the MLA
latent and rope key of every cached token; the speculative proposer's own pool (if any) shares its
block ids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pdmesh_engine import huge_pages
from pdmesh_engine.checkpoint import iter_tensors
from pdmesh_engine.config import EngineConfig, ModelConfig
from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_engine.model.deepseek_v3.cpu_path import use_cpu_layouts
from pdmesh_engine.model.deepseek_v3.model import DeepseekV3ForCausalLM
from pdmesh_engine.transfer.layout import KVMemory
from pdmesh_kernels import uses_triton


def allocate_kv_memory(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    entry_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The KV pool's memory: [num_layers, num_blocks, block_size, entry_dim], zeroed, contiguous
    (`huge_pages.zeros`)."""
    return huge_pages.zeros((num_layers, num_blocks, block_size, entry_dim), dtype, device)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    entry_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.entry_dim * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def plan_kv_layout(
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: torch.dtype,
    extra_bytes_per_block: int = 0,
) -> KVLayout:
    """The target's KV pool; `extra_bytes_per_block`: what a block costs besides (a speculative
    proposer's own cache, addressed by the same block ids) within `kv_cache_memory_bytes`."""
    probe = KVLayout(
        model_config.num_hidden_layers, 1, config.block_size, model_config.kv_cache_dim, dtype
    )
    num_blocks = config.num_blocks or config.kv_cache_memory_bytes // (
        probe.bytes_per_block + extra_bytes_per_block
    )
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no block "
            f"({probe.bytes_per_block} bytes each)"
        )
    return KVLayout(probe.num_layers, num_blocks, config.block_size, probe.entry_dim, dtype)


def load_model(
    model_dir: Path,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    model_kwargs: dict[str, Any] | None = None,
    load_mtp: bool = True,
) -> DeepseekV3ForCausalLM:
    """A checkpoint's model on `device` in `dtype` (routing in fp32), ready to run."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(model_config, load_mtp=load_mtp, **(model_kwargs or {}))
    model = model.to_empty(device=device).to(dtype)
    for layer in model.moe_layers:  # routing stays in fp32, as the reference keeps it
        layer.gate.float()
        layer.set_placement(layer.placement)
    model.rope.materialize(model_config)  # computed buffers, not checkpoint tensors
    model.load_weights(iter_tensors(model_dir))
    if device.type == "cpu" and not uses_triton(device):  # else the CUDA path (`force_triton`)
        path = use_cpu_layouts(model)
        copies = path.tensors() if path is not None else ()
        huge_pages.advise_all(itertools.chain(model.parameters(), model.buffers(), copies))
    model.eval()
    return model


class V3Family:
    """DeepSeek-V3 as the model runner sees it (the functions above)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config

    def engine_config(self, config: EngineConfig) -> EngineConfig:
        return config if config.block_size is not None else replace(config, block_size=16)

    def load(
        self,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        model_kwargs: dict[str, Any],
    ) -> DeepseekV3ForCausalLM:
        return load_model(model_dir, self.model_config, device, dtype, model_kwargs)

    def plan_kv(
        self, config: EngineConfig, dtype: torch.dtype, extra_bytes_per_block: int
    ) -> KVLayout:
        return plan_kv_layout(self.model_config, config, dtype, extra_bytes_per_block)

    def make_kv_manager(
        self, layout: KVLayout, num_blocks: int, enable_caching: bool, recompute_last_hit: bool
    ) -> KVCacheManager:
        return KVCacheManager(num_blocks, layout.block_size, enable_caching, recompute_last_hit)

    def kv_memory(self, kv: torch.Tensor, draft: torch.Tensor | None) -> list[KVMemory]:
        """The hand-off's KV groups: the pool (`kv`), and a speculative proposer's (`draft`),
        addressed by the same block table."""
        groups = [KVMemory("kv", (kv,))]
        return groups if draft is None else [*groups, KVMemory("draft", (draft,), table="kv")]

    def allocate_kv(self, layout: KVLayout, device: torch.device) -> torch.Tensor:
        return allocate_kv_memory(
            layout.num_layers,
            layout.num_blocks,
            layout.block_size,
            layout.entry_dim,
            layout.dtype,
            device,
        )
