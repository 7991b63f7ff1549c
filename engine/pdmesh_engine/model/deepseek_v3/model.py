"""The DeepSeek-V3 causal LM (also DeepSeek-R1, Kimi-K2, Moonlight checkpoints).

`forward(batch, kv_caches, expert_load) -> hidden [T, D]`, `compute_logits(hidden[rows]) -> [S,
vocab]`. Weights load from checkpoint names (`load_weights`); per-expert tensors go into the
physical slots of the layer's placement. The checkpoint's multi-token-prediction layers are loaded
as `mtp` (their weights are held and placed like the decoder's); `forward` is the plain next-token
model, and `forward_mtp` / `compute_mtp_logits` run the first MTP layer for speculative decoding.

Legend: T tokens, D hidden size, S sampled rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from pdmesh_engine.config import CheckpointError, ModelConfig
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v3.attention import AttentionMetadata, DecodeGather
from pdmesh_engine.model.deepseek_v3.layers import DenseMLP, MLAttention, RMSNorm, RotaryEmbedding
from pdmesh_engine.model.moe import (
    ExpertDispatcher,
    ExpertLoadRecorder,
    ExpertPlacement,
    LocalDispatcher,
    MoE,
)
from pdmesh_kernels import uses_triton

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class LayerPath(Protocol):
    """A faster path through the decoder layers and heads where it applies: the CPU one
    (`cpu_path.CpuLayerPath`, installed by `cpu_path.use_cpu_layouts`)."""

    def takes(self, batch: ForwardBatch, kv_caches: torch.Tensor) -> bool: ...

    def run(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: torch.Tensor,
        expert_load: ExpertLoadRecorder | None = None,
        mtp: bool = False,
    ) -> torch.Tensor: ...

    def linear(
        self, x: torch.Tensor, linear: nn.Linear, norm: RMSNorm | None = None
    ) -> torch.Tensor | None: ...

    def mtp_input(
        self, embeds: torch.Tensor, prev_hidden: torch.Tensor, mtp: MTPLayer
    ) -> torch.Tensor: ...


def _as_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        placement: ExpertPlacement | None,
        dispatcher: ExpertDispatcher,
        local_slots: range,
        moe_index: int = 0,
    ) -> None:
        """`moe_index`: the layer's index among the MoE layers (used only when this layer is
        MoE)."""
        super().__init__()
        self.self_attn = MLAttention(config)
        self.mlp: MoE | DenseMLP
        if placement is not None and layer_id >= config.first_k_dense_replace:
            self.mlp = MoE(config, placement, dispatcher, local_slots, moe_index)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        expert_load: ExpertLoadRecorder | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv_cache, rope, meta)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, expert_load) if isinstance(self.mlp, MoE) else self.mlp(h))


class MTPLayer(nn.Module):
    """One multi-token-prediction module: predicts token t+2 from hidden(t) and embedding(t+1)."""

    def __init__(
        self,
        config: ModelConfig,
        placement: ExpertPlacement | None,
        dispatcher: ExpertDispatcher,
        local_slots: range,
    ) -> None:
        super().__init__()
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        # its MoE follows the decoder's MoE layers (index len(moe_layer_ids)); it records no expert
        # load (speculative decoding runs it without a recorder)
        self.block = DecoderLayer(
            config,
            config.num_hidden_layers,
            placement,
            dispatcher,
            local_slots,
            len(config.moe_layer_ids),
        )
        self.shared_head_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.shared_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        embeds: torch.Tensor,
        prev_hidden: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.block(self.block_input(embeds, prev_hidden), batch, kv_cache, rope, meta)

    def block_input(self, embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj(cat(enorm(embeds), hnorm(prev_hidden))): the block's input [T, D]."""
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev_hidden)), dim=-1))


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        placements: list[ExpertPlacement] | None = None,
        dispatcher: ExpertDispatcher | None = None,
        local_slots: list[range] | None = None,
        load_mtp: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        moe_ids = config.moe_layer_ids
        if placements is None:
            placements = [ExpertPlacement.initial(config.n_routed_experts) for _ in moe_ids]
        if local_slots is None:
            local_slots = [range(p.num_physical) for p in placements]
        if len(placements) != len(moe_ids):
            raise ValueError(
                f"need one placement per MoE layer ({len(moe_ids)}), got {len(placements)}"
            )
        dispatcher = dispatcher or LocalDispatcher()
        by_layer = dict(zip(moe_ids, zip(placements, local_slots, strict=True), strict=True))
        # An explicit weight skips nn.Embedding's random init (which on the meta device imports
        # torch._dynamo).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            self._make_layer(config, i, by_layer, dispatcher)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config)
        self.mtp = nn.ModuleList()
        if load_mtp and config.num_nextn_predict_layers and moe_ids:
            placement, slots = by_layer[moe_ids[-1]]
            self.mtp = nn.ModuleList(
                MTPLayer(config, placement, dispatcher, slots)
                for _ in range(config.num_nextn_predict_layers)
            )
        self.cpu_layers: LayerPath | None = None  # set by cpu_path.use_cpu_layouts

    @staticmethod
    def _make_layer(
        config: ModelConfig, i: int, by_layer: dict, dispatcher: ExpertDispatcher
    ) -> DecoderLayer:
        placement, slots = by_layer.get(i, (None, range(0)))
        moe_index = config.moe_layer_ids.index(i) if i in by_layer else 0
        return DecoderLayer(config, i, placement, dispatcher, slots, moe_index)

    @property
    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: torch.Tensor,
        expert_load: ExpertLoadRecorder | None = None,
    ) -> torch.Tensor:
        """kv_caches [num_layers, num_blocks, block_size, L + R] -> hidden states [T, D] (final norm
        applied).

        `expert_load`: where each MoE layer records the tokens routed to its slots (None: not
        recorded)."""
        x = self.embed_tokens(batch.input_ids)
        if self.cpu_layers is not None and self.cpu_layers.takes(batch, kv_caches):
            return self.cpu_layers.run(x, batch, kv_caches, expert_load)
        meta = self.attention_metadata(batch, kv_caches)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, batch, kv_cache, self.rope, meta, expert_load)
        return self.norm(x)

    def attention_metadata(self, batch: ForwardBatch, kv_caches: torch.Tensor) -> AttentionMetadata:
        """The step's inputs shared by every attention layer (rope rows; the CPU decode gather)."""
        cos, sin = self.rope.tables(batch.positions, self.embed_tokens.weight.dtype)
        gather = (
            DecodeGather.build(batch, kv_caches.shape[2])
            if kv_caches.device.type == "cpu" and not uses_triton(kv_caches.device)
            else None
        )
        return AttentionMetadata(cos, sin, gather)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _as_fp32(self._linear(hidden, self.lm_head))

    def forward_mtp(
        self,
        next_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        batch: ForwardBatch,
        mtp_kv_caches: torch.Tensor,
    ) -> torch.Tensor:
        """The first MTP layer at the batch's positions: next_ids [T] (token t + 1 for the row at
        position t), prev_hidden [T, D] (the target's `forward` output at t, final norm applied, or
        this method's own output when drafting recursively), mtp_kv_caches [1, num_blocks,
        block_size, L + R] (its attention's own cache, addressed like the target's) -> the MTP
        block's output x [T, D] (before shared_head_norm). Input at t: eh_proj(cat(enorm(embed(
        token t + 1)), hnorm(h_t))); rope at position t."""
        mtp = self.mtp[0]
        if self.cpu_layers is not None and self.cpu_layers.takes(batch, mtp_kv_caches):
            embeds = self.embed_tokens(next_ids)
            x = self.cpu_layers.mtp_input(embeds, prev_hidden, mtp)
            x = x if x.dtype == embeds.dtype else x.to(embeds.dtype)
            return self.cpu_layers.run(x, batch, mtp_kv_caches, mtp=True)
        meta = self.attention_metadata(batch, mtp_kv_caches)
        return mtp(
            self.embed_tokens(next_ids), prev_hidden, batch, mtp_kv_caches[0], self.rope, meta
        )

    def compute_mtp_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, D] (`forward_mtp` rows) -> [S, vocab] fp32: the MTP layer's own head (predicts the
        token two places after the row's position)."""
        mtp = self.mtp[0]
        return _as_fp32(self._linear(x, mtp.shared_head, mtp.shared_head_norm))

    def _linear(
        self, x: torch.Tensor, linear: nn.Linear, norm: RMSNorm | None = None
    ) -> torch.Tensor:
        """linear(norm(x)): by the C product where the CPU path takes it (then fp32)."""
        if self.cpu_layers is not None:
            y = self.cpu_layers.linear(x, linear, norm)
            if y is not None:
                return y
        return linear(x if norm is None else norm(x))

    # ----- weights -----
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by name; raises CheckpointError on unknown names, bad shapes or
        gaps."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        num_layers = self.config.num_hidden_layers
        for name, tensor in tensors:
            target = self._target_name(name, num_layers)
            if target is None:
                continue
            expert = _EXPERT.search(target)
            if expert:
                self._load_expert(target, expert, tensor)
                loaded.add(target)
                continue
            if target not in params:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} does not belong to DeepseekV3ForCausalLM"
                )
            param = params[target]
            if tuple(param.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(target)
        if len(self.mtp) and not any(n.startswith("mtp.") for n in loaded):
            self.mtp = nn.ModuleList()  # the checkpoint has no MTP weights: hold none
            params = dict(self.named_parameters())
        missing = [n for n in params if n not in loaded and not self._is_expert_param(n)]
        num_experts = sum(1 for n in loaded if _EXPERT.search(n))
        expected = 3 * self.config.n_routed_experts * (len(self.moe_layers) + len(self.mtp))
        if num_experts != expected:
            missing.append(f"{expected - num_experts} expert tensors")
        if missing:
            raise CheckpointError(
                f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}"
            )
        for layer in list(self.layers) + [m.block for m in self.mtp]:
            layer.self_attn.process_weights()
        for mtp in self.mtp:  # DeepSeek's MTP head is a copy of the output head: hold (read) one
            if torch.equal(mtp.shared_head.weight, self.lm_head.weight):
                mtp.shared_head.weight = self.lm_head.weight

    def _target_name(self, name: str, num_layers: int) -> str | None:
        """Checkpoint name -> parameter name here (None: a tensor this model does not use)."""
        name = name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            return None
        match = re.match(r"layers\.(\d+)\.(.*)$", name)
        if not match:
            return name
        index, rest = int(match.group(1)), match.group(2)
        if index < num_layers:
            return name
        mtp_index = index - num_layers
        if mtp_index >= len(self.mtp):
            return None
        if rest in ("embed_tokens.weight",):
            return None  # DeepSeek stores a copy of the shared embedding here
        rest = rest.replace("shared_head.norm", "shared_head_norm").replace(
            "shared_head.head", "shared_head"
        )
        if rest.split(".")[0] not in (
            "enorm",
            "hnorm",
            "eh_proj",
            "shared_head_norm",
            "shared_head",
        ):
            rest = "block." + rest
        return f"mtp.{mtp_index}.{rest}"

    def _load_expert(self, target: str, match: re.Match, tensor: torch.Tensor) -> None:
        owner = self.get_submodule(target.split(".mlp.")[0] + ".mlp")
        logical, part = int(match.group(1)), match.group(2)
        width, hidden = owner.w2.shape[2], owner.w2.shape[1]
        expected = (hidden, width) if part == "down_proj" else (width, hidden)
        if tuple(tensor.shape) != expected:
            raise CheckpointError(f"{target}: expected shape {expected}, got {tuple(tensor.shape)}")
        owner.load_expert(logical, part, tensor)

    @staticmethod
    def _is_expert_param(name: str) -> bool:
        return name.endswith(".mlp.w13") or name.endswith(".mlp.w2")
