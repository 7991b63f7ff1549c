"""Configuration of the model (read from a checkpoint's config.json) and of the engine.

Both are frozen dataclasses validated once, here; the rest of the engine trusts them.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM")
# what the mesh (P/D over NIXL, DEP, EPLB, migration) serves; V4 runs offline for now
MESH_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "yarn")
# weight/KV dtypes, as config.json's torch_dtype names them
DTYPE_NAMES = ("float32", "bfloat16", "float16")
SPECULATIVE_METHODS = ("mtp", "draft_model")
MAX_SPECULATIVE_TOKENS = 8


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: missing file, unsupported model, bad tensor."""


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; CheckpointError naming the file if it is unreadable or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e


@dataclass(frozen=True)
class ModelConfig:
    """The DeepSeek-V3 architecture's hyper-parameters, as `config.json` names them."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise CheckpointError(
                    f"config.json: {name} must be positive, got {getattr(self, name)}"
                )
        if self.qk_rope_head_dim % 2:
            raise CheckpointError(
                f"config.json: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}"
            )
        if self.has_moe:
            if self.n_routed_experts % self.n_group:
                raise CheckpointError(
                    f"config.json: n_routed_experts ({self.n_routed_experts}) must divide into "
                    f"n_group ({self.n_group})"
                )
            if not 1 <= self.topk_group <= self.n_group:
                raise CheckpointError(
                    f"config.json: topk_group must be in [1, n_group], got {self.topk_group}"
                )
            if self.num_experts_per_tok > self.topk_group * self.experts_per_group:
                raise CheckpointError(
                    "config.json: num_experts_per_tok exceeds the experts of the chosen groups"
                )
            if self.experts_per_group < 2:
                raise CheckpointError(
                    "config.json: group-limited routing needs at least 2 experts per group"
                )
        if self.hidden_act != "silu":
            raise CheckpointError(
                f"config.json: hidden_act {self.hidden_act!r} is not supported (only 'silu')"
            )
        rope_type = (self.rope_scaling or {}).get(
            "rope_type", (self.rope_scaling or {}).get("type", "default")
        )
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise CheckpointError(
                f"config.json: rope type {rope_type!r} is not supported {SUPPORTED_ROPE_TYPES}"
            )

    # Derived sizes.
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one token's cache entry per layer: the latent plus the decoupled rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def has_moe(self) -> bool:
        return self.n_routed_experts > 0 and self.first_k_dense_replace < self.num_hidden_layers

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    @property
    def moe_layer_ids(self) -> list[int]:
        if not self.has_moe:
            return []
        return list(range(self.first_k_dense_replace, self.num_hidden_layers))

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict (both the `rope_scaling` and `rope_parameters`
        spellings)."""
        archs = raw.get("architectures") or [raw.get("model_type", "?")]
        if "DeepseekV3ForCausalLM" not in archs and raw.get("model_type") != "deepseek_v3":
            raise CheckpointError(
                f"unsupported architecture {archs}; pdmesh serves {SUPPORTED_ARCHITECTURES}"
            )
        values = dict(raw)
        rope_params = values.get("rope_parameters")
        if isinstance(rope_params, dict):
            values.setdefault("rope_theta", rope_params.get("rope_theta", 10000.0))
            if rope_params.get("rope_type", "default") != "default":
                values["rope_scaling"] = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        eos = values.get("eos_token_id")
        values["eos_token_ids"] = tuple(
            eos if isinstance(eos, list) else ([] if eos is None else [eos])
        )
        if values.get("dtype") and not values.get("torch_dtype"):
            values["torch_dtype"] = values["dtype"]
        names = {f.name for f in fields(cls)}
        missing = [
            f.name
            for f in fields(cls)
            if f.name not in values and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise CheckpointError(f"config.json is missing {missing}")
        kwargs = {k: v for k, v in values.items() if k in names}
        if kwargs.get("torch_dtype") is None:
            kwargs.pop("torch_dtype", None)
        return cls(**kwargs)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """The model's hyper-parameters from `model_dir/config.json`."""
        if not Path(model_dir).is_dir():
            raise CheckpointError(
                f"{model_dir}: not a directory (expected a Hugging Face model directory)"
            )
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(
                f"{model_dir}: no config.json (is this a Hugging Face model directory?)"
            )
        return cls.from_dict(read_json(path))


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs a model: memory, batching and device."""

    block_size: int | None = None  # None: the model's (16 for V3; V4: a multiple of its rates)
    num_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads of this process; None: torch's default
    expert_load_window: int = 1000  # steps of per-slot expert load kept for EPLB (a ring)
    # decode: at most this many requests whose KV just arrived join the batch per step; None: no cap
    max_kv_loads_per_step: int | None = None
    # speculative decoding (see pdmesh_engine.spec_decode): None (off) | "mtp"
    # (the checkpoint's own MTP layer drafts) | "draft_model" (a smaller checkpoint in
    # `draft_model` drafts); `num_speculative_tokens` K drafts per step, 1..8 when a method is set
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    draft_model: str | None = None
    # decode steps of up to this many requests replay CUDA graphs where the Triton kernels run
    # (pdmesh_engine.cuda_graphs); 0: every step eager (vLLM's enforce_eager)
    cuda_graph_max_batch: int = 64

    def __post_init__(self) -> None:
        if self.block_size is not None and (
            self.block_size <= 0 or self.block_size & (self.block_size - 1)
        ):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.expert_load_window < 1:
            raise ValueError(f"expert_load_window must be >= 1, got {self.expert_load_window}")
        if self.max_kv_loads_per_step is not None and self.max_kv_loads_per_step < 1:
            raise ValueError(
                "max_kv_loads_per_step must be >= 1 (or None: no cap), "
                f"got {self.max_kv_loads_per_step}"
            )
        if self.cuda_graph_max_batch < 0:
            raise ValueError(
                f"cuda_graph_max_batch must be >= 0 (0: no CUDA graphs), "
                f"got {self.cuda_graph_max_batch}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        self._validate_speculation()

    def _validate_speculation(self) -> None:
        method, k = self.speculative_method, self.num_speculative_tokens
        if method is None:
            if k:
                raise ValueError(
                    f"num_speculative_tokens={k} needs a speculative_method "
                    f"({' or '.join(SPECULATIVE_METHODS)})"
                )
            if self.draft_model is not None:
                raise ValueError("draft_model needs speculative_method='draft_model'")
            return
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS} (or None), got {method!r}"
            )
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] with "
                f"speculative_method={method!r}, got {k}"
            )
        if method == "draft_model" and not self.draft_model:
            raise ValueError(
                "speculative_method='draft_model' needs draft_model: a checkpoint directory"
            )
        if method != "draft_model" and self.draft_model is not None:
            raise ValueError("draft_model is only used with speculative_method='draft_model'")

    def context_limit(self, model_config: ModelConfig, num_tokens_in_pool: int) -> int:
        """The longest sequence the engine admits: max_model_len (default the model's maximum),
        within the model's maximum and the KV pool's tokens."""
        longest = model_config.max_position_embeddings
        return min(self.max_model_len or longest, longest, num_tokens_in_pool)

    @property
    def num_spec_tokens(self) -> int:
        """K: drafts verified per decode step (0: speculative decoding is off)."""
        return self.num_speculative_tokens if self.speculative_method else 0
