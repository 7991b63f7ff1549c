"""Write a `DeepseekV3ForTraining` as a plain Hugging Face `DeepseekV3ForCausalLM` directory.

Names are the module's own, except the MTP module, which becomes layer `num_hidden_layers` as
DeepSeek ships it: its block's tensors directly under the layer, `shared_head_norm` as
`shared_head.norm`, and copies of the shared embedding and output head as `embed_tokens` and
`shared_head.head`. Weights are stored in `dtype`, the routers (weight and correction bias) in
fp32, as `save_pretrained` keeps them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdmesh.tools.presets import preset_config
from pdmesh.tools.tokenizer_train import BOS_ID, EOS_ID, tokenizer_config
from pdmesh.train.model import DeepseekV3ForTraining
from pdmesh_engine.checkpoint import DTYPES


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


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export_checkpoint(
    model: DeepseekV3ForTraining, preset: str, tokenizer_json: str, out: Path, dtype: str
) -> int:
    """Write config, generation config, tokenizer and weights into `out`; returns weight bytes."""
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", preset_config(preset, dtype))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": True, "temperature": 1.0},
    )
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json", tokenizer_config(model.config.max_position_embeddings)
    )
    tensors = checkpoint_tensors(model, dtype)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())
