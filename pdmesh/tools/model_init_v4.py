"""`pdmesh model init --arch deepseek_v4`: a seeded random DeepSeek-V4 checkpoint.

Two layouts (`--format`):

- hf (default): transformers' default `save_pretrained` layout (the release's tensor names under
  `model.`, `head.weight` at the top, per-expert `w1`/`w2`/`w3`), which transformers'
  `DeepseekV4ForCausalLM.from_pretrained` and the engine both load; config.json in transformers'
  spelling, weights in `--dtype`; no multi-token-prediction layer.
- official: the DeepSeek release's own (`release_storage`): bare release names, FP8 e4m3 dense
  projections with ue8m0 128x128 block scales (`X.scale`), MXFP4 routed experts (int8 pairs of
  e2m1 codes, ue8m0 scales per 32), the rest BF16 or F32 as the release stores them, one MTP
  layer `mtp.0.*`, and config.json in the release's spelling (`release_config`), which llama.cpp's
  converter reads.

Initialisation follows model_init.py: linears N(0, 1/fan_in), embeddings N(0, 1), norms
1 + jitter, and what transformers initialises to zero (sinks, position biases, hash tables) drawn at
random, so that every part shows in the output.

`expert_skew` s > 0 (hf layout) then makes expert popularity follow the same Zipf law as V3's
(expert_skew.py: target pick frequencies `zipf_frequencies`, a seeded ranking per layer from
`expert_ranking` with one group, as V4's router has no groups), in both kinds of MoE layer:
  * hash layers: the frozen `tid2eid` is rebuilt so that exactly round(f_e·V) of the V token ids
    pick expert e (`skewed_hash_table`); a token's experts are then as popular as its id is
    frequent, so over uniformly drawn ids the loads follow the targets exactly;
  * top-k layers: the router `bias` (routing-only, as V3's correction bias) is fitted to the
    targets on the router's real inputs, captured from prefill over the calibration text in the
    engine, SKEW_ROUNDS capture-and-fit passes as V3's (`fit_topk_bias`).
0 leaves the checkpoint byte-identical to an unskewed one.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pdmesh.tools.expert_skew import (
    SKEW_MAX_BIAS,
    SKEW_RATE,
    SKEW_REFIT_STEPS,
    SKEW_ROUNDS,
    SKEW_STEPS,
    calibration_prompts,
    expert_ranking,
    layer_generator,
    zipf_frequencies,
)
from pdmesh.tools.tokenizer_train import BOS_ID, EOS_ID, tokenizer_config, train_tokenizer
from pdmesh.tools.weight_files import (
    BIAS_STD,
    LOGIT_STD,
    ROUTER_LOGIT_STD,
    TensorSpec,
    make_tensor,
    write_json,
    write_weights,
)
from pdmesh_engine.model.deepseek_v4.config import CSA, HASH_MOE, HCA, SLIDING, TOPK_MOE, V4Config
from pdmesh_engine.model.deepseek_v4.quant import fp8_block_quantize, mxfp4_quantize

FORMATS = ("hf", "official")

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
    # What `pdmesh model train --arch deepseek_v4` trains by default: the V3 `coder` tokenizer
    # size, every layer kind (2 sliding with hash routing, then CSA and HCA), 4 streams, window
    # 64, CSA every 4 tokens, HCA every 64 (a 256-token training sequence spans 4 HCA windows),
    # 16 experts of width 64, top-4, and one MTP module: 10.2M parameters with the MTP module
    # (5.4M active per token without it, 2.1M of them the embedding and head), about 20 MB in
    # bf16.
    "coder-v4": dict(
        vocab_size=4096,
        hidden_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=128,
        qk_rope_head_dim=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, HCA],
        mlp_layer_types=[HASH_MOE] * 2 + ["moe"] * 4,
        compress_rates={CSA: 4, HCA: 64},
        hc_mult=4,
        sliding_window=64,
        o_groups=2,
        o_lora_rank=128,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=16,
        max_position_embeddings=4096,
        num_nextn_predict_layers=1,
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


def _block_specs(p: str, c: V4Config, kind: str, mlp: str) -> list[TensorSpec]:
    """One decoder block under prefix `p` (`layers.N` or `mtp.K`): `kind` attention, `mlp` MoE."""
    h, n = c.hidden_size, c.hc_mult
    a, heads, hd = f"{p}.attn", c.num_attention_heads, c.head_dim
    specs = [
        _norm(f"{p}.attn_norm.weight", h),
        _linear(f"{a}.wq_a.weight", c.q_lora_rank, h),
        _norm(f"{a}.q_norm.weight", c.q_lora_rank),
        _linear(f"{a}.wq_b.weight", heads * hd, c.q_lora_rank),
        _linear(f"{a}.wkv.weight", hd, h),
        _norm(f"{a}.kv_norm.weight", hd),
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
    if mlp == HASH_MOE:
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
    return specs + [
        _linear(f"{x}.w1.weight", width, h),
        _linear(f"{x}.w2.weight", h, width),
        _linear(f"{x}.w3.weight", width, h),
    ]


def v4_weight_specs(c: V4Config) -> list[TensorSpec]:
    """Every tensor of the main model, in the release's names."""
    h, n = c.hidden_size, c.hc_mult
    specs = [TensorSpec("embed.weight", (c.vocab_size, h), "normal", std=1.0)]
    for i, kind in enumerate(c.layer_types):
        specs += _block_specs(f"layers.{i}", c, kind, c.mlp_layer_types[i])
    specs += _hyper("hc_head", c, n)
    specs += [
        _norm("norm.weight", h),
        TensorSpec("head.weight", (c.vocab_size, h), "normal", std=LOGIT_STD / math.sqrt(h)),
    ]
    return specs


def mtp_specs(c: V4Config, k: int = 0) -> list[TensorSpec]:
    """MTP layer `k` as the release ships it (and llama.cpp's converter reads it): `mtp.K.`
    e_proj / h_proj [D, D] (llama.cpp's eh_proj is their concatenation along the input), enorm,
    hnorm, norm (its head's norm), its own hc_head_*, and a sliding-window block with a top-k MoE;
    it shares the main model's embed and head."""
    h, p = c.hidden_size, f"mtp.{k}"
    specs = [
        _linear(f"{p}.e_proj.weight", h, h),
        _linear(f"{p}.h_proj.weight", h, h),
        _norm(f"{p}.enorm.weight", h),
        _norm(f"{p}.hnorm.weight", h),
        *_block_specs(p, c, SLIDING, TOPK_MOE),
        *_hyper(f"{p}.hc_head", c, c.hc_mult),
        _norm(f"{p}.norm.weight", h),
    ]
    return [replace(s, mtp=True) for s in specs]


def hf_name(release: str) -> str:
    """The release's name -> transformers' default `save_pretrained` name."""
    if release == "head.weight":
        return release
    if release == "embed.weight":
        return "model.embed_tokens.weight"
    if release.startswith("hc_head_"):
        return "model.hc_head.hc_" + release.removeprefix("hc_head_")
    return "model." + re.sub(r"\.attn\.kv_norm\.", ".attn.norm.", release)


# How the release stores its tensors (llama.cpp's converter, transformers' FP8 integration):
# FP8 with a block scale: the attention's q/kv/output projections, the indexer's q, the shared
# experts and the MTP's e/h projections (transformers keeps the compressor and indexer
# projections out of FP8: they ship in BF16); F32: sinks, position biases, hyper-connections and
# router biases; int64: hash tables; MXFP4: the routed experts; BF16: the rest.
_FP8 = re.compile(
    r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$"
    r"|\.shared_experts\.w[123]\.weight$|^mtp\.\d+\.[eh]_proj\.weight$"
)
_F32 = re.compile(r"(\.attn_sink|\.ape|(^|\.)hc_\w+|\.gate\.bias)$")
_RELEASE_RATIOS = {SLIDING: 0, CSA: 4, HCA: 128}


def release_storage(spec: TensorSpec) -> str:
    """How the release stores the tensor of `spec`: "fp8", "mxfp4", "f32", "i64" or "bf16"."""
    if spec.expert:
        return "mxfp4"
    if spec.init == "hash":
        return "i64"
    if _FP8.search(spec.name):
        return "fp8"
    return "f32" if _F32.search(spec.name) else "bf16"


def release_tensors(spec: TensorSpec, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A generated tensor as the release stores it: the weight and, for FP8 and MXFP4, its
    `.scale` beside it."""
    storage = release_storage(spec)
    scale_name = spec.name.removesuffix(".weight") + ".scale"
    if storage == "fp8":
        weight, scale = fp8_block_quantize(tensor)
        return [(spec.name, weight), (scale_name, scale)]
    if storage == "mxfp4":
        weight, scale = mxfp4_quantize(tensor)
        return [(spec.name, weight), (scale_name, scale)]
    if storage == "i64":
        return [(spec.name, tensor)]
    return [(spec.name, tensor.to(torch.float32 if storage == "f32" else torch.bfloat16))]


def release_config(preset: str) -> dict[str, Any]:
    """config.json of a preset in the release's spelling: `compress_ratios` per layer, the MTP
    layer's 0 last, `num_hash_layers`, `qk_rope_head_dim`, a flat yarn `rope_scaling` for the
    compressed layers, the FP8 `quantization_config` (ue8m0 scales, 128x128 blocks) and
    `expert_dtype` "fp4" (which transformers moves into the quantization config). The release's
    ratios are 0, 4 and 128 only (llama.cpp's loader and transformers know no others), so a
    preset's HCA layers compress 128 tokens here whatever the hf preset's rate."""
    hf = v4_preset_config(preset, "bfloat16")
    mlp = hf.pop("mlp_layer_types")
    hashed = mlp.count(HASH_MOE)
    if mlp[:hashed] != [HASH_MOE] * hashed:
        raise ValueError(f"preset {preset!r}: the release puts its hash layers first")
    ratios = [_RELEASE_RATIOS[kind] for kind in hf.pop("layer_types")] + [0]
    compress = hf.pop("rope_parameters")["compress"]
    for key in ("compress_rates", "partial_rotary_factor"):
        hf.pop(key)
    rope_scaling = {
        k: v
        for k, v in compress.items()
        if k not in ("rope_type", "rope_theta", "partial_rotary_factor", "attention_factor")
    }
    return {
        **hf,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_hash_layers": hashed,
        "num_nextn_predict_layers": 1,
        "compress_ratios": ratios,
        "rope_scaling": {**rope_scaling, "type": compress["rope_type"]},
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
        "expert_dtype": "fp4",
        "topk_method": "noaux_tc",
        "use_cache": True,
    }


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def save_shards(out: Path, tensors: list[tuple[str, torch.Tensor]], max_shard_bytes: int) -> int:
    """Save `tensors` in order, a new shard whenever the next would pass `max_shard_bytes` (an
    index beside several); returns the bytes written."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    names = _shard_names(len(shards))
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, str(out / fname), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {t: f for f, shard in zip(names, shards, strict=True) for t in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def write_official_weights(
    out: Path, config: V4Config, seed: int, max_shard_bytes: int
) -> tuple[list[TensorSpec], int]:
    """Generate the main model and one MTP layer (seeded, in spec order) and save them as the
    release stores them; returns the specs and the bytes written."""
    specs = v4_weight_specs(config) + mtp_specs(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = [pair for s in specs for pair in release_tensors(s, make_tensor(s, gen, {}))]
    return specs, save_shards(out, tensors, max_shard_bytes)


def skewed_hash_table(target: torch.Tensor, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    """[V, K] int64: a hash layer's token -> K distinct experts table in which round(target[e]·V)
    token ids (largest remainders; `target` [E] sums to K, each below 1) pick expert e, the ids in
    a random order from `gen`.

    The K·V picks are laid out expert after expert and token v takes picks v, v + V, ...: an
    expert holds at most V consecutive picks, so no token gets one expert twice."""
    top_k = round(float(target.sum()))
    exact = target * vocab_size
    counts = exact.floor().long()
    short = top_k * vocab_size - int(counts.sum())
    counts[(exact - counts).argsort(descending=True)[:short]] += 1
    picks = torch.repeat_interleave(torch.arange(target.shape[0]), counts)  # [K·V]
    table = picks.view(top_k, vocab_size).t()
    return table[torch.randperm(vocab_size, generator=gen)].contiguous()


@torch.no_grad()
def fit_topk_bias(
    router: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, num_steps: int = SKEW_STEPS
) -> torch.Tensor:
    """Fits a top-k router's `bias` [E] in place so that router(x [N, D]) picks each expert with
    frequency `target` [E]; starts from its current bias; returns it (float32). The scores do not
    depend on the bias: they are computed once, and every step runs the router's own selection
    (top-k of score + bias, in fp32) with the update rule of V3's `fit_bias`."""
    num_tokens, num_experts = x.shape[0], target.shape[0]
    scores = router.score(F.linear(x.float(), router.weight.float()))  # [N, E]
    bias = router.bias.detach().double().clone()
    for _ in range(num_steps):
        ids = torch.topk(scores + bias.float(), router.top_k, dim=-1, sorted=False).indices
        picks = torch.bincount(ids.flatten(), minlength=num_experts).double() / num_tokens
        step = SKEW_RATE * (target / (picks + 0.5 / num_tokens)).log()
        bias = (bias + step).clamp(-SKEW_MAX_BIAS, SKEW_MAX_BIAS)
    router.bias.data.copy_(bias)
    return bias.float()


def _capture_router_inputs(llm: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Runs prefill over `prompts`; returns each decoder layer's router inputs [N, D]."""
    from pdmesh_engine.sampling import SamplingParams

    moe = llm.engine.runner.model.moe_layers
    captured: list[list[torch.Tensor]] = [[] for _ in moe]
    hooks = [
        m.gate.register_forward_pre_hook(
            lambda _m, args, i=i: captured[i].append(args[0].detach().float())
        )
        for i, m in enumerate(moe)
    ]
    try:
        llm.generate(
            [{"prompt_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0.0)
        )
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(c) for c in captured]


def _rewrite_tensors(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace `tensors` (by name, each cast to the stored dtype) in the files of `model_dir`."""
    written: set[str] = set()
    for file in sorted(model_dir.glob("*.safetensors")):
        stored = load_file(str(file))
        hits = [n for n in stored if n in tensors]
        if hits:
            stored.update({n: tensors[n].to(stored[n].dtype) for n in hits})
            save_file(stored, str(file), metadata={"format": "pt"})
            written.update(hits)
    if written != set(tensors):
        missing = sorted(set(tensors) - written)
        raise ValueError(f"tensors {missing[:3]} are not in {model_dir}'s files")


def apply_v4_expert_skew(
    model_dir: Path, zipf_s: float, seed: int, log: Callable[[str], None] = lambda _msg: None
) -> None:
    """Skews every MoE layer of the hf-layout V4 checkpoint in `model_dir` (written, not yet in
    use) to Zipf(zipf_s) with a per-layer ranking (module docstring): the hash layers' tables
    first (they shape the inputs of the layers after them), then the top-k layers' biases."""
    from pdmesh_engine.llm import LLM

    config = V4Config.from_dict(json.loads((model_dir / "config.json").read_text()))
    num_experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    targets = []
    for i in range(config.num_hidden_layers):
        target = torch.empty(num_experts, dtype=torch.float64)
        target[expert_ranking(seed, i, num_experts, 1)] = zipf_frequencies(
            num_experts, top_k, zipf_s
        )
        targets.append(target)
    hashed = [i for i, kind in enumerate(config.mlp_layer_types) if kind == HASH_MOE]
    tables = {
        hf_name(f"layers.{i}.ffn.gate.tid2eid"): skewed_hash_table(
            targets[i], config.vocab_size, layer_generator(seed + 1, i)
        )
        for i in hashed
    }
    _rewrite_tensors(model_dir, tables)
    topk = [i for i in range(config.num_hidden_layers) if i not in hashed]
    # Prefix-cache hits would skip the prefill the capture needs.
    llm = LLM(model_dir, device="cpu", enable_prefix_caching=False)
    moe = llm.engine.runner.model.moe_layers
    prompts = calibration_prompts(llm.tokenizer)
    biases: dict[str, torch.Tensor] = {}
    for round_index in range(SKEW_ROUNDS if topk else 0):
        inputs = _capture_router_inputs(llm, prompts)
        steps = SKEW_REFIT_STEPS if round_index else SKEW_STEPS
        for i in topk:
            bias = fit_topk_bias(moe[i].gate, inputs[i], targets[i], steps)
            biases[hf_name(f"layers.{i}.ffn.gate.bias")] = bias
    _rewrite_tensors(model_dir, biases)
    log(f"skewed {len(hashed)} hash tables and fitted {len(topk)} router biases to Zipf {zipf_s}")


def write_v4_model(
    out: Path,
    preset: str,
    seed: int,
    dtype: str,
    max_shard_bytes: int,
    log: Callable[[str], None],
    format: str = "hf",
    expert_skew: float = 0.0,
) -> dict[str, Any]:
    """Write config, tokenizer and weights of a random V4 preset into `out` in `format` (module
    docstring; `dtype` applies to hf), expert popularity skewed to Zipf(`expert_skew`) when it is
    above 0 (hf only); returns the config."""
    cfg_dict = v4_preset_config(preset, dtype) if format == "hf" else release_config(preset)
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
    t0 = time.perf_counter()
    if format == "official":
        specs, nbytes = write_official_weights(out, config, seed, max_shard_bytes)
    else:
        specs = [replace(s, name=hf_name(s.name)) for s in v4_weight_specs(config)]
        nbytes = write_weights(out, specs, seed, dtype, max_shard_bytes, log)
    main = [s for s in specs if not s.mtp]
    total = sum(s.numel for s in main)
    experts = sum(s.numel for s in main if s.expert)
    active = (
        total
        - experts
        * (config.n_routed_experts - config.num_experts_per_tok)
        // config.n_routed_experts
    )
    mtp = sum(s.numel for s in specs if s.mtp)
    log(
        f"wrote DeepSeek-V4 {preset!r} ({format}): {total / 1e6:.1f}M parameters "
        f"({active / 1e6:.1f}M active, +{mtp / 1e6:.1f}M MTP), {nbytes / 1e6:.0f} MB, in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    if expert_skew > 0:
        t0 = time.perf_counter()
        apply_v4_expert_skew(out, expert_skew, seed, log)
        log(f"skewed expert popularity (Zipf {expert_skew}) in {time.perf_counter() - t0:.1f}s")
    return cfg_dict
