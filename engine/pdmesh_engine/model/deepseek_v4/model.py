"""The DeepSeek-V4 causal LM: `forward(batch, cache) -> hidden [T, D]`, `compute_logits`.

    embed -> N copies of the residual stream [T, N, D]
    per layer: mHC collapse -> attn_norm -> attention (window + CSA/HCA, attention.py) -> expand
               mHC collapse -> ffn_norm -> MoE (hash or top-k routed) -> expand
    hyper-head collapse -> norm -> head

Weights load from the release's tensor names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, ...) and from both of transformers' save layouts
(`checkpoint_names.canonical`).

Routed experts live in physical slots, as V3's (pdmesh_engine.model.moe): each layer's MoE runs
on an `ExpertPlacement`, this process's slots and an `ExpertDispatcher` (DEP: `model_kwargs` from
`DEPContext.model_kwargs`, the all-to-all on the collapsed mHC state); each routed expert's
checkpoint tensors are read into the local slots that hold it, and a placement switch re-reads
them through `expert_source`.

With `load_mtp` the first multi-token-prediction layer (`mtp.0.*`) is held too, for speculative
decoding (`forward_mtp`, `compute_mtp_logits`). Its math is the training module's
(pdmesh.train.model_v4 `MTPBlock`, the release layout llama.cpp reads): at position t it reads the
main model's final residual streams at t (before the hyper-head) and the embedding of token t + 1,

    streams = h_proj(hnorm(streams)) + e_proj(enorm(embed)) (broadcast over the N streams)
    -> one decoder block (sliding-window attention with sinks, top-k MoE, mHC)
    -> its own hyper-head `hc_head`, its norm `norm`, the shared head

and predicts token t + 2. Its attention's state is a window of K=V entries only (no compressed
entries), in a pool of its own addressed by the target's window tables.

Legend: T tokens, N hc_mult, D hidden size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdmesh_engine.config import CheckpointError
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v4.attention import Attention
from pdmesh_engine.model.deepseek_v4.blocks import HyperConnection, HyperHead, MoE, RMSNorm, Rope
from pdmesh_engine.model.deepseek_v4.checkpoint_names import canonical, expert_part
from pdmesh_engine.model.deepseek_v4.config import CSA, HCA, SLIDING, TOPK_MOE, V4Config
from pdmesh_engine.model.deepseek_v4.expert_tensors import V4ExpertTensors
from pdmesh_engine.model.deepseek_v4.kv import V4Cache, V4Step
from pdmesh_engine.model.moe import ExpertDispatcher, ExpertLoadRecorder, ExpertPlacement

if TYPE_CHECKING:
    from pdmesh_engine.parallel.placement import CheckpointTensors


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: V4Config,
        layer_id: int,
        placement: ExpertPlacement | None = None,
        dispatcher: ExpertDispatcher | None = None,
        local_slots: range | None = None,
    ) -> None:
        """`placement`, `dispatcher`, `local_slots`: the MoE's (`blocks.MoE`; by default every
        expert here, slot e holding expert e)."""
        super().__init__()
        self.attn = Attention(config, layer_id)
        self.ffn = MoE(config, layer_id, placement, dispatcher, local_slots)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_attn = HyperConnection(config)
        self.hc_ffn = HyperConnection(config)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        step: V4Step,
        pools: dict[str, torch.Tensor],
        expert_load: ExpertLoadRecorder | None = None,
    ) -> torch.Tensor:
        x, post, comb = self.hc_attn(streams)
        streams = self.hc_attn.expand(
            streams, self.attn(self.attn_norm(x), step, pools), post, comb
        )
        x, post, comb = self.hc_ffn(streams)  # the MoE runs on the collapsed state
        out = self.ffn(self.ffn_norm(x), input_ids, expert_load)
        return self.hc_ffn.expand(streams, out, post, comb)


class MTPLayer(DecoderLayer):
    """`mtp.K.*`: a sliding-window decoder block with a top-k MoE behind the input projections,
    and its own hyper-head and norm before the shared head (module docstring). `config` is the
    block's own: one sliding layer, so `V4Step.build` addresses its window only."""

    def __init__(self, config: V4Config) -> None:
        config = replace(
            config, num_hidden_layers=1, layer_types=(SLIDING,), mlp_layer_types=(TOPK_MOE,)
        )
        super().__init__(config, 0)
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(h, eps)

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        step: V4Step,
        pools: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """embeds [T, D] of tokens t + 1 (ids `input_ids`), streams [T, N, D] at t -> the block's
        output streams [T, N, D]."""
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(1)
        return super().forward(x, input_ids, step, pools)

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """Output streams [T, N, D] -> the hidden state before the shared head [T, D]."""
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(
        self,
        config: V4Config,
        load_mtp: bool = False,
        placements: list[ExpertPlacement] | None = None,
        dispatcher: ExpertDispatcher | None = None,
        local_slots: list[range] | None = None,
    ) -> None:
        """`placements`, `dispatcher`, `local_slots` (DEP's `DEPContext.model_kwargs`): one
        placement and one range of this process's slots per decoder layer, and the dispatcher
        they share; by default every expert is here, slot e holding expert e. The MTP layer's MoE
        keeps every expert here."""
        super().__init__()
        self.config = config
        n = config.num_hidden_layers
        layer_placements: list[ExpertPlacement | None] = (
            [None] * n if placements is None else list(placements)
        )
        layer_slots: list[range | None] = [None] * n if local_slots is None else list(local_slots)
        if len(layer_placements) != n or len(layer_slots) != n:
            raise ValueError(
                f"need one placement and one slot range per MoE layer ({n}), got "
                f"{len(layer_placements)} and {len(layer_slots)}"
            )
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, layer_placements[i], dispatcher, layer_slots[i])
            for i in range(n)
        )
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # the first MTP layer only: speculative decoding runs it K times for K drafts
        self.mtp = nn.ModuleList(
            [MTPLayer(config)] if load_mtp and config.num_nextn_predict_layers else []
        )

    @property
    def moe_layers(self) -> list[MoE]:
        """The decoder's MoE layers, whose experts EPLB places (every layer; the MTP layer's MoE
        is not placed)."""
        return [layer.ffn for layer in self.layers]  # type: ignore[misc]

    def placed_moe_layers(self) -> list[tuple[int, MoE]]:
        """(checkpoint layer index, MoE) of the layers a placement switch moves experts in
        (pdmesh_engine.parallel.placement): the decoder's."""
        return list(enumerate(self.moe_layers))

    @staticmethod
    def expert_source(tensors: CheckpointTensors) -> V4ExpertTensors:
        """How a placement switch reads one routed expert's tensor from this model's checkpoint:
        any of V4's layouts, dequantised (`expert_tensors.V4ExpertTensors`)."""
        return V4ExpertTensors(tensors)

    @property
    def moe_experts(self) -> list[MoE]:
        """Every MoE module held, the MTP layer's included."""
        return [layer.ffn for layer in (*self.layers, *self.mtp)]

    def materialize(self) -> None:
        """Recompute the buffers that are not checkpoint tensors (rope tables)."""
        for module in self.modules():
            if isinstance(module, Rope):
                module.materialize()

    def forward(
        self,
        batch: ForwardBatch,
        cache: V4Cache,
        expert_load: ExpertLoadRecorder | None = None,
    ) -> torch.Tensor:
        """The batch's tokens through the model -> final hidden states [T, D] (normed).
        `expert_load`: where each MoE layer records the tokens routed to its slots (None: not
        recorded, e.g. DEP's dummy passes)."""
        return self.final_hidden(self.forward_streams(batch, cache, expert_load))

    def forward_streams(
        self,
        batch: ForwardBatch,
        cache: V4Cache,
        expert_load: ExpertLoadRecorder | None = None,
    ) -> torch.Tensor:
        """The batch's tokens through the decoder layers -> the final residual streams
        [T, N, D] (what the MTP layer reads)."""
        step = V4Step.build(batch, self.config, cache.block_size)
        streams = self.embed(batch.input_ids)
        streams = streams.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer_id, layer in enumerate(self.layers):
            streams = layer(
                streams, batch.input_ids, step, self.pools(cache, layer_id), expert_load
            )
        return streams

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams [T, N, D] -> hidden states [T, D]: hyper-head collapse, norm."""
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def forward_mtp(
        self,
        next_ids: torch.Tensor,
        streams: torch.Tensor,
        batch: ForwardBatch,
        mtp_kv_caches: torch.Tensor,
    ) -> torch.Tensor:
        """The first MTP layer at the batch's positions: next_ids [T] (token t + 1 for the row at
        position t), streams [T, N, D] (the target's `forward_streams` at t, or this method's own
        output when drafting recursively), mtp_kv_caches [1, num_window_blocks, block_size,
        head_dim] (its window's K=V entries, addressed by the batch's window tables) -> the MTP
        block's output streams [T, N, D] (before its hyper-head); rope at position t."""
        mtp = self.mtp[0]
        step = V4Step.build(batch, mtp.config, mtp_kv_caches.shape[2])
        return mtp(self.embed(next_ids), streams, next_ids, step, {"window": mtp_kv_caches[0]})

    def compute_mtp_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [S, N, D] (`forward_mtp` rows) -> [S, vocab] fp32: the MTP layer's hyper-head
        and norm, then the shared head (predicts the token two places after the row's
        position)."""
        return self.compute_logits(self.mtp[0].hidden(streams))

    def pools(self, cache: V4Cache, layer_id: int) -> dict[str, torch.Tensor]:
        """Layer `layer_id`'s views of the cache tensors."""
        kind = self.config.layer_types[layer_id]
        views = {"window": cache.window[layer_id]}
        if kind == CSA:
            i = cache.kind_index[layer_id]
            views |= {
                "rows": cache.csa_rows[i],
                "entries": cache.csa_kv[i],
                "index_rows": cache.csa_index_rows[i],
                "index": cache.csa_index[i],
            }
        elif kind == HCA:
            i = cache.kind_index[layer_id]
            views |= {"rows": cache.hca_rows[i], "entries": cache.hca_kv[i]}
        return views

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the model; CheckpointError on an unknown name, a shape
        mismatch, or a parameter the checkpoint did not provide."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        params = {k: v for k, v in params.items() if not k.endswith("inv_freq")}
        loaded: set[str] = set()
        experts_seen: dict[str, set[tuple[int, str]]] = {}
        for raw_name, tensor in tensors:
            name = canonical(raw_name)
            if name.startswith("mtp.") and int(name.split(".")[1]) >= len(self.mtp):
                continue  # an MTP layer the model does not hold
            part = expert_part(name)
            if part is not None:
                layer_name, expert, which = part
                moe = self.get_submodule(layer_name)
                if which == "w13":  # transformers' fused [E, 2I, D] / [E, D, I]
                    moe.load_stacked("w13", tensor)
                    loaded.add(f"{layer_name}.w13")
                elif which == "w2_all":
                    moe.load_stacked("w2", tensor)
                    loaded.add(f"{layer_name}.w2")
                else:  # into the local slots that hold the expert (none, one, or replicas)
                    moe.load_expert(expert, which, tensor)
                    experts_seen.setdefault(layer_name, set()).add((expert, which))
                continue
            target = params.get(name)
            if target is None:
                raise CheckpointError(f"checkpoint tensor {raw_name!r} has no place in the model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"checkpoint tensor {raw_name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        for layer_name, seen in experts_seen.items():
            if len(seen) == 3 * self.config.n_routed_experts:
                loaded |= {f"{layer_name}.w13", f"{layer_name}.w2"}
        missing = sorted(set(params) - loaded)
        if self.mtp and not any(name.startswith("mtp.") for name in loaded):
            raise CheckpointError(
                "the checkpoint has no MTP layer (no mtp.0.* tensors): speculative_method 'mtp' "
                "needs one"
            )
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensors: {missing[:6]}")
