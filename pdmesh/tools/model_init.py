"""`pdmesh model init`: a seeded random-weight DeepSeek-V3 checkpoint in Hugging Face layout.

The directory holds `config.json`, `generation_config.json`, `tokenizer.json` (a byte-level BPE
trained on standard-library docstrings, so no download is needed), `tokenizer_config.json`
(with a DeepSeek-style chat template), the weights as safetensors (sharded with an index above
`max_shard_bytes`), and `pdmesh_init.json` recording how it was made.

Weights use the DeepSeek-V3 / `save_pretrained` names with per-expert tensors, plus the
multi-token-prediction layer at index `num_hidden_layers` as DeepSeek-V3 ships it (its
`embed_tokens` and `shared_head.head` are copies of the main embedding and `lm_head`).

`expert_skew` s > 0 refits every MoE router's `e_score_correction_bias` afterwards so expert
popularity follows a Zipf law of exponent s with a seeded ranking per layer (see `expert_skew.py`);
0, the default, leaves the checkpoint byte-identical to an unskewed one.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdmesh.tools.presets import (
    PRESETS,
    TRAINED_ARCH,
    TRAINED_PRESETS,
    preset_config,
)
from pdmesh.tools.tokenizer_train import BOS_ID, EOS_ID, tokenizer_config, train_tokenizer
from pdmesh.tools.weight_files import (
    BIAS_STD,
    DEFAULT_MAX_SHARD_BYTES,
    LOGIT_STD,
    ROUTER_LOGIT_STD,
    TensorSpec,
    write_json,
    write_weights,
)
from pdmesh_engine.checkpoint import DTYPES
from pdmesh_engine.config import ModelConfig

INIT_FORMAT_VERSION = 1


def _linear(name: str, out_f: int, in_f: int, **kw: Any) -> TensorSpec:
    return TensorSpec(name, (out_f, in_f), "normal", std=1.0 / math.sqrt(in_f), **kw)


def _norm(name: str, dim: int, **kw: Any) -> TensorSpec:
    return TensorSpec(name, (dim,), "norm", **kw)


def _mlp(prefix: str, hidden: int, inter: int, **kw: Any) -> list[TensorSpec]:
    return [
        _linear(f"{prefix}.gate_proj.weight", inter, hidden, **kw),
        _linear(f"{prefix}.up_proj.weight", inter, hidden, **kw),
        _linear(f"{prefix}.down_proj.weight", hidden, inter, **kw),
    ]


def _layer_specs(c: ModelConfig, i: int, moe: bool, mtp: bool = False) -> list[TensorSpec]:
    p, h, heads = f"model.layers.{i}", c.hidden_size, c.num_attention_heads
    a = f"{p}.self_attn"
    specs = [_norm(f"{p}.input_layernorm.weight", h, mtp=mtp)]
    if c.q_lora_rank:
        specs += [
            _linear(f"{a}.q_a_proj.weight", c.q_lora_rank, h, mtp=mtp),
            _norm(f"{a}.q_a_layernorm.weight", c.q_lora_rank, mtp=mtp),
            _linear(f"{a}.q_b_proj.weight", heads * c.qk_head_dim, c.q_lora_rank, mtp=mtp),
        ]
    else:
        specs.append(_linear(f"{a}.q_proj.weight", heads * c.qk_head_dim, h, mtp=mtp))
    specs += [
        _linear(f"{a}.kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, h, mtp=mtp),
        _norm(f"{a}.kv_a_layernorm.weight", c.kv_lora_rank, mtp=mtp),
        _linear(
            f"{a}.kv_b_proj.weight",
            heads * (c.qk_nope_head_dim + c.v_head_dim),
            c.kv_lora_rank,
            mtp=mtp,
        ),
        _linear(f"{a}.o_proj.weight", h, heads * c.v_head_dim, mtp=mtp),
        _norm(f"{p}.post_attention_layernorm.weight", h, mtp=mtp),
    ]
    if not moe:
        return specs + _mlp(f"{p}.mlp", h, c.intermediate_size, mtp=mtp)
    e = c.n_routed_experts
    specs += [
        TensorSpec(
            f"{p}.mlp.gate.weight",
            (e, h),
            "normal",
            std=ROUTER_LOGIT_STD / math.sqrt(h),
            mtp=mtp,
            fp32=True,
        ),
        TensorSpec(
            f"{p}.mlp.gate.e_score_correction_bias", (e,), "bias", std=BIAS_STD, mtp=mtp, fp32=True
        ),
    ]
    for j in range(e):
        specs += _mlp(f"{p}.mlp.experts.{j}", h, c.moe_intermediate_size, expert=True, mtp=mtp)
    if c.n_shared_experts:
        specs += _mlp(
            f"{p}.mlp.shared_experts", h, c.moe_intermediate_size * c.n_shared_experts, mtp=mtp
        )
    return specs


def weight_specs(c: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the checkpoint in generation order (main model, then the MTP layers)."""
    h, v = c.hidden_size, c.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", (v, h), "normal", std=1.0)]
    for i in range(c.num_hidden_layers):
        specs += _layer_specs(c, i, moe=i in c.moe_layer_ids)
    specs += [
        _norm("model.norm.weight", h),
        TensorSpec("lm_head.weight", (v, h), "normal", std=LOGIT_STD / math.sqrt(h)),
    ]
    for k in range(c.num_nextn_predict_layers):
        i = c.num_hidden_layers + k
        p = f"model.layers.{i}"
        specs += [
            TensorSpec(
                f"{p}.embed_tokens.weight",
                (v, h),
                "copy",
                source="model.embed_tokens.weight",
                mtp=True,
            ),
            _norm(f"{p}.enorm.weight", h, mtp=True),
            _norm(f"{p}.hnorm.weight", h, mtp=True),
            _linear(f"{p}.eh_proj.weight", h, 2 * h, mtp=True),
        ]
        specs += _layer_specs(c, i, moe=c.has_moe, mtp=True)
        specs += [
            _norm(f"{p}.shared_head.norm.weight", h, mtp=True),
            TensorSpec(
                f"{p}.shared_head.head.weight", (v, h), "copy", source="lm_head.weight", mtp=True
            ),
        ]
    return specs


def count_parameters(config: ModelConfig) -> tuple[int, int]:
    """(total, active-per-token) parameters of the main model, MTP layers excluded.

    Embeddings and lm_head count in both; active leaves out the routed experts a token does not use.
    """
    main = [s for s in weight_specs(config) if not s.mtp]
    total = sum(s.numel for s in main)
    experts = sum(s.numel for s in main if s.expert)
    unused = (
        experts
        * (config.n_routed_experts - config.num_experts_per_tok)
        // max(config.n_routed_experts, 1)
    )
    return total, total - unused


def count_mtp_parameters(config: ModelConfig) -> int:
    """Parameters of the multi-token-prediction layers (copies of embedding and head included)."""
    return sum(s.numel for s in weight_specs(config) if s.mtp)


def _write_model(
    out: Path,
    preset: str,
    seed: int,
    dtype: str,
    max_shard_bytes: int,
    log: Callable[[str], None],
    expert_skew: float = 0.0,
) -> None:
    cfg_dict = preset_config(preset, dtype)
    config = ModelConfig.from_dict(cfg_dict)
    total, active = count_parameters(config)
    write_json(out / "config.json", cfg_dict)
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "do_sample": True,
            "temperature": 1.0,
            "top_p": 1.0,
        },
    )
    t0 = time.perf_counter()
    tok = train_tokenizer(config.vocab_size)
    (out / "tokenizer.json").write_text(tok, encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config(config.max_position_embeddings))
    log(
        f"trained byte-level BPE tokenizer (vocab {config.vocab_size}) in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    t0 = time.perf_counter()
    nbytes = write_weights(out, weight_specs(config), seed, dtype, max_shard_bytes, log)
    log(
        f"wrote {total / 1e6:.1f}M parameters ({active / 1e6:.1f}M active, "
        f"+{count_mtp_parameters(config) / 1e6:.1f}M MTP), {nbytes / 1e6:.0f} MB, in "
        f"{time.perf_counter() - t0:.1f}s"
    )
    if expert_skew > 0:
        from pdmesh.tools.expert_skew import apply_expert_skew

        t0 = time.perf_counter()
        apply_expert_skew(out, expert_skew, seed, log)
        log(f"skewed expert popularity (Zipf {expert_skew}) in {time.perf_counter() - t0:.1f}s")
    skew = {"expert_skew": expert_skew} if expert_skew else {}  # absent at 0: files as before
    write_json(
        out / "pdmesh_init.json",
        {
            "version": INIT_FORMAT_VERSION,
            "preset": preset,
            "seed": seed,
            "dtype": dtype,
            **skew,
            "config": cfg_dict,
        },
    )


def _copy_trained(out: Path, preset: str, log: Callable[[str], None]) -> None:
    """The embedded trained checkpoint of `preset`, copied into `out`."""
    from pdmesh_engine.checkpoint import embedded_model_dir

    source = embedded_model_dir(preset)
    for f in sorted(source.iterdir()):
        if f.is_file():
            shutil.copyfile(f, out / f.name)
    log(f"copied the trained {preset!r} checkpoint ({source.name}, see its README.md)")


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished `tmp` to `out` in one rename (an interrupted run leaves no half model)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp made it private
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~umask)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(
                f"{out} exists and is not empty (pass overwrite=True / --overwrite)"
            )
        if not (out / "config.json").is_file():
            raise FileExistsError(f"{out} is not a model directory; refusing to overwrite it")
        shutil.rmtree(out)
    elif out.exists():
        out.rmdir()
    os.replace(tmp, out)


def init_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    verbose: bool = True,
    expert_skew: float = 0.0,
    arch: str | None = None,
    format: str = "hf",
) -> Path:
    """Write a seeded random-weight checkpoint of `preset` to `out_dir` (atomically); returns its
    path. A trained preset (`TRAINED_PRESETS`) is a copy of its embedded trained checkpoint
    instead (seed, dtype and expert_skew apply to random presets only).

    expert_skew: Zipf exponent of expert popularity per MoE layer (module docstring); 0: none.
    arch: deepseek_v3, or deepseek_v4 (model_init_v4.py; presets tiny and small); None: a trained
    preset's own (`TRAINED_ARCH`), else deepseek_v3.
    format: deepseek_v4's layout, hf or official (the DeepSeek release's; model_init_v4.py).
    """
    trained = preset in TRAINED_PRESETS  # a copy of the embedded checkpoint
    if trained and arch not in (None, TRAINED_ARCH[preset]):
        raise ValueError(f"{preset!r} is a trained {TRAINED_ARCH[preset]} checkpoint, not {arch}")
    arch = TRAINED_ARCH.get(preset, "deepseek_v3") if arch is None else arch
    if trained and (seed or expert_skew or format != "hf"):
        raise ValueError(
            f"{preset!r} is a trained preset: its weights are the embedded checkpoint "
            "(--seed, --expert-skew and --format apply to the random presets)"
        )
    if arch == "deepseek_v4" and not trained:
        from pdmesh.tools.model_init_v4 import FORMATS, v4_preset_config, write_v4_model

        v4_preset_config(preset, dtype)  # validate before any work
        if format not in FORMATS:
            raise ValueError(f"unknown format {format!r}; choose from {FORMATS}")
        if expert_skew and format != "hf":
            raise ValueError("--expert-skew writes deepseek_v4 checkpoints in the hf format only")
    elif arch not in ("deepseek_v3", "deepseek_v4"):
        raise ValueError(f"unknown arch {arch!r}; choose deepseek_v3 or deepseek_v4")
    elif not trained:
        preset_config(preset, dtype)  # validate before any work
    if format != "hf" and arch != "deepseek_v4":
        raise ValueError(f"format {format!r} is for deepseek_v4 checkpoints only")
    if not (math.isfinite(expert_skew) and expert_skew >= 0):
        raise ValueError(f"expert_skew must be a finite number >= 0, got {expert_skew}")
    out = Path(out_dir).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        if verbose:
            print(f"pdmesh: {msg}", file=sys.stderr, flush=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if trained:
            _copy_trained(tmp, preset, log)
        elif arch == "deepseek_v4":
            cfg = write_v4_model(
                tmp, preset, seed, dtype, max_shard_bytes, log, format, expert_skew
            )
            write_json(
                tmp / "pdmesh_init.json",
                {
                    "version": INIT_FORMAT_VERSION,
                    "preset": preset,
                    "seed": seed,
                    "dtype": dtype,
                    "format": format,
                    **({"expert_skew": expert_skew} if expert_skew else {}),
                    "config": cfg,
                },
            )
        else:
            _write_model(tmp, preset, seed, dtype, max_shard_bytes, log, expert_skew)
        _publish(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def add_init_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `pdmesh model init` (for the CLI to mount)."""
    parser.add_argument("dir", type=Path, help="directory to create")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing model directory"
    )
    parser.add_argument(
        "--expert-skew",
        type=float,
        default=0.0,
        metavar="ZIPF_S",
        help="Zipf exponent of expert popularity per MoE layer (0: near-uniform)",
    )


def run_init(args: argparse.Namespace) -> int:
    path = init_model(
        args.dir,
        args.preset,
        args.seed,
        args.dtype,
        overwrite=args.overwrite,
        expert_skew=args.expert_skew,
    )
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh model init", description=__doc__.splitlines()[0])
    add_init_arguments(parser)
    return run_init(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
