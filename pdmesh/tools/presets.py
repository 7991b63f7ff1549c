"""The model presets: DeepSeek-V3 hyper-parameters by name, and the `config.json` each one writes.

Random presets (`tiny`, `tiny-draft`, `small`) are initialised by `pdmesh model init`
(model_init.py); trained presets (`coder`, `coder-draft`) are what `pdmesh model train` trains, and
their trained checkpoints are embedded in pdmesh-engine (`pdmesh_engine.checkpoint`).
"""

from __future__ import annotations

from typing import Any

from pdmesh.tools.tokenizer_train import BOS_ID, EOS_ID
from pdmesh_engine.checkpoint import DTYPES
from pdmesh_engine.config import ModelConfig

_COMMON = dict(
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_interleave=True,
    num_nextn_predict_layers=1,
)

PRESETS: dict[str, dict[str, Any]] = {
    # For tests: ~0.4M parameters, 3 MoE layers of 8 experts (top-2 from 1 of 2 groups).
    "tiny": dict(
        _COMMON,
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=2048,
    ),
    # For speculative-decoding tests: a draft for `tiny` (same tokenizer, another MoE shape:
    # 4 experts top-1, 2 layers, no MTP layer).
    "tiny-draft": dict(
        _COMMON,
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=2048,
        num_nextn_predict_layers=0,
    ),
    # The trained default (`pdmesh model train --preset coder`, see models/): ~4.7M parameters
    # active per token, 4 MoE layers of 24 experts (top-4 from 2 of 4 groups), trained on the
    # standard library's Python sources with a source-code tokenizer (vocab 4096).
    "coder": dict(
        _COMMON,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        n_routed_experts=24,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=2048,
    ),
    # Its draft model: the same tokenizer, another MoE shape (8 experts top-2, 2 layers), no MTP.
    "coder-draft": dict(
        _COMMON,
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=2048,
        num_nextn_predict_layers=0,
    ),
    # For benchmarks: ~157M parameters, ~28M active per token; 11 MoE layers of 64 fine-grained
    # experts (top-4 from 4 of 8 groups, DeepSeek-V3's ratios), MLA with a 128+32 latent cache.
    "small": dict(
        _COMMON,
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=128,
        num_hidden_layers=12,
        num_attention_heads=8,
        n_routed_experts=64,
        num_experts_per_tok=4,
        n_group=8,
        topk_group=4,
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=4096,
    ),
}


# Presets whose weights were trained (`pdmesh model train`); `init_model` copies the embedded ones
# (coder-v4: DeepSeek-V4, the default model; coder and its draft: DeepSeek-V3).
TRAINED_ARCH = {"coder-v4": "deepseek_v4", "coder": "deepseek_v3", "coder-draft": "deepseek_v3"}
TRAINED_PRESETS = tuple(TRAINED_ARCH)


def preset_config(preset: str, dtype: str = "float32") -> dict[str, Any]:
    """The full `config.json` dict of a preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPES)}")
    p = PRESETS[preset]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **p,
        "num_key_value_heads": p["num_attention_heads"],
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": p["rope_theta"]},
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def preset_model_config(preset: str) -> ModelConfig:
    return ModelConfig.from_dict(preset_config(preset))
