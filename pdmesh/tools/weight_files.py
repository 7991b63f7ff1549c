"""Seeded random checkpoint tensors, written as safetensors: what `pdmesh model init` writes for
every model family (model_init.py for DeepSeek-V3, model_init_v4.py for DeepSeek-V4).

A `TensorSpec` says how one tensor is made; `write_weights` makes them in order from one seeded
generator and saves them in shards of at most `max_shard_bytes` (with an index when there are
several)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdmesh_engine.checkpoint import DTYPES

DEFAULT_MAX_SHARD_BYTES = 500_000_000
# Initialisation (see weight_specs): linear layers N(0, 1/fan_in), embeddings N(0, 1); the scales
# below keep logits and router scores well spread (no near-ties).
LOGIT_STD = 2.0  # std of a logit for a unit-RMS final hidden state
ROUTER_LOGIT_STD = 1.0  # std of a router logit before the sigmoid
BIAS_STD = 0.05  # e_score_correction_bias ~ N(0, BIAS_STD)
NORM_JITTER = 0.1  # norm weights ~ 1 + N(0, NORM_JITTER), so a skipped norm weight shows


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: how to create it, and whether it counts as main, expert or MTP
    weight."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (std), "norm" (1 + jitter), "bias", or "copy" (of `source`)
    std: float = 0.0
    source: str = ""
    expert: bool = False  # a routed expert's weight
    mtp: bool = False  # part of the multi-token-prediction layer
    fp32: bool = False  # kept float32 whatever the dtype (router, as save_pretrained keeps it)
    num_experts: int = 0  # init "hash": a token -> distinct experts table of this many experts

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def make_tensor(
    spec: TensorSpec, gen: torch.Generator, done: dict[str, torch.Tensor]
) -> torch.Tensor:
    if spec.init == "copy":
        return done[spec.source].clone()
    if spec.init == "norm":
        return 1.0 + NORM_JITTER * torch.randn(spec.shape, generator=gen)
    if spec.init == "hash":  # int64 [V, K]: K distinct experts per token
        rows, k = spec.shape
        return torch.rand(rows, spec.num_experts, generator=gen).argsort(dim=-1)[:, :k].contiguous()
    return spec.std * torch.randn(spec.shape, generator=gen)


def _plan_shards(
    specs: list[TensorSpec], dtype: torch.dtype, max_shard_bytes: int
) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        nbytes = s.numel * (4 if s.fp32 else torch.finfo(dtype).bits // 8)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += nbytes
    return shards


def write_weights(
    out: Path,
    specs: list[TensorSpec],
    seed: int,
    dtype: str,
    max_shard_bytes: int,
    log: Callable[[str], None],
) -> int:
    """Generate and save the weights of `specs`; returns the number of bytes written."""
    torch_dtype = DTYPES[dtype]
    shards = _plan_shards(specs, torch_dtype, max_shard_bytes)
    gen = torch.Generator().manual_seed(seed)
    kept: dict[str, torch.Tensor] = {}  # sources of "copy" tensors
    sources = {s.source for s in specs if s.init == "copy"}
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for k, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        if len(shards) > 1:
            log(f"generating weights: shard {k + 1}/{len(shards)}")
        tensors: dict[str, torch.Tensor] = {}
        for s in shard:
            t = make_tensor(s, gen, kept)
            if s.name in sources:
                kept[s.name] = t
            tensors[s.name] = t if s.fp32 or not t.is_floating_point() else t.to(torch_dtype)
            weight_map[s.name] = fname
            total_bytes += tensors[s.name].numel() * tensors[s.name].element_size()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total_bytes


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
