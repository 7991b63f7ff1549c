"""Write a trained model as a checkpoint directory (config, generation config, tokenizer, weights).

DeepSeek-V3 (`export_checkpoint`): a plain Hugging Face `DeepseekV3ForCausalLM` directory. Names
are the module's own, except the MTP module, which becomes layer `num_hidden_layers` as DeepSeek
ships it: its block's tensors directly under the layer, `shared_head_norm` as `shared_head.norm`,
and copies of the shared embedding and output head as `embed_tokens` and `shared_head.head`.
Weights are stored in `dtype`, the routers (weight and correction bias) in fp32, as
`save_pretrained` keeps them.

DeepSeek-V4 (`export_v4_checkpoint`): transformers' default `save_pretrained` layout for the main
model (`model_init_v4.hf_name` of each release name), which transformers' `DeepseekV4ForCausalLM`
and the engine load, plus the MTP module under its release names `mtp.0.*` (transformers and the
engine skip them; the embedding and head stay shared, not copied). Linear and embedding weights
are stored in `dtype`, everything else (norms, mHC, sinks, position biases, routers) in fp32 and
the hash tables as int64, as the release keeps them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from pdmesh.tools.model_init_v4 import hf_name
from pdmesh.tools.presets import preset_config
from pdmesh.tools.tokenizer_train import BOS_ID, EOS_ID, tokenizer_config
from pdmesh.train.model import DeepseekV3ForTraining
from pdmesh.train.model_v4 import DeepseekV4ForTraining
from pdmesh_engine.checkpoint import DTYPES

# the training model's mHC submodules -> the release's flat names (`hc_attn.fn` -> `hc_attn_fn`)
_HYPER = re.compile(r"(^|\.)hc_(attn|ffn|head)\.(fn|base|scale)$")


def checkpoint_tensors(model: DeepseekV3ForTraining, dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by Hugging Face name, contiguous, in `dtype` (routers fp32)."""
    n = model.config.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.startswith("mtp."):
            index, rest = name.split(".", 2)[1:]
            rest = rest.removeprefix("block.").replace("shared_head_norm", "shared_head.norm")
            name = f"model.layers.{n + int(index)}.{rest}"
        out[name] = t
    for k in range(len(model.mtp)):
        out[f"model.layers.{n + k}.embed_tokens.weight"] = model.model.embed_tokens.weight
        out[f"model.layers.{n + k}.shared_head.head.weight"] = model.lm_head.weight
    router = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
    return {
        name: (t.float() if name.endswith(router) else t.to(DTYPES[dtype])).detach().clone()
        for name, t in sorted(out.items())
    }


def v4_release_name(name: str) -> str:
    """A `DeepseekV4ForTraining` parameter or buffer name -> the release's tensor name."""
    return _HYPER.sub(r"\1hc_\2_\3", name)


def v4_checkpoint_tensors(model: DeepseekV4ForTraining, dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (module docstring), contiguous, by name."""
    cast = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear | nn.Embedding)
    }
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        release = v4_release_name(name)
        if name in cast:
            t = t.to(DTYPES[dtype])
        elif t.is_floating_point():
            t = t.float()
        out[release if release.startswith("mtp.") else hf_name(release)] = t.detach().clone()
    return dict(sorted(out.items()))


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_checkpoint(
    out: Path,
    config: dict[str, Any],
    tokenizer_json: str,
    max_positions: int,
    tensors: dict[str, torch.Tensor],
) -> int:
    """Write config, generation config, tokenizer and weights into `out`; returns weight bytes."""
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": True, "temperature": 1.0},
    )
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(max_positions))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def export_checkpoint(
    model: DeepseekV3ForTraining, preset: str, tokenizer_json: str, out: Path, dtype: str
) -> int:
    """A DeepSeek-V3 preset's checkpoint in `out`; returns the weights' bytes."""
    return _write_checkpoint(
        out,
        preset_config(preset, dtype),
        tokenizer_json,
        model.config.max_position_embeddings,
        checkpoint_tensors(model, dtype),
    )


def export_v4_checkpoint(
    model: DeepseekV4ForTraining,
    config: dict[str, Any],
    tokenizer_json: str,
    out: Path,
    dtype: str,
) -> int:
    """A DeepSeek-V4 checkpoint in `out` (`config`: the config.json the model was built from, in
    transformers' spelling); returns the weights' bytes."""
    config = {**config, "num_nextn_predict_layers": len(model.mtp), "torch_dtype": dtype}
    return _write_checkpoint(
        out,
        config,
        tokenizer_json,
        model.config.max_position_embeddings,
        v4_checkpoint_tensors(model, dtype),
    )
