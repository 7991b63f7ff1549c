"""The DeepSeek-V4 architecture in its training form: whole sequences [B, T], autograd.

Parameter names are the release's (`embed.weight`, `layers.N.attn.kv_norm.weight`,
`layers.N.ffn.experts.E.w1.weight`, `mtp.0.e_proj.weight`, ...), with the hyper-connection
tensors as submodules (`layers.N.hc_attn.fn` for the release's `layers.N.hc_attn_fn`), so the
export (`export.py`) is a rename only. The per-token blocks are the engine's
(`pdmesh_engine.model.deepseek_v4.blocks`: norms, rope tables, mHC, hyper-head, shared expert,
router; the compressor and indexer modules hold their parameters); attention is written here for
whole sequences, as transformers' `DeepseekV4ForCausalLM` computes it without a cache:

- every layer attends to a sliding window of `sliding_window` keys (K = V, one KV head, a learned
  sink per head, the output's rope slice rotated back to the query's position);
- CSA and HCA layers add compressed entries, one per complete window of `rate` tokens of the
  sequence (CSA: two overlapping series), visible to query t when e < (t + 1) // rate;
- CSA: the Lightning Indexer scores the visible entries (sum_h w_h ReLU(q_h . k)) and the query
  attends to its top `index_topk` only; picks that are not visible (early queries with fewer
  visible entries than k) are dropped, as transformers' -1 does.

A test checks the logits against transformers on the same weights.

What training adds:
- the indexer's choice is not differentiable, so the indexer learns from an auxiliary loss, as
  DeepSeek-V3.2 trains its Lightning Indexer (dense warm-up form): the KL divergence from the main
  attention's distribution over the visible compressed entries (its logits there, softmaxed per
  head, summed over heads and L1-normalised, detached) to the softmax of the indexer's scores
  over the same entries, averaged over the queries that see an entry. The indexer's inputs
  (block input, query latent) are detached, so this loss trains the indexer's own projections
  (`wq_b`, `weights_proj`, its compressor) only and the language-model loss does not reach them;
- hash layers route by `tid2eid[token]`, a frozen random table (distinct experts per token, seeded
  by `init_weights`); top-k routers are balanced without an auxiliary loss, as the V3 trainer
  does: the router's correction bias (`ffn.gate.bias`, a buffer) moves by `gamma` towards equal
  expert loads after each step (`update_balance_bias`), plus a small sequence-wise balance loss;
- one multi-token-prediction module in the release's layout (`mtp.0.*`, as llama.cpp's DeepSeek-V4
  converter and graph read it): it predicts token t+2 from the main model's final residual
  streams at t (before the hyper-head) and the embedding of token t+1:
  streams = h_proj(hnorm(streams)) + e_proj(enorm(embedding)) (broadcast over the streams), one
  decoder block with mHC (sliding-window attention with sinks, top-k MoE), then its own
  hyper-head `hc_head_*`, its norm `norm` and the shared head; the embedding is shared too.

Legend: B batch, T tokens, N hc_mult streams, D hidden, H heads, C head_dim, E compressed
entries, K keys, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh.train.model import Losses, RoutingStats
from pdmesh_engine.model.deepseek_v4.attention import Compressor, Indexer
from pdmesh_engine.model.deepseek_v4.blocks import (
    HyperConnection,
    HyperHead,
    RMSNorm,
    Rope,
    Router,
    SharedExpert,
    apply_rope,
    unweighted_rms_norm,
)
from pdmesh_engine.model.deepseek_v4.config import CSA, HASH_MOE, SLIDING, TOPK_MOE, V4Config

HC_INIT_STD = 0.02  # transformers' initializer_range for the mHC projections


@dataclass
class Tally:
    """What a forward pass collects besides its output."""

    routing: list[RoutingStats] = field(default_factory=list)  # top-k MoE layers, in order
    indexer: list[torch.Tensor] = field(default_factory=list)  # per CSA layer, its KL


@dataclass
class LossesV4(Losses):
    """`Losses` plus the indexers' auxiliary loss (mean over CSA layers; 0 in no-grad passes)."""

    indexer: torch.Tensor

    def total(self, mtp_weight: float, balance_weight: float) -> torch.Tensor:
        """The indexer loss enters with weight 1: it reaches only the indexers' parameters."""
        return super().total(mtp_weight, balance_weight) + self.indexer


def rope_bt(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The engine's `apply_rope` on x [B, T, ..., C] with cos/sin [T, R/2]."""
    return apply_rope(x.transpose(0, 1), cos, sin).transpose(0, 1)


def compress(compressor: Compressor, x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x [B, T, D] -> one entry per complete window of the sequence [B, T // rate, dim]: the
    engine's pooling, fed every window's rows (CSA: the previous window's rows first, none
    before window 0)."""
    b, t, _ = x.shape
    r, n = compressor.rate, t // compressor.rate
    if n == 0:
        return x.new_zeros(b, 0, compressor.dim)
    rows = compressor.rows(x[:, : n * r]).view(b, n, r, -1)
    first = torch.zeros(b, n, dtype=torch.bool, device=x.device)
    if compressor.series == 2:
        rows = torch.cat((torch.cat((torch.zeros_like(rows[:, :1]), rows[:, :-1]), 1), rows), 2)
        first[:, 0] = True
    positions = (torch.arange(n, device=x.device) * r).repeat(b)
    pooled = compressor.pool(rows.flatten(0, 1), first.flatten(), rope, positions)
    return pooled.view(b, n, -1)


def index_scores(
    indexer: Indexer,
    x: torch.Tensor,
    q_lora: torch.Tensor,
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The Lightning Indexer's score of every (query, entry): x [B, T, D], q_lora [B, T, Q], its
    entries keys [B, E, Ci] -> [B, T, E] fp32, sum_h w_h ReLU(q_h . k) / sqrt(Ci * Hi)."""
    b, t, _ = x.shape
    q = rope_bt(indexer.wq_b(q_lora).view(b, t, indexer.heads, indexer.dim), cos, sin)
    dots = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))  # [B, T, Hi, E]
    weights = indexer.weights_proj(x).float() * indexer.heads**-0.5
    return (F.relu(dots) * indexer.dim**-0.5 * weights[..., None]).sum(dim=2)


def indexer_kl(score: torch.Tensor, logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """KL(main attention || indexer) over the visible entries (module docstring): score
    [B, T, E] (with grad), the main attention's logits on the entries [B, H, T, E] (detached),
    visible [T, E]; mean over the queries that see at least one entry."""
    seen = visible.any(dim=-1)
    score, logits, visible = score[:, seen], logits[:, :, seen], visible[seen]
    if not visible.numel():
        return score.new_zeros(())
    target = logits.float().masked_fill(~visible, float("-inf")).softmax(dim=-1).mean(dim=1)
    log_q = score.masked_fill(~visible, float("-inf")).log_softmax(dim=-1)
    kl = F.kl_div(log_q.masked_fill(~visible, 0.0), target, reduction="none")
    return kl.sum(dim=-1).mean()


def window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool: query i sees key j when i - window < j <= i."""
    i = torch.arange(t, device=device)
    offset = i[:, None] - i[None, :]
    return (offset >= 0) & (offset < window)


class Attention(nn.Module):
    """One layer's attention over a whole sequence: x [B, T, D] (normed block input) -> [B, T, D].
    Names as the release's `layers.N.attn.*`."""

    def __init__(self, config: V4Config, kind: str) -> None:
        super().__init__()
        self.heads, self.dim, self.groups = (
            config.num_attention_heads,
            config.head_dim,
            config.o_groups,
        )
        self.window, self.eps, self.rate = (
            config.sliding_window,
            config.rms_norm_eps,
            config.rate(kind),
        )
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.dim, bias=False)
        self.kv_norm = RMSNorm(self.dim, config.rms_norm_eps)
        group_in = self.heads * self.dim // self.groups
        self.wo_a = nn.Linear(group_in, self.groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.rope = Rope(config.main_rope if kind == SLIDING else config.compress_rope)
        self.compressor = (
            Compressor(config, self.rate, self.dim, 2 if kind == CSA else 1)
            if kind != SLIDING
            else None
        )
        self.indexer = Indexer(config) if kind == CSA else None

    def forward(self, x: torch.Tensor, tally: Tally) -> torch.Tensor:
        b, t, _ = x.shape
        cos, sin = self.rope.tables(torch.arange(t, device=x.device), torch.float32)
        q_lora = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_lora).view(b, t, self.heads, self.dim), self.eps)
        q = rope_bt(q, cos, sin)
        keys = rope_bt(self.kv_norm(self.wkv(x)), cos, sin)  # the window's K = V [B, T, C]
        mask = window_mask(t, self.window, x.device).expand(b, t, t)
        compressed = self.compressor is not None and t >= self.rate
        if compressed:
            entries, chosen, visible, score = self._entries(x, q_lora, cos, sin)
            keys, mask = torch.cat((keys, entries), dim=1), torch.cat((mask, chosen), dim=-1)
        logits = torch.einsum("bthc,bkc->bhtk", q, keys) * self.dim**-0.5  # [B, H, T, K]
        if compressed and score is not None and torch.is_grad_enabled():
            tally.indexer.append(indexer_kl(score, logits[..., t:].detach(), visible))
        out = rope_bt(self._attend(logits, mask, keys), cos, -sin)  # un-rotate at the query
        return self._project(out)

    def _entries(
        self, x: torch.Tensor, q_lora: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The compressed entries [B, E, C], which each query attends to [B, T, E], which it may
        see [T, E] (e < (t + 1) // rate), and the indexer's scores [B, T, E] (CSA; else None)."""
        assert self.compressor is not None
        b, t, _ = x.shape
        entries = compress(self.compressor, x, self.rope)
        e = entries.shape[1]
        seen = torch.arange(1, t + 1, device=x.device)[:, None] // self.rate
        visible = torch.arange(e, device=x.device)[None, :] < seen
        if self.indexer is None:
            return entries, visible.expand(b, t, e), visible, None
        score = self._index(x, q_lora, cos, sin)
        return entries, self._choose(score.detach(), visible), visible, score

    def _index(
        self, x: torch.Tensor, q_lora: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The indexer's scores [B, T, E] from detached inputs (module docstring)."""
        assert self.indexer is not None
        x, q_lora = x.detach(), q_lora.detach()
        keys = compress(self.indexer.compressor, x, self.rope)
        return index_scores(self.indexer, x, q_lora, keys, cos, sin)

    def _choose(self, score: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[B, T, E] bool: the top `index_topk` visible entries of each query (fewer when fewer
        are visible: picks past the visible ones are dropped)."""
        assert self.indexer is not None
        e = score.shape[-1]
        top = score.masked_fill(~visible, float("-inf")).topk(min(self.indexer.top_k, e)).indices
        chosen = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, True)
        return chosen & visible

    def _attend(self, logits: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """logits [B, H, T, K], mask [B, T, K], keys [B, K, C] (K = V) -> [B, T, H, C]; softmax
        with a sink per head."""
        b, h, t, _ = logits.shape
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        sink = self.attn_sink.to(logits.dtype).view(1, h, 1, 1).expand(b, h, t, 1)
        probs = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("bhtk,bkc->bthc", probs.to(keys.dtype), keys)

    def _project(self, out: torch.Tensor) -> torch.Tensor:
        """The grouped low-rank output projection: [B, T, H, C] -> [B, T, D]."""
        b, t = out.shape[:2]
        grouped = out.reshape(b, t, self.groups, -1)  # [B, T, G, H*C/G]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [G, R, H*C/G]
        return self.wo_b(torch.einsum("btgi,gri->btgr", grouped, w).flatten(2))


class TrainRouter(Router):
    """The engine's router with the correction bias a buffer (moved by `update_balance_bias`, not
    by gradient); `route` also returns the scores (the balance loss) and runs in fp32."""

    def __init__(self, config: V4Config, hashed: bool) -> None:
        super().__init__(config, hashed)
        if not hashed:
            del self.bias
            self.register_buffer("bias", torch.zeros(config.n_routed_experts))

    def route(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, K], expert ids [T, K], scores [T, E]), fp32."""
        with torch.autocast(x.device.type, enabled=False):
            scores = self.score(F.linear(x.float(), self.weight.float()))
        with torch.no_grad():
            ids = (
                self.tid2eid[input_ids] if self.hashed else (scores + self.bias).topk(self.top_k)[1]
            )
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids, scores


def balance_loss(ids: torch.Tensor, scores: torch.Tensor, b: int) -> torch.Tensor:
    """The V3 trainer's sequence-wise balance loss: sum_i f_i P_i per sequence, averaged (f_i:
    expert i's share of the sequence's choices, uniform = 1; P_i: its mean normalised score).
    ids [B*T, K], scores [B*T, E]."""
    e, k = scores.shape[-1], ids.shape[-1]
    ids, scores = ids.view(b, -1, k), scores.view(b, -1, e)
    t = ids.shape[1]
    chosen = torch.zeros(b, e, device=ids.device).scatter_add_(
        1, ids.reshape(b, -1), torch.ones(b, t * k, device=ids.device)
    )
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return (chosen * e / (k * t) * p).sum(-1).mean()


class MoE(nn.Module):
    """Routed experts `experts.E.w1/w2/w3` (clamped SwiGLU, the engine's SharedExpert module) plus
    the shared expert: x [B*T, D] -> [B*T, D]. Names as the release's `layers.N.ffn.*`."""

    def __init__(self, config: V4Config, mlp: str) -> None:
        super().__init__()
        width, hidden = config.moe_intermediate_size, config.hidden_size
        self.gate = TrainRouter(config, mlp == HASH_MOE)
        self.experts = nn.ModuleList(
            SharedExpert(hidden, width, config.swiglu_limit) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = SharedExpert(hidden, width, config.swiglu_limit)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, b: int, tally: Tally
    ) -> torch.Tensor:
        weights, ids, scores = self.gate.route(x, input_ids)
        top_k = ids.shape[1]
        out = torch.zeros_like(x)
        order = ids.view(-1).argsort()
        counts = torch.bincount(ids.view(-1), minlength=len(self.experts))
        rows = order // top_k  # token of each sorted (token, k) pair
        start = 0
        for expert, n in zip(self.experts, counts.tolist(), strict=True):
            if n:
                sel, pairs = rows[start : start + n], order[start : start + n]
                y = expert(x[sel]).float() * weights.view(-1)[pairs, None]
                out = out.index_add(0, sel, y.to(out.dtype))
            start += n
        if not self.gate.hashed:
            tally.routing.append(RoutingStats(counts.detach(), balance_loss(ids, scores, b)))
        return out + self.shared_experts(x)


class Block(nn.Module):
    """A decoder block with mHC around attention and MoE: streams [B*T, N, D] -> same."""

    def __init__(self, config: V4Config, kind: str, mlp: str) -> None:
        super().__init__()
        self.attn = Attention(config, kind)
        self.ffn = MoE(config, mlp)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_attn = HyperConnection(config)
        self.hc_ffn = HyperConnection(config)

    def forward(
        self, streams: torch.Tensor, input_ids: torch.Tensor, b: int, tally: Tally
    ) -> torch.Tensor:
        """input_ids [B*T] (hash routing); the hyper-connections run in fp32, outside autocast."""
        with torch.autocast(streams.device.type, enabled=False):
            x, post, comb = self.hc_attn(streams)
        out = self.attn(self.attn_norm(x).view(b, -1, x.shape[-1]), tally).flatten(0, 1)
        with torch.autocast(streams.device.type, enabled=False):
            streams = self.hc_attn.expand(streams, out.float(), post, comb)
            x, post, comb = self.hc_ffn(streams)
        out = self.ffn(self.ffn_norm(x), input_ids, b, tally)
        with torch.autocast(streams.device.type, enabled=False):
            return self.hc_ffn.expand(streams, out.float(), post, comb)


class MTPBlock(Block):
    """`mtp.K.*`: predicts token t+2 from the main model's final streams at t and the embedding of
    token t+1 (module docstring); a sliding-window block with a top-k MoE."""

    def __init__(self, config: V4Config) -> None:
        super().__init__(config, SLIDING, TOPK_MOE)
        h = config.hidden_size
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.hc_head = HyperHead(config)

    def predict(
        self, embeds: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor, tally: Tally
    ) -> torch.Tensor:
        """embeds [B, T, D] of tokens t+1 (ids input_ids [B, T]), main streams [B, T, N, D] at t
        -> the hidden state before the shared head [B, T, D]."""
        b, t, n, d = streams.shape
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embeds)).unsqueeze(2)
        x = super().forward(x.float().flatten(0, 1), input_ids.flatten(), b, tally)
        with torch.autocast(x.device.type, enabled=False):
            x = self.hc_head(x)
        return self.norm(x).view(b, t, d)


class DeepseekV4ForTraining(nn.Module):
    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config, kind, mlp)
            for kind, mlp in zip(config.layer_types, config.mlp_layer_types, strict=True)
        )
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPBlock(config) for _ in range(config.num_nextn_predict_layers))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic for a seed: linear weights N(0, 1/fan_in), the residual outputs (wo_b,
        the experts' w2) scaled down by sqrt(2 x blocks), embedding N(0, 1), head N(0, 1/D) / 2,
        routers N(0, 1/D), mHC projections N(0, 0.02) with base 0 and scale 1, norms 1; sinks,
        compressor position biases and correction biases 0 (transformers' initialisation); each
        hash table a random choice of distinct experts per token."""
        gen = torch.Generator().manual_seed(seed)
        depth = 2 * (len(self.layers) + len(self.mtp))
        for name, p in sorted(self.named_parameters()):
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or leaf == "scale":
                p.fill_(1.0)
            elif leaf in ("attn_sink", "ape", "base"):
                p.zero_()
            else:
                std = 1.0 if name == "embed.weight" else p.shape[-1] ** -0.5
                if leaf == "fn":
                    std = HC_INIT_STD
                elif name.endswith(("wo_b.weight", "w2.weight")):
                    std /= depth**0.5
                elif name == "head.weight":
                    std *= 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for router in self.routers(hashed=True):
            e, k = router.weight.shape[0], router.top_k
            router.tid2eid.copy_(
                torch.rand(len(router.tid2eid), e, generator=gen).argsort(-1)[:, :k]
            )
        for router in self.routers(hashed=False):
            router.bias.zero_()

    def routers(self, hashed: bool) -> list[TrainRouter]:
        """The hash (or top-k) routers, in forward order (decoder layers, then MTP)."""
        return [m for m in self.modules() if isinstance(m, TrainRouter) and m.hashed == hashed]

    def streams(self, input_ids: torch.Tensor, tally: Tally) -> torch.Tensor:
        """input_ids [B, T] -> the final residual streams [B, T, N, D] (before the hyper-head)."""
        b, t = input_ids.shape
        n = self.config.hc_mult
        x = self.embed(input_ids).flatten(0, 1).unsqueeze(1).expand(-1, n, -1).contiguous()
        for layer in self.layers:
            x = layer(x, input_ids.flatten(), b, tally)
        return x.view(b, t, n, -1)

    def hidden_states(self, streams: torch.Tensor) -> torch.Tensor:
        """Final streams [B, T, N, D] -> the hidden state before the head [B, T, D]."""
        b, t, n, d = streams.shape
        with torch.autocast(streams.device.type, enabled=False):
            x = self.hc_head(streams.flatten(0, 1))
        return self.norm(x).view(b, t, d)

    def forward(self, tokens: torch.Tensor) -> LossesV4:
        """tokens [B, T + 1]: inputs tokens[:, :-1], next-token targets tokens[:, 1:]; the MTP
        module sees positions 0..T-2 and predicts tokens[:, 2:]."""
        tally = Tally()
        inputs = tokens[:, :-1]
        streams = self.streams(inputs, tally)
        lm = self._cross_entropy(self.hidden_states(streams), tokens[:, 1:])
        zero = lm.new_zeros(())
        mtp = zero
        if len(self.mtp):
            nxt = inputs[:, 1:]
            hidden = self.mtp[0].predict(self.embed(nxt), streams[:, :-1], nxt, tally)
            mtp = self._cross_entropy(hidden, tokens[:, 2:])
        balance = (
            torch.stack([s.balance_loss for s in tally.routing]).mean() if tally.routing else zero
        )
        indexer = torch.stack(tally.indexer).mean() if tally.indexer else zero
        return LossesV4(lm, mtp, balance, tally.routing, indexer)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> next-token logits [B, T, V] (fp32)."""
        return self.head(self.hidden_states(self.streams(input_ids, Tally()))).float()

    def _cross_entropy(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def update_balance_bias(self, routing: list[RoutingStats], gamma: float) -> None:
        """Auxiliary-loss-free balancing of the top-k routers: raise the bias of under-loaded
        experts by gamma, lower the over-loaded ones'."""
        for router, stats in zip(self.routers(hashed=False), routing, strict=True):
            load = stats.load.float()
            router.bias.add_(gamma * torch.sign(load.mean() - load))
