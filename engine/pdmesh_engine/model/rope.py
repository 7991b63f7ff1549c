"""Rotary-embedding tables shared by the model families: the inverse frequencies of a rope
(default, or YaRN with its ramp between extrapolated and interpolated frequencies) and the
scaling of its cos/sin."""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RopeParams(Protocol):
    """What a rope table is computed from (a V3 `ModelConfig`, a V4 `RopeSpec`)."""

    @property
    def qk_rope_head_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_type(self) -> str: ...
    @property
    def rope_scaling(self) -> dict[str, Any] | None: ...
    @property
    def max_position_embeddings(self) -> int: ...


def rope_inv_freq(config: RopeParams) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] and the cos/sin scaling of the config's rope type."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if config.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    p = config.rope_scaling or {}
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or config.max_position_embeddings / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, p["mscale"]) / yarn_mscale(
                factor, p["mscale_all_dim"]
            )
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)
