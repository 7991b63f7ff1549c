"""Inputs for the DeepSeek-V4 kernel tests: random paged steps laid out as the engine lays them
(`V4Step`, `Entries`), and one real engine attention layer run on a ragged step, whose
intermediates the references must reproduce.

Legend: T query tokens, S sequences, W window, E entries per sequence, H / C heads / head_dim,
Hi / Ci indexer heads / head dim, NR / NE window / entry pool slots.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from pdmesh.tools.model_init_v4 import v4_preset_config
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v4.attention import Attention
from pdmesh_engine.model.deepseek_v4.blocks import apply_rope, unweighted_rms_norm
from pdmesh_engine.model.deepseek_v4.config import CSA, HCA, V4Config
from pdmesh_engine.model.deepseek_v4.kv import V4Cache, V4Step, default_block_size

GARBAGE = 100.0  # fills pool slots no query may read; a masking bug shows up as a large error
CPU = torch.device("cpu")


@dataclass
class PagedStep:
    """One step's addressing: each sequence's tokens and entries at scattered pool slots."""

    token_seq: torch.Tensor  # [T] int64
    visible: torch.Tensor  # [T] int64 entries each query sees: (position + 1) // rate
    window_slots: torch.Tensor  # [T, W] int64
    window_valid: torch.Tensor  # [T, W] bool
    entry_slots: torch.Tensor  # [S, E] int64, padded with slot 0
    window_rows: int  # slots of the window pool
    entry_rows: int  # slots of the entry pool
    window_used: torch.Tensor  # [window_rows] bool: slots holding some sequence's token
    entry_used: torch.Tensor  # [entry_rows] bool


def paged_step(
    seqs: list[tuple[int, int]], rate: int, window: int, gen: torch.Generator
) -> PagedStep:
    """seqs: (tokens cached after the step, of them queried in the step) per sequence."""
    lens = [n for n, _ in seqs]
    num_entries = max(max(lens) // rate, 1)
    window_rows, entry_rows = sum(lens) + 7, sum(n // rate for n in lens) + 5
    token_perm = torch.randperm(window_rows, generator=gen)
    entry_perm = torch.randperm(entry_rows, generator=gen)
    entry_slots = torch.zeros(len(seqs), num_entries, dtype=torch.int64)
    window_used = torch.zeros(window_rows, dtype=torch.bool)
    entry_used = torch.zeros(entry_rows, dtype=torch.bool)
    token_seq, positions, slot_rows = [], [], []
    t0 = e0 = 0
    for s, (n, queries) in enumerate(seqs):
        tok = token_perm[t0 : t0 + n]
        window_used[tok] = True
        ent = entry_perm[e0 : e0 + n // rate]
        entry_used[ent] = True
        entry_slots[s, : n // rate] = ent
        for p in range(n - queries, n):
            key_pos = torch.arange(p - window + 1, p + 1)
            token_seq.append(s)
            positions.append(p)
            slot_rows.append(tok[key_pos.clamp(min=0)])
        t0, e0 = t0 + n, e0 + n // rate
    pos = torch.tensor(positions)
    return PagedStep(
        token_seq=torch.tensor(token_seq),
        visible=(pos + 1) // rate,
        window_slots=torch.stack(slot_rows),
        window_valid=pos[:, None] - window + 1 + torch.arange(window)[None, :] >= 0,
        entry_slots=entry_slots,
        window_rows=window_rows,
        entry_rows=entry_rows,
        window_used=window_used,
        entry_used=entry_used,
    )


def pool(used: torch.Tensor, width: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[slots, width] rows: random where `used`, GARBAGE elsewhere; a column slice of a wider
    tensor, so its row stride differs from its width."""
    wide = torch.full((used.shape[0], width + 3), GARBAGE)
    wide[used, :width] = torch.randn(int(used.sum()), width, generator=gen)
    return wide.to(dtype)[:, :width]


@dataclass
class EngineLayer:
    """A tiny-preset attention layer after a ragged step, and what its torch path computed."""

    attn: Attention
    step: V4Step
    q: torch.Tensor  # [T, H, C] the attention queries
    index_q: torch.Tensor  # [T, Hi, Ci] the indexer's queries (CSA)
    index_weights: torch.Tensor  # [T, Hi] the indexer's weights_proj output (CSA)
    window: torch.Tensor  # [NR, C] flat window pool
    entries: torch.Tensor  # [NE, C] flat entry pool (compressed layers; else empty)
    index: torch.Tensor  # [NE, Ci] flat index pool (CSA)
    chosen: torch.Tensor  # [T, k] the indexer's choice (CSA)
    ok: torch.Tensor  # [T, k]
    out: torch.Tensor  # [T, H, C] `_attend`'s output


@torch.no_grad()
def engine_layer(kind: str, seed: int = 0) -> EngineLayer:
    """Runs the tiny preset's first `kind` layer over a prefill step, then over a ragged step (a
    decode, a prompt's next chunk, a new prompt), and records the second step's intermediates."""
    torch.manual_seed(seed)
    config = V4Config.from_dict(v4_preset_config("tiny", "float32"))
    layer_id = config.layer_types.index(kind)
    attn = Attention(config, layer_id).eval()
    attn.attn_sink.normal_()
    block_size = default_block_size(config)
    ids = list(range(1, 10))
    random.Random(seed).shuffle(ids)
    tables = [ids[0:3], ids[3:6], ids[6:9]]
    cache = V4Cache(config, 10, block_size, torch.float32, CPU)
    pools = {"window": cache.window[layer_id]}
    i = cache.kind_index.get(layer_id)
    if kind == CSA:
        pools |= {
            "rows": cache.csa_rows[i],
            "entries": cache.csa_kv[i],
            "index_rows": cache.csa_index_rows[i],
            "index": cache.csa_index[i],
        }
    elif kind == HCA:
        pools |= {"rows": cache.hca_rows[i], "entries": cache.hca_kv[i]}

    def run(chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, V4Step]:
        """chunks: (sequence, tokens, start position), decodes first."""
        batch = ForwardBatch.build(
            [[1] * n for _, n, _ in chunks],
            [start for _, _, start in chunks],
            [tables[s] for s, _, _ in chunks],
            block_size,
            [True] * len(chunks),
            CPU,
        )
        step = V4Step.build(batch, config, block_size)
        x = torch.randn(batch.num_tokens, config.hidden_size)
        attn(x, step, pools)
        return x, step

    run([(0, 45, 0), (1, 22, 0)])
    x, step = run([(0, 1, 45), (1, 7, 22), (2, 9, 0)])
    tokens = x.shape[0]
    cos, sin = attn.rope.tables(step.positions, x.dtype)
    q_lora = attn.q_norm(attn.wq_a(x))
    q = unweighted_rms_norm(attn.wq_b(q_lora).view(tokens, attn.heads, attn.dim), attn.eps)
    q = apply_rope(q, cos, sin)
    window = pools["window"].view(-1, attn.dim)
    entries = step.entries.get(kind)
    keys, valid = attn._keys(x, q_lora, step, entries, pools, window, slice(0, tokens))
    none = torch.empty(0)
    index_q = index_weights = index = chosen = ok = none
    if kind == CSA:
        ix = attn.indexer
        index_q = apply_rope(ix.wq_b(q_lora).view(tokens, ix.heads, ix.dim), cos, sin)
        index_weights = ix.weights_proj(x)
        index = pools["index"].view(-1, ix.dim)
        chosen, ok = ix(x, q_lora, step, entries, pools["index"], attn.rope, slice(0, tokens))
    return EngineLayer(
        attn=attn,
        step=step,
        q=q,
        index_q=index_q,
        index_weights=index_weights,
        window=window,
        entries=pools["entries"].view(-1, attn.dim) if entries is not None else none,
        index=index,
        chosen=chosen,
        ok=ok,
        out=attn._attend(q, keys, valid),
    )
