"""A tiny DeepSeek-V3 config for engine unit tests (two layers: dense, then MoE; every feature on),
to be varied with overrides."""

from __future__ import annotations

from typing import Any

from pdmesh_engine.config import ModelConfig


def small_config(**overrides: Any) -> ModelConfig:
    settings: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        q_lora_rank=16,
        max_position_embeddings=128,
    )
    return ModelConfig(**{**settings, **overrides})
