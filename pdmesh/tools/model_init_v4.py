"""`pdmesh model init --arch deepseek_v4`: a seeded random DeepSeek-V4 checkpoint.

Written in transformers' default `save_pretrained` layout (the release's tensor names under
`model.`, `head.weight` at the top, per-expert `w1`/`w2`/`w3`), which transformers'
`DeepseekV4ForCausalLM.from_pretrained` and the engine both load; config.json in transformers'
spelling. The multi-token-prediction layer is not written yet. Initialisation follows
model_init.py: linears N(0, 1/fan_in), embeddings N(0, 1), norms 1 + jitter, and what transformers
initialises to zero (sinks, position biases, hash tables) drawn at random, so that every part
shows in the output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdmesh.tools.model_init import (
    BIAS_STD,
    LOGIT_STD,
    ROUTER_LOGIT_STD,
    TensorSpec,
    write_json,
    write_weights,
)
from pdmesh.tools.tokenizer_train import BOS_ID, EOS_ID, tokenizer_config, train_tokenizer
from pdmesh_engine.model.deepseek_v4.config import CSA, HASH_MOE, HCA, SLIDING, V4Config

V4_PRESETS: dict[str, dict[str, Any]] = {
    # For tests: every layer kind, a hash layer, 2 streams; CSA every 4, HCA every 16 tokens.
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        layer_types=[SLIDING, CSA, HCA, CSA],
        mlp_layer_types=[HASH_MOE, "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 16},
        hc_mult=2,
        sliding_window=16,
        o_groups=2,
        o_lora_rank=32,
        index_n_heads=16,
        index_head_dim=16,
        index_topk=8,
        max_position_embeddings=4096,
    ),
    # For benchmarks: V4-Flash's proportions scaled down (window 128, CSA 4, HCA 128, 4 streams,
    # head_dim 128 with a 32-wide rope slice, 64 experts top-4, 2 hash layers).
    "small": dict(
        vocab_size=8192,
        hidden_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=12,
        num_attention_heads=8,
        head_dim=128,
        q_lora_rank=192,
        qk_rope_head_dim=32,
        n_routed_experts=64,
        num_experts_per_tok=4,
        layer_types=[SLIDING, SLIDING] + [CSA, HCA] * 5,
        mlp_layer_types=[HASH_MOE] * 2 + ["moe"] * 10,
        compress_rates={CSA: 4, HCA: 128},
        hc_mult=4,
        sliding_window=128,
        o_groups=4,
        o_lora_rank=128,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=128,
        max_position_embeddings=65536,
    ),
}


def v4_preset_config(preset: str, dtype: str) -> dict[str, Any]:
    if preset not in V4_PRESETS:
        raise ValueError(f"unknown deepseek_v4 preset {preset!r}; choose from {sorted(V4_PRESETS)}")
    p = V4_PRESETS[preset]
    rotary = p["qk_rope_head_dim"] / p["head_dim"]
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **V4_PRESETS[preset],
        "n_shared_experts": 1,
        "num_key_value_heads": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": rotary,
            },
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "beta_fast": 32,
                "beta_slow": 1,
                "attention_factor": 1.0,
                "partial_rotary_factor": rotary,
            },
        },
        "partial_rotary_factor": rotary,
        "num_nextn_predict_layers": 0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": dtype,
    }


def _linear(name: str, out_f: int, in_f: int, **kw: Any) -> TensorSpec:
    return TensorSpec(name, (out_f, in_f), "normal", std=1.0 / math.sqrt(in_f), **kw)


def _vector(name: str, shape: tuple[int, ...], std: float) -> TensorSpec:
    return TensorSpec(name, shape, "normal", std=std, fp32=True)


def _norm(name: str, dim: int) -> TensorSpec:
    return TensorSpec(name, (dim,), "norm", fp32=True)


def _compressor(p: str, c: V4Config, rate: int, dim: int, series: int) -> list[TensorSpec]:
    h = c.hidden_size
    return [
        _linear(f"{p}.wkv.weight", series * dim, h),
        _linear(f"{p}.wgate.weight", series * dim, h),
        _vector(f"{p}.ape", (rate, series * dim), 0.5),
        _norm(f"{p}.norm.weight", dim),
    ]


def _hyper(p: str, c: V4Config, rows: int) -> list[TensorSpec]:
    n = c.hc_mult
    return [
        _vector(f"{p}_fn", (rows, n * c.hidden_size), 1.0 / math.sqrt(n * c.hidden_size)),
        _vector(f"{p}_base", (rows,), 0.1),
        TensorSpec(f"{p}_scale", (3 if rows > n else 1,), "norm", fp32=True),
    ]


def v4_weight_specs(c: V4Config) -> list[TensorSpec]:
    """Every tensor, in the release's names."""
    h, n = c.hidden_size, c.hc_mult
    specs = [TensorSpec("embed.weight", (c.vocab_size, h), "normal", std=1.0)]
    for i, kind in enumerate(c.layer_types):
        p, a = f"layers.{i}", f"layers.{i}.attn"
        heads, hd = c.num_attention_heads, c.head_dim
        specs += [
            _norm(f"{p}.attn_norm.weight", h),
            _linear(f"{a}.wq_a.weight", c.q_lora_rank, h),
            _norm(f"{a}.q_norm.weight", c.q_lora_rank),
            _linear(f"{a}.wq_b.weight", heads * hd, c.q_lora_rank),
            _linear(f"{a}.wkv.weight", hd, h),
            _norm(f"{a}.norm.weight", hd),
            _linear(f"{a}.wo_a.weight", c.o_groups * c.o_lora_rank, heads * hd // c.o_groups),
            _linear(f"{a}.wo_b.weight", h, c.o_groups * c.o_lora_rank),
            _vector(f"{a}.attn_sink", (heads,), 0.5),
        ]
        if kind != SLIDING:
            specs += _compressor(f"{a}.compressor", c, c.rate(kind), hd, 2 if kind == CSA else 1)
        if kind == CSA:
            ihd = c.index_head_dim
            specs += [
                _linear(f"{a}.indexer.wq_b.weight", c.index_n_heads * ihd, c.q_lora_rank),
                _linear(f"{a}.indexer.weights_proj.weight", c.index_n_heads, h),
            ]
            specs += _compressor(f"{a}.indexer.compressor", c, c.rate(CSA), ihd, 2)
        specs += _hyper(f"{p}.hc_attn", c, (2 + n) * n) + _hyper(f"{p}.hc_ffn", c, (2 + n) * n)
        specs.append(_norm(f"{p}.ffn_norm.weight", h))
        e, width = c.n_routed_experts, c.moe_intermediate_size
        gate = f"{p}.ffn.gate"
        specs.append(_vector(f"{gate}.weight", (e, h), ROUTER_LOGIT_STD / math.sqrt(h)))
        if c.mlp_layer_types[i] == HASH_MOE:
            specs.append(
                TensorSpec(
                    f"{gate}.tid2eid", (c.vocab_size, c.num_experts_per_tok), "hash", num_experts=e
                )
            )
        else:
            specs.append(_vector(f"{gate}.bias", (e,), BIAS_STD))
        for j in range(e):
            x = f"{p}.ffn.experts.{j}"
            specs += [
                _linear(f"{x}.w1.weight", width, h, expert=True),
                _linear(f"{x}.w2.weight", h, width, expert=True),
                _linear(f"{x}.w3.weight", width, h, expert=True),
            ]
        x = f"{p}.ffn.shared_experts"
        specs += [
            _linear(f"{x}.w1.weight", width, h),
            _linear(f"{x}.w2.weight", h, width),
            _linear(f"{x}.w3.weight", width, h),
        ]
    specs += _hyper("hc_head", c, n)
    specs += [
        _norm("norm.weight", h),
        TensorSpec("head.weight", (c.vocab_size, h), "normal", std=LOGIT_STD / math.sqrt(h)),
    ]
    return specs


def hf_name(release: str) -> str:
    """The release's name -> transformers' default `save_pretrained` name."""
    if release == "head.weight":
        return release
    if release == "embed.weight":
        return "model.embed_tokens.weight"
    if release.startswith("hc_head_"):
        return "model.hc_head.hc_" + release.removeprefix("hc_head_")
    return "model." + release


def write_v4_model(
    out: Path, preset: str, seed: int, dtype: str, max_shard_bytes: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """Write config, tokenizer and weights of a random V4 preset into `out`; returns the config."""
    cfg_dict = v4_preset_config(preset, dtype)
    config = V4Config.from_dict(cfg_dict)
    write_json(out / "config.json", cfg_dict)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": True, "temperature": 1.0},
    )
    t0 = time.perf_counter()
    (out / "tokenizer.json").write_text(train_tokenizer(config.vocab_size), encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config(config.max_position_embeddings))
    log(
        f"trained byte-level BPE tokenizer (vocab {config.vocab_size}) in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    specs = [
        TensorSpec(
            hf_name(s.name),
            s.shape,
            s.init,
            s.std,
            s.source,
            s.expert,
            s.mtp,
            s.fp32,
            s.num_experts,
        )
        for s in v4_weight_specs(config)
    ]
    t0 = time.perf_counter()
    nbytes = write_weights(out, specs, seed, dtype, max_shard_bytes, log)
    total = sum(s.numel for s in specs)
    experts = sum(s.numel for s in specs if s.expert)
    active = (
        total
        - experts
        * (config.n_routed_experts - config.num_experts_per_tok)
        // config.n_routed_experts
    )
    log(
        f"wrote DeepSeek-V4 {preset!r}: {total / 1e6:.1f}M parameters "
        f"({active / 1e6:.1f}M active), {nbytes / 1e6:.0f} MB, in {time.perf_counter() - t0:.1f}s"
    )
    return cfg_dict
