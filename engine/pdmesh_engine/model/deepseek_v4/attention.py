"""DeepSeek-V4 attention over the paged V4 cache (`kv.py`): a sliding window of K=V entries on
every layer, plus compressed entries on CSA and HCA layers.

Per layer and step:
1. q (LoRA, per-head unweighted RMSNorm, rope) and the token's K=V entry (norm, rope), written
   to the window rows;
2. compressed layers: the compressor's kv/gate rows of the step's tokens are written, then every
   compression window that closes in the step is pooled (a softmax over its rows' gates plus a
   learned position bias, norm, rope at the window's first position) into one entry. CSA pools
   two overlapping series: the previous window's first series with the current window's second;
3. CSA: the Lightning Indexer scores the visible entries, sum_h w_h ReLU(q_h . k), and keeps the
   top `index_topk` (ties: `torch.topk`'s order; with 16 or more indexer heads exact ties did not
   occur in our tests);
4. attention over [window keys | chosen entries] with a learned sink per head, the output's rope
   slice rotated back to the query's position, and the grouped low-rank output projection.

Everything is gathered per token, so a step mixes decodes and prefill chunks of any lengths with
no padding to the longest; queries are processed in slices that bound the gathered keys' size.

Legend: T tokens, H heads, C head_dim, Hi / Ci indexer heads / head dim, W window, E entries,
K keys per query.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh_engine.model.deepseek_v4.blocks import RMSNorm, Rope, apply_rope, unweighted_rms_norm
from pdmesh_engine.model.deepseek_v4.config import CSA, SLIDING, V4Config
from pdmesh_engine.model.deepseek_v4.kv import Closing, Entries, V4Step
from pdmesh_kernels import (
    compressor_pool_triton,
    indexer_topk_triton,
    uses_triton,
    v4_attention_triton,
)

# gathered key elements per slice of queries (bounds the step's transient memory)
KEY_ELEMENTS_PER_SLICE = 1 << 24


class Compressor(nn.Module):
    """Pools every `rate` tokens into one entry of `dim` channels (`series` 2: overlapped)."""

    def __init__(self, config: V4Config, rate: int, dim: int, series: int) -> None:
        super().__init__()
        self.rate, self.dim, self.series = rate, dim, series
        self.wkv = nn.Linear(config.hidden_size, series * dim, bias=False)
        self.wgate = nn.Linear(config.hidden_size, series * dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, series * dim, dtype=torch.float32))
        self.norm = RMSNorm(dim, config.rms_norm_eps)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The per-token rows to cache: [T, 2 * series * dim] = (kv, gate)."""
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def pool(
        self, rows: torch.Tensor, first: torch.Tensor, rope: Rope, positions: torch.Tensor
    ) -> torch.Tensor:
        """rows [C, span, 2 * series * dim] of C closing windows -> entries [C, dim]."""
        kv, gate = rows.split(self.series * self.dim, dim=-1)
        gate = gate + self.ape.repeat(rows.shape[1] // self.rate, 1)
        if self.series == 2:  # previous window's first series, then this window's second
            r, d = self.rate, self.dim
            kv = torch.cat((kv[:, :r, :d], kv[:, r:, d:]), dim=1)
            gate = torch.cat((gate[:, :r, :d], gate[:, r:, d:]), dim=1)
            head = torch.zeros_like(first[:, None]).expand(-1, 2 * r).clone()
            head[:, :r] = first[:, None]
            kv = kv.masked_fill(head[..., None], 0.0)
            gate = gate.masked_fill(head[..., None], float("-inf"))
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        pooled = self.norm((kv * weights).sum(dim=1))
        cos, sin = rope.tables(positions, pooled.dtype)
        return apply_rope(pooled, cos, sin)

    def _pool_triton(self, flat_rows: torch.Tensor, closing: Closing, rope: Rope) -> torch.Tensor:
        """`pool` on CUDA: the Triton kernel (`pdmesh_kernels.v4_compressor`) reads the closing
        windows' rows through their slots (no gathered copy), then the same rope as `pool`."""
        pooled = compressor_pool_triton(
            flat_rows,
            closing.row_slots,
            closing.first,
            self.ape.float(),
            self.norm.weight.float(),
            self.norm.eps,
        )
        cos, sin = rope.tables(closing.positions, pooled.dtype)
        return apply_rope(pooled, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        step: V4Step,
        entries: Entries,
        rows_pool: torch.Tensor,
        entry_pool: torch.Tensor,
        rope: Rope,
    ) -> None:
        """Write the step's rows, then pool the windows that close in it into `entry_pool`."""
        flat_rows = rows_pool.view(-1, rows_pool.shape[-1])
        flat_rows[step.write_slots] = self.rows(x).to(flat_rows.dtype)
        closing = entries.closing
        if closing.write_slots.numel():
            if uses_triton(flat_rows.device):
                pooled = self._pool_triton(flat_rows, closing, rope)
            else:
                pooled = self.pool(
                    flat_rows[closing.row_slots], closing.first, rope, closing.positions
                )
            entry_pool.view(-1, self.dim)[closing.write_slots] = pooled.to(entry_pool.dtype)


class Indexer(nn.Module):
    """CSA's Lightning Indexer: its own overlapped compressor at `index_head_dim`, and a score per
    (query, entry) that chooses the entries the query attends to."""

    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.heads, self.dim, self.top_k = (
            config.index_n_heads,
            config.index_head_dim,
            config.index_topk,
        )
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(config, config.rate(CSA), self.dim, 2)

    def forward(
        self,
        x: torch.Tensor,
        q_lora: torch.Tensor,
        step: V4Step,
        entries: Entries,
        index_pool: torch.Tensor,
        rope: Rope,
        rows: slice,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For the query tokens `rows`: (chosen entry indices [t, k], chosen and visible [t, k]).
        On CUDA (`uses_triton`) the scores are a Triton kernel (`pdmesh_kernels.v4_indexer`), the
        top-k the same `torch.topk`."""
        t = rows.stop - rows.start
        q = self.wq_b(q_lora[rows]).view(t, self.heads, self.dim)
        cos, sin = rope.tables(step.positions[rows], q.dtype)
        q = apply_rope(q, cos, sin)
        if uses_triton(q.device):  # the scores read the keys through the slots, no gathered copy
            return indexer_topk_triton(
                q,
                self.weights_proj(x[rows]),
                index_pool.view(-1, self.dim),
                entries.slots,
                step.token_seq[rows],
                entries.visible[rows],
                self.top_k,
            )
        slots = entries.slots[step.token_seq[rows]]  # [t, E]
        keys = index_pool.view(-1, self.dim)[slots]  # [t, E, Ci]
        scores = F.relu(torch.einsum("thc,tec->the", q.float(), keys.float())) * self.dim**-0.5
        weights = self.weights_proj(x[rows]).float() * self.heads**-0.5
        score = (scores * weights[..., None]).sum(dim=1)  # [t, E]
        visible = entries.visible[rows]
        hidden = torch.arange(slots.shape[1], device=x.device)[None, :] >= visible[:, None]
        score = score.masked_fill(hidden, float("-inf"))
        chosen = score.topk(min(self.top_k, slots.shape[1]), dim=-1).indices
        return chosen, chosen < visible[:, None]


class Attention(nn.Module):
    def __init__(self, config: V4Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id, self.kind = layer_id, config.layer_types[layer_id]
        self.heads, self.dim, self.groups = (
            config.num_attention_heads,
            config.head_dim,
            config.o_groups,
        )
        self.window, self.eps = config.sliding_window, config.rms_norm_eps
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.dim, bias=False)
        self.norm = RMSNorm(self.dim, config.rms_norm_eps)
        group_in = self.heads * self.dim // self.groups
        self.wo_a = nn.Linear(group_in, self.groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.rope = Rope(config.main_rope if self.kind == SLIDING else config.compress_rope)
        self.rate = config.rate(self.kind)
        self.compressor = (
            Compressor(config, self.rate, self.dim, 2 if self.kind == CSA else 1)
            if self.kind != SLIDING
            else None
        )
        self.indexer = Indexer(config) if self.kind == CSA else None

    def forward(
        self, x: torch.Tensor, step: V4Step, pools: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """x [T, D] (normed block input) -> [T, D]. `pools`: this layer's views of the cache."""
        num_tokens = x.shape[0]
        cos, sin = self.rope.tables(step.positions, x.dtype)
        q_lora = self.q_norm(self.wq_a(x))
        q = unweighted_rms_norm(self.wq_b(q_lora).view(num_tokens, self.heads, self.dim), self.eps)
        q = apply_rope(q, cos, sin)
        kv = apply_rope(self.norm(self.wkv(x)), cos, sin)
        window = pools["window"].view(-1, self.dim)
        window[step.write_slots] = kv.to(window.dtype)
        entries = step.entries.get(self.kind)
        if self.compressor is not None:
            assert entries is not None
            self.compressor(x, step, entries, pools["rows"], pools["entries"], self.rope)
        if self.indexer is not None:
            assert entries is not None
            self.indexer.compressor(
                x, step, entries, pools["index_rows"], pools["index"], self.rope
            )
        if uses_triton(q.device):
            out = self._attend_triton(x, q, q_lora, step, entries, pools, window)
        else:
            out = torch.empty_like(q)
            per_slice = max(1, KEY_ELEMENTS_PER_SLICE // (self._keys_per_query(entries) * self.dim))
            for start in range(0, num_tokens, per_slice):
                rows = slice(start, min(start + per_slice, num_tokens))
                keys, valid = self._keys(x, q_lora, step, entries, pools, window, rows)
                out[rows] = self._attend(q[rows], keys, valid)
        out = apply_rope(out, cos, -sin)  # undo the values' rotation at the query's position
        grouped = out.view(num_tokens, self.groups, -1).transpose(0, 1)  # [G, T, H*C/G]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [G, R, H*C/G]
        mid = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(num_tokens, -1)
        return self.wo_b(mid)

    def _attend_triton(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        q_lora: torch.Tensor,
        step: V4Step,
        entries: Entries | None,
        pools: dict[str, torch.Tensor],
        window: torch.Tensor,
    ) -> torch.Tensor:
        """`_keys` + `_attend` on CUDA, for every query at once: the Triton kernel
        (`pdmesh_kernels.v4_sparse_attention`) reads the window and the (chosen) entries through
        their slots, so there is no gathered key copy to bound by slicing."""
        if entries is None:
            return v4_attention_triton(
                q, window, step.window_slots, step.window_valid, self.attn_sink, self.dim**-0.5
            )
        chosen = None
        if self.indexer is not None:
            everything = slice(0, q.shape[0])
            chosen, _ = self.indexer(
                x, q_lora, step, entries, pools["index"], self.rope, everything
            )
        return v4_attention_triton(
            q,
            window,
            step.window_slots,
            step.window_valid,
            self.attn_sink,
            self.dim**-0.5,
            pools["entries"].view(-1, self.dim),
            entries.slots,
            step.token_seq,
            entries.visible,
            chosen,
        )

    def _keys_per_query(self, entries: Entries | None) -> int:
        """Keys a query gathers: the window, and the compressed entries (CSA: at most top-k)."""
        if entries is None:
            return self.window
        count = entries.slots.shape[1]
        return self.window + (min(count, self.indexer.top_k) if self.indexer else count)

    def _keys(
        self,
        x: torch.Tensor,
        q_lora: torch.Tensor,
        step: V4Step,
        entries: Entries | None,
        pools: dict[str, torch.Tensor],
        window: torch.Tensor,
        rows: slice,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [t, K, C] and their mask [t, K] for the query tokens `rows`."""
        keys = window[step.window_slots[rows]]
        valid = step.window_valid[rows]
        if entries is None:
            return keys, valid
        slots = entries.slots[step.token_seq[rows]]  # [t, E]
        if self.indexer is not None:
            chosen, ok = self.indexer(x, q_lora, step, entries, pools["index"], self.rope, rows)
            slots = slots.gather(1, chosen)
        else:
            ok = (
                torch.arange(slots.shape[1], device=x.device)[None, :] < entries.visible[rows, None]
            )
        compressed = pools["entries"].view(-1, self.dim)[slots]
        return torch.cat((keys, compressed), dim=1), torch.cat((valid, ok), dim=1)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q [t, H, C], keys [t, K, C] (K = V), valid [t, K] -> [t, H, C]; softmax with a sink."""
        logits = torch.einsum("thc,tkc->thk", q, keys) * self.dim**-0.5
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sink = self.attn_sink.to(logits.dtype)[None, :, None].expand(q.shape[0], -1, 1)
        combined = torch.cat((logits, sink), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1]
        return torch.einsum("thk,tkc->thc", probs.to(keys.dtype), keys)
