"""The DeepSeek-V3 architecture in its training form: whole sequences, causal attention, autograd.

Parameter names follow the Hugging Face `DeepseekV3ForCausalLM` checkpoint (`export.py` writes
them unchanged, the MTP module renamed to the layer index after the decoder's), and the maths is
the engine's: the same RMSNorm, rope tables (interleaved pairs) and attention scale, the same
group-limited sigmoid routing with the correction bias used for the choice only. A test checks
the logits against transformers on the same weights.

What training adds, as the DeepSeek-V3 report describes it:
- auxiliary-loss-free balancing: the router's `e_score_correction_bias` is not learnt by
  gradient; after each step `update_balance_bias` moves it by `gamma` towards equal expert loads;
- a small sequence-wise balance loss (weight `alpha`) on the normalised routing scores;
- one multi-token-prediction module (embedding and output head shared with the main model) that
  predicts token t+2 from the main model's final hidden state at t and the embedding of token t+1.

Legend: B batch, T tokens per sequence, D hidden size, E routed experts, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.model.deepseek_v3.layers import (
    DenseMLP,
    RMSNorm,
    RotaryEmbedding,
    attention_scale,
)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rope on the last dim of `x` with the engine's tables (cos, sin broadcast to x)."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        y = torch.cat((x1, x2), dim=-1)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        y = x
    return y * cos + torch.cat((x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Multi-head latent attention, expanded (no cache): x [B, T, D] -> [B, T, D]."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.heads, self.lora = c.num_attention_heads, c.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.interleave, self.scale = c.rope_interleave, attention_scale(c)
        qk_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(c.q_lora_rank, qk_out, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, qk_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, self.heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.heads * self.v_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = (
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            if hasattr(self, "q_a_proj")
            else (self.q_proj(x))
        )
        q_nope, q_pe = q.view(b, t, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope_dim], dim=-1)
        q_pe = rotate(q_pe, cos, sin, self.interleave)  # cos/sin [T, 1, R]
        k_pe = rotate(k_pe, cos[:, 0], sin[:, 0], self.interleave)  # [B, T, R]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)  # [B, H, T, N + R]
        k = torch.cat((k_nope, k_pe[:, :, None].expand(-1, -1, self.heads, -1)), dim=-1)
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Gate(nn.Module):
    """The router: sigmoid scores in fp32; the bias shifts the choice, not the weights."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.norm_topk_prob, self.scaling = c.norm_topk_prob, c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, K], expert ids [N, K], scores [N, E]), all fp32."""
        with torch.autocast(x.device.type, enabled=False):
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        with torch.no_grad():
            choice = scores + self.e_score_correction_bias
            if self.topk_group < self.n_group:
                grouped = choice.view(x.shape[0], self.n_group, -1)
                group_ids = grouped.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]
                dropped = torch.ones(grouped.shape[:2], dtype=torch.bool, device=x.device)
                dropped.scatter_(1, group_ids, False)
                choice = grouped.masked_fill(dropped[:, :, None], float("-inf")).view_as(choice)
            ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids, scores


@dataclass
class RoutingStats:
    """One MoE layer's routing in a step: tokens per expert and the sequence-wise balance loss."""

    load: torch.Tensor  # [E] tokens routed to each expert (no grad)
    balance_loss: torch.Tensor  # scalar, with grad into the router


class MoE(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = c.n_routed_experts, c.num_experts_per_tok
        self.gate = Gate(c)
        self.experts = nn.ModuleList(
            DenseMLP(c.hidden_size, c.moe_intermediate_size) for _ in range(c.n_routed_experts)
        )
        self.shared_experts = (
            DenseMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
            if c.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        weights, ids, scores = self.gate(flat)
        out = torch.zeros_like(flat)
        order = ids.view(-1).argsort()
        counts = torch.bincount(ids.view(-1), minlength=self.num_experts)
        rows = order // self.top_k  # token of each sorted (token, k) pair
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                sel, pairs = rows[start : start + n], order[start : start + n]
                y = self.experts[e](flat[sel]) * weights.view(-1)[pairs, None].to(flat.dtype)
                out = out.index_add(0, sel, y.to(out.dtype))
            start += n
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(b, t, d), RoutingStats(counts.detach(), self._balance_loss(ids, scores, b))

    def _balance_loss(self, ids: torch.Tensor, scores: torch.Tensor, b: int) -> torch.Tensor:
        """Sequence-wise: sum_i f_i P_i per sequence, averaged; f_i is expert i's share of the
        sequence's choices scaled so uniform is 1, P_i its mean normalised score."""
        e, k = self.num_experts, self.top_k
        ids, scores = ids.view(b, -1, k), scores.view(b, -1, e)
        t = ids.shape[1]
        chosen = torch.zeros(b, e, device=ids.device).scatter_add_(
            1, ids.reshape(b, -1), torch.ones(b, t * k, device=ids.device)
        )
        f = chosen * e / (k * t)
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        return (f * p).sum(-1).mean()


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, moe: bool) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp: MoE | DenseMLP = MoE(c) if moe else DenseMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stats: list[RoutingStats]
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            y, routing = self.mlp(h)
            stats.append(routing)
            return x + y
        return x + self.mlp(h)


class Backbone(nn.Module):
    """`model.*` of the checkpoint: embedding, decoder layers, final norm."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        moe_ids = set(c.moe_layer_ids)
        self.layers = nn.ModuleList(
            DecoderLayer(c, i in moe_ids) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MTPModule(nn.Module):
    """Predicts token t+2 from the main model's final hidden state at t and the embedding of
    token t+1: eh_proj(cat(enorm(embedding), hnorm(hidden))) through one decoder layer."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.block = DecoderLayer(c, c.has_moe)
        self.shared_head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        stats: list[RoutingStats],
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.shared_head_norm(self.block(x, cos, sin, stats))


@dataclass
class Losses:
    """One batch's losses (scalars with grad) and the MoE layers' routing (decoder, then MTP)."""

    lm: torch.Tensor  # next-token cross-entropy, mean over tokens
    mtp: torch.Tensor  # the MTP module's cross-entropy (token t+2); 0 without MTP
    balance: torch.Tensor  # sequence-wise balance loss, mean over MoE layers
    routing: list[RoutingStats]

    def total(self, mtp_weight: float, balance_weight: float) -> torch.Tensor:
        return self.lm + mtp_weight * self.mtp + balance_weight * self.balance


class DeepseekV3ForTraining(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config)
        self.mtp = nn.ModuleList(MTPModule(config) for _ in range(config.num_nextn_predict_layers))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Linear weights N(0, 1/fan_in) scaled down on the residual outputs, embeddings
        N(0, 1), norms 1, router N(0, 1/D), biases 0 (deterministic for a seed)."""
        gen = torch.Generator().manual_seed(seed)
        depth = 2 * (self.config.num_hidden_layers + len(self.mtp))
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= depth**0.5
            if name == "lm_head.weight":
                std *= 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for module in self.modules():
            if isinstance(module, Gate):
                module.e_score_correction_bias.zero_()

    def hidden_states(self, input_ids: torch.Tensor, stats: list[RoutingStats]) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, D] (after the final norm)."""
        t = input_ids.shape[1]
        cos, sin = self.rope.cos[:t], self.rope.sin[:t]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, stats)
        return self.model.norm(x)

    def forward(self, tokens: torch.Tensor) -> Losses:
        """tokens [B, T + 1]: inputs tokens[:, :-1], next-token targets tokens[:, 1:]; the MTP
        module sees positions 0..T-2 and predicts tokens[:, 2:]."""
        stats: list[RoutingStats] = []
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        hidden = self.hidden_states(inputs, stats)
        lm = self._cross_entropy(hidden, targets)
        mtp = hidden.new_zeros((), dtype=torch.float32)
        if len(self.mtp):
            t = inputs.shape[1] - 1
            embeds = self.model.embed_tokens(inputs[:, 1:])
            cos, sin = self.rope.cos[:t], self.rope.sin[:t]
            mtp_hidden = self.mtp[0](embeds, hidden[:, :-1], cos, sin, stats)
            mtp = self._cross_entropy(mtp_hidden, tokens[:, 2:])
        balance = (
            torch.stack([s.balance_loss for s in stats]).mean()
            if stats
            else hidden.new_zeros((), dtype=torch.float32)
        )
        return Losses(lm, mtp, balance, stats)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> next-token logits [B, T, V] (fp32)."""
        return self.lm_head(self.hidden_states(input_ids, [])).float()

    def _cross_entropy(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def moe_gates(self) -> list[Gate]:
        """The routers in the order `Losses.routing` reports them (decoder layers, then MTP)."""
        return [m for m in self.modules() if isinstance(m, Gate)]

    @torch.no_grad()
    def update_balance_bias(self, routing: list[RoutingStats], gamma: float) -> None:
        """Auxiliary-loss-free balancing: raise the bias of under-loaded experts by gamma, lower
        the over-loaded ones'."""
        for gate, stats in zip(self.moe_gates(), routing, strict=True):
            load = stats.load.float()
            gate.e_score_correction_bias.add_(gamma * torch.sign(load.mean() - load))
