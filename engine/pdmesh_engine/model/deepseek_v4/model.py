"""The DeepSeek-V4 causal LM: `forward(batch, cache) -> hidden [T, D]`, `compute_logits`.

    embed -> N copies of the residual stream [T, N, D]
    per layer: mHC collapse -> attn_norm -> attention (window + CSA/HCA, attention.py) -> expand
               mHC collapse -> ffn_norm -> MoE (hash or top-k routed) -> expand
    hyper-head collapse -> norm -> head

Weights load from the release's tensor names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, ...) and from both of transformers' save layouts
(`checkpoint_names.canonical`). The multi-token-prediction layers (`mtp.*`) are not loaded yet.

Legend: T tokens, N hc_mult, D hidden size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdmesh_engine.config import CheckpointError
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v4.attention import Attention
from pdmesh_engine.model.deepseek_v4.blocks import HyperConnection, HyperHead, MoE, RMSNorm, Rope
from pdmesh_engine.model.deepseek_v4.checkpoint_names import canonical, expert_part
from pdmesh_engine.model.deepseek_v4.config import CSA, HCA, V4Config
from pdmesh_engine.model.deepseek_v4.kv import V4Cache, V4Step
from pdmesh_engine.model.moe import write_expert_part


class DecoderLayer(nn.Module):
    def __init__(self, config: V4Config, layer_id: int) -> None:
        super().__init__()
        self.attn = Attention(config, layer_id)
        self.ffn = MoE(config, layer_id)
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
    ) -> torch.Tensor:
        x, post, comb = self.hc_attn(streams)
        streams = self.hc_attn.expand(
            streams, self.attn(self.attn_norm(x), step, pools), post, comb
        )
        x, post, comb = self.hc_ffn(streams)
        return self.hc_ffn.expand(streams, self.ffn(self.ffn_norm(x), input_ids), post, comb)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def moe_layers(self) -> list[object]:
        """The layers whose experts EPLB places: none yet (V4's experts are not placed; that comes
        with V4 across the mesh)."""
        return []

    @property
    def moe_experts(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers]  # type: ignore[misc]

    def materialize(self) -> None:
        """Recompute the buffers that are not checkpoint tensors (rope tables)."""
        for module in self.modules():
            if isinstance(module, Rope):
                module.materialize()

    def forward(
        self, batch: ForwardBatch, cache: V4Cache, expert_load: object = None
    ) -> torch.Tensor:
        """The batch's tokens through the model -> final hidden states [T, D] (normed)."""
        step = V4Step.build(batch, self.config, cache.block_size)
        streams = self.embed(batch.input_ids)
        streams = streams.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer_id, layer in enumerate(self.layers):
            streams = layer(streams, batch.input_ids, step, self.pools(cache, layer_id))
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

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
            if name is None:  # mtp.* and other tensors the model does not hold
                continue
            part = expert_part(name)
            if part is not None:
                layer_name, expert, which = part
                moe = self.get_submodule(layer_name)
                if which == "w13":  # transformers' fused [E, 2I, D] / [E, D, I]
                    moe.w13.copy_(tensor)
                    loaded.add(f"{layer_name}.w13")
                elif which == "w2_all":
                    moe.w2.copy_(tensor)
                    loaded.add(f"{layer_name}.w2")
                else:
                    write_expert_part(moe.w13.data, moe.w2.data, expert, which, tensor)
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
            moe = self.get_submodule(layer_name)
            if len(seen) == 3 * moe.w13.shape[0]:
                loaded |= {f"{layer_name}.w13", f"{layer_name}.w2"}
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensors: {missing[:6]}")
