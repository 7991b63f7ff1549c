"""DeepSeek-V4's hyper-parameters, parsed once from config.json (frozen, validated here).

Two spellings of the same model are read: transformers' (`layer_types`, `compress_rates`,
`mlp_layer_types`, `rope_parameters.{main,compress}`) and the release's (`compress_ratios` per
layer 0/4/128, `num_hash_layers`, `qk_rope_head_dim`, `compress_rate_csa`/`_hca`, a flat
`rope_scaling`), which transformers folds into the first form the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdmesh_engine.config import DTYPE_NAMES, CheckpointError, read_json

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
HASH_MOE, TOPK_MOE = "hash_moe", "moe"
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table: what `layers.rope_inv_freq` reads (the V3 helper, shared)."""

    qk_rope_head_dim: int
    rope_theta: float
    rope_type: str
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]  # ((CSA, 4), (HCA, 128))
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict[str, Any] | None = None  # yarn of the compressed layers
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1  # as transformers defaults it (the release ships one)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != n:
                raise CheckpointError(
                    f"config.json: {name} has {len(getattr(self, name))} entries for {n} layers"
                )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise CheckpointError(f"config.json: layer_types {bad} not in {LAYER_TYPES}")
        bad = [t for t in self.mlp_layer_types if t not in (HASH_MOE, TOPK_MOE)]
        if bad:
            raise CheckpointError(f"config.json: mlp_layer_types {bad} not in hash_moe/moe")
        if self.scoring_func not in SCORING_FUNCS:
            raise CheckpointError(
                f"config.json: scoring_func {self.scoring_func!r} not in {SCORING_FUNCS}"
            )
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise CheckpointError(
                f"config.json: qk_rope_head_dim {self.qk_rope_head_dim} must be even and "
                f"<= head_dim {self.head_dim}"
            )
        if self.index_head_dim < self.qk_rope_head_dim and CSA in self.layer_types:
            raise CheckpointError("config.json: index_head_dim is narrower than the rope slice")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise CheckpointError(
                f"config.json: o_groups {self.o_groups} does not divide heads x head_dim"
            )
        for kind, rate in self.compress_rates:
            if rate < 1:
                raise CheckpointError(f"config.json: compress rate of {kind} must be >= 1")
        if self.sliding_window < 1:
            raise CheckpointError("config.json: sliding_window must be >= 1")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise CheckpointError("config.json: num_experts_per_tok must be in [1, experts]")
        if self.torch_dtype not in DTYPE_NAMES:
            raise CheckpointError(f"config.json: dtype {self.torch_dtype!r} not in {DTYPE_NAMES}")

    # The parts the engine reads.
    def rate(self, layer_type: str) -> int:
        """Tokens per compressed entry of a layer kind (0 for sliding layers)."""
        return dict(self.compress_rates).get(layer_type, 0) if layer_type != SLIDING else 0

    def layers_of(self, layer_type: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == layer_type]

    @property
    def moe_layer_ids(self) -> list[int]:
        """The MoE layers (V3's `ModelConfig` spelling, what DEP's `model_kwargs` reads): every
        layer, hash or top-k routed."""
        return list(range(self.num_hidden_layers))

    @property
    def main_rope(self) -> RopeSpec:
        return RopeSpec(
            self.qk_rope_head_dim, self.rope_theta, "default", None, self.max_position_embeddings
        )

    @property
    def compress_rope(self) -> RopeSpec:
        scaling = self.compress_rope_scaling
        kind = (scaling or {}).get("rope_type", "default")
        return RopeSpec(
            self.qk_rope_head_dim,
            self.compress_rope_theta,
            kind,
            scaling if kind != "default" else None,
            self.max_position_embeddings,
        )

    @property
    def window_span(self) -> int:
        """Tokens before a position whose per-token rows a step may read: the window's W - 1, and
        the open compression windows (CSA also reads the previous window's rows)."""
        spans = [self.sliding_window - 1]
        if CSA in self.layer_types:
            spans.append(2 * self.rate(CSA) - 1)
        if HCA in self.layer_types:
            spans.append(self.rate(HCA) - 1)
        return max(spans)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> V4Config:
        n = _int(raw, "num_hidden_layers")
        rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
        if raw.get("compress_rate_csa") is not None:
            rates[CSA] = int(raw["compress_rate_csa"])
        if raw.get("compress_rate_hca") is not None:
            rates[HCA] = int(raw["compress_rate_hca"])
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_TYPE[int(r)] for r in raw["compress_ratios"]]
            except KeyError as e:
                raise CheckpointError(f"config.json: compress ratio {e} not in 0/4/128") from e
        if layer_types is None:  # transformers' default: 2 HCA, then CSA/HCA alternating
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            hashed = raw.get("num_hash_layers")
            hashed = 3 if hashed is None else int(hashed)
            mlp_types = [HASH_MOE] * min(n, hashed) + [TOPK_MOE] * max(0, n - hashed)
        head_dim = _int(raw, "head_dim")
        rope_dim = raw.get("qk_rope_head_dim")
        if rope_dim is None:
            factor = raw.get("partial_rotary_factor") or 64 / 512
            rope_dim = int(head_dim * factor)
        rope_theta, compress_theta, scaling = _rope(raw)
        eos = raw.get("eos_token_id", 1)
        values = {
            k: raw[k]
            for k in (
                "n_shared_experts",
                "scoring_func",
                "norm_topk_prob",
                "routed_scaling_factor",
                "hc_mult",
                "hc_sinkhorn_iters",
                "hc_eps",
                "swiglu_limit",
                "sliding_window",
                "o_groups",
                "o_lora_rank",
                "index_n_heads",
                "index_head_dim",
                "index_topk",
                "num_nextn_predict_layers",
                "rms_norm_eps",
                "max_position_embeddings",
                "tie_word_embeddings",
                "bos_token_id",
            )
            if raw.get(k) is not None
        }
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        try:
            return cls(
                vocab_size=_int(raw, "vocab_size"),
                hidden_size=_int(raw, "hidden_size"),
                moe_intermediate_size=_int(raw, "moe_intermediate_size"),
                num_hidden_layers=n,
                num_attention_heads=_int(raw, "num_attention_heads"),
                head_dim=head_dim,
                q_lora_rank=_int(raw, "q_lora_rank"),
                qk_rope_head_dim=int(rope_dim),
                n_routed_experts=_int(raw, "n_routed_experts"),
                num_experts_per_tok=_int(raw, "num_experts_per_tok"),
                layer_types=tuple(layer_types[:n]),
                mlp_layer_types=tuple(mlp_types[:n]),
                compress_rates=((CSA, int(rates[CSA])), (HCA, int(rates[HCA]))),
                rope_theta=rope_theta,
                compress_rope_theta=compress_theta,
                compress_rope_scaling=scaling,
                eos_token_ids=tuple(
                    eos if isinstance(eos, list) else ([] if eos is None else [eos])
                ),
                torch_dtype=dtype,
                **values,
            )
        except TypeError as e:  # a value of the wrong kind
            raise CheckpointError(f"config.json: {e}") from e

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> V4Config:
        return cls.from_dict(read_json(Path(model_dir) / "config.json"))


def _int(raw: dict[str, Any], key: str) -> int:
    if raw.get(key) is None:
        raise CheckpointError(f"config.json is missing {key!r}")
    return int(raw[key])


def _rope(raw: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(main theta, compress theta, the compressed layers' yarn parameters or None)."""
    params = raw.get("rope_parameters") or {}
    main, compress = params.get("main"), params.get("compress")
    if isinstance(main, dict) and isinstance(compress, dict):
        scaling = {
            k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor")
        }
        return (
            float(main.get("rope_theta", raw.get("rope_theta", 10000.0))),
            float(compress.get("rope_theta", raw.get("compress_rope_theta", 160000.0))),
            scaling if scaling.get("rope_type", "default") != "default" else None,
        )
    flat = {
        **(raw.get("rope_scaling") or {}),
        **{k: v for k, v in params.items() if k not in ("main", "compress")},
    }
    flat.pop("rope_theta", None)
    flat.pop("partial_rotary_factor", None)
    kind = flat.get("rope_type", flat.get("type", "default"))
    if kind == "yarn":
        flat["rope_type"] = "yarn"
        flat.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    return (
        float(raw.get("rope_theta", 10000.0)),
        float(raw.get("compress_rope_theta", 160000.0)),
        flat if kind != "default" else None,
    )
