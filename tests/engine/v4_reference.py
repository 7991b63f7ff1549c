"""Small random `transformers.DeepseekV4ForCausalLM` models, the reference of the V4 engine.

Each configuration varies what the engine reads: every attention kind (sliding, CSA, HCA), hash
and top-k MoE layers, `hc_mult` 1 to 4, windows shorter than the prompts (and not a multiple of a
compress rate), `index_topk` below the number of compressed entries (the indexer really chooses),
yarn and plain rope. Every parameter is drawn at random (transformers initialises the sinks,
position biases and hash tables to zero, which would hide mistakes), with 16 indexer heads (with
only a few heads ReLU(q.k) is exactly zero for many entries and the top-k choice among the ties
depends on the tensor's length).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}

V4_CONFIGS: dict[str, dict[str, Any]] = {
    # one layer of each kind, a hash layer first, two streams
    "mixed": dict(
        num_hidden_layers=4,
        layer_types=[SW, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 8},
        hc_mult=2,
        sliding_window=8,
        index_topk=3,
        rope_parameters=YARN,
    ),
    # four streams, a window of 6 (no multiple of a rate), HCA at 16, two hash layers
    "wide": dict(
        num_hidden_layers=5,
        layer_types=[CSA, HCA, CSA, SW, HCA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 16},
        hc_mult=4,
        sliding_window=6,
        index_topk=5,
        o_groups=4,
        num_attention_heads=4,
        rope_parameters=YARN,
    ),
    # one stream, plain rope everywhere, CSA and HCA at the same rate, saved in transformers' own
    # module names
    "single": dict(
        num_hidden_layers=3,
        layer_types=[HCA, CSA, CSA],
        mlp_layer_types=["moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 4},
        hc_mult=1,
        sliding_window=12,
        index_topk=4,
        num_experts_per_tok=3,
    ),
}
_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=2,
    head_dim=32,
    q_lora_rank=32,
    num_experts_per_tok=2,
    n_routed_experts=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=16,
    index_head_dim=16,
    qk_rope_head_dim=8,
    max_position_embeddings=4096,
    hc_sinkhorn_iters=20,
    eos_token_id=1,
)


@dataclass(frozen=True)
class V4Reference:
    name: str
    path: Path
    model: Any  # transformers' DeepseekV4ForCausalLM, fp32, eval mode


def build_v4_reference(name: str, directory: Path, seed: int) -> V4Reference:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**{**_COMMON, **V4_CONFIGS[name]})
    model = DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.5 if param.dim() < 2 else 0.15)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("tid2eid"):
                # distinct experts per token, as a real table has
                perm = torch.rand(buffer.shape[0], config.n_routed_experts).argsort(dim=-1)
                buffer.copy_(perm[:, : buffer.shape[1]])
            elif buffer_name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(
        directory, **({"save_original_format": False} if name == "single" else {})
    )
    return V4Reference(name, directory, model)
