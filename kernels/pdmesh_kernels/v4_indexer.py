"""DeepSeek-V4's Lightning Indexer (CSA layers): per query, a score for each visible compressed
entry, and the `top_k` entries the query's sparse attention reads.

    score[t, e] = sum_h (weights[t, h] * Hi^-0.5) * Ci^-0.5 * ReLU(q[t, h] . index_key[e]),
                  e < visible[t]   (-inf for e >= visible[t])
    chosen[t]   = torch.topk(score[t], min(top_k, E)).indices,  ok = chosen < visible[t]

exactly as the engine's `Indexer.forward` (pdmesh_engine.model.deepseek_v4.attention) computes it,
in fp32 whatever the input dtype. Inputs are what the engine already holds, so a call copies
nothing: the rope'd indexer queries, the raw `weights_proj` output, the layer's index pool as a
flat [slots, Ci] view, and the step's `Entries.slots` / `V4Step.token_seq` / `Entries.visible`,
which address each sequence's entries in the paged pool (the keys are read through the slots, not
gathered per query as the torch path does).

`indexer_scores_ref` is the torch reference, `indexer_scores_triton` a Triton kernel (one
program per query and block of entries, all indexer heads in one tl.dot). The top-k of both is
taken by `torch.topk` on the scores (`select_top_k`): with equal scores the Triton path picks the
very indices, ties included, that the engine picks, and a top-k in Triton would have to reproduce
`torch.topk`'s tie order per device. `indexer_topk_ref`, `indexer_topk_triton` and the dispatcher
`indexer_topk` return (chosen, ok) as `Indexer.forward` does.
"""

from __future__ import annotations

import torch

from .mla_decode import HAS_TRITON, uses_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "indexer_scores_ref",
    "indexer_scores_triton",
    "indexer_topk",
    "indexer_topk_ref",
    "indexer_topk_triton",
    "select_top_k",
]

# Legend: T query tokens, Hi indexer heads, Ci indexer head dim, S sequences, E entries per
# sequence (the step's widest), NS pool slots, k chosen entries (min(top_k, E)).

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)


def _check_inputs(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    entry_slots: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
) -> None:
    """Shape/dtype contract of the public functions (metadata only: no device sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hi, Ci], got {tuple(q.shape)}")
    t, heads, dim = q.shape
    if weights.shape != (t, heads):
        raise ValueError(f"weights must be [{t}, {heads}], got {tuple(weights.shape)}")
    if index_pool.dim() != 2 or index_pool.shape[1] != dim:
        raise ValueError(f"index_pool must be [slots, {dim}], got {tuple(index_pool.shape)}")
    if entry_slots.dim() != 2 or entry_slots.dtype not in _INT_DTYPES:
        raise ValueError(
            f"entry_slots must be int32/int64 [S, E], got {entry_slots.dtype} "
            f"{tuple(entry_slots.shape)}"
        )
    for name, v in (("token_seq", token_seq), ("visible", visible)):
        if v.shape != (t,) or v.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be int32/int64 [{t}], got {v.dtype} {tuple(v.shape)}")
    for name, v in (("q", q), ("weights", weights), ("index_pool", index_pool)):
        if v.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float tensor, got dtype {v.dtype}")


def indexer_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    entry_slots: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Torch reference: the engine's expression on keys gathered per query.

    q [T, Hi, Ci] (rope applied), weights [T, Hi] (`weights_proj` output, unscaled),
    index_pool [NS, Ci], entry_slots [S, E] int, token_seq [T] int, visible [T] int.
    Returns score [T, E] fp32, -inf for the entries a query does not see.
    """
    _check_inputs(q, weights, index_pool, entry_slots, token_seq, visible)
    heads, dim = q.shape[1:]
    slots = entry_slots[token_seq.long()]  # [T, E]
    keys = index_pool[slots.long()]  # [T, E, Ci]
    scores = torch.relu(torch.einsum("thc,tec->the", q.float(), keys.float())) * dim**-0.5
    score = (scores * (weights.float() * heads**-0.5)[..., None]).sum(dim=1)
    hidden = torch.arange(slots.shape[1], device=q.device)[None, :] >= visible[:, None]
    return score.masked_fill(hidden, float("-inf"))


if HAS_TRITON:

    @triton.jit
    def _indexer_scores_kernel(
        q_ptr,
        w_ptr,
        pool_ptr,
        slots_ptr,
        seq_ptr,
        vis_ptr,
        out_ptr,
        scale,
        head_scale,
        num_heads,
        head_dim,
        num_entries,
        stride_qt,
        stride_qh,
        stride_wt,
        stride_pool,
        stride_ss,
        stride_ot,
        BLOCK_H: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_E: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        # Program (t, entry block): score[t, block] for every head at once (one tl.dot of the
        # [Hi, Ci] queries with the block's [BLOCK_E, Ci] keys read through the slots).
        t = tl.program_id(0)
        offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        offs_h = tl.arange(0, BLOCK_H)
        offs_c = tl.arange(0, BLOCK_C)
        mask_h = offs_h < num_heads
        mask_c = offs_c < head_dim
        seq = tl.load(seq_ptr + t).to(tl.int64)
        visible = tl.load(vis_ptr + t)
        live = (offs_e < visible) & (offs_e < num_entries)
        q = tl.load(
            q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_c[None, :],
            mask=mask_h[:, None] & mask_c[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + t * stride_wt + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        slot = tl.load(slots_ptr + seq * stride_ss + offs_e, mask=live, other=0).to(tl.int64)
        k = tl.load(
            pool_ptr + slot[:, None] * stride_pool + offs_c[None, :],
            mask=live[:, None] & mask_c[None, :],
            other=0.0,
        )  # [BLOCK_E, BLOCK_C]
        if UPCAST_DOT:  # the Triton interpreter cannot tl.dot bf16 (triton#11584)
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        dots = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_E] fp32
        per_head = tl.maximum(dots, 0.0) * scale * (w * head_scale)[:, None]
        score = tl.where(live, tl.sum(per_head, axis=0), float("-inf"))
        tl.store(out_ptr + t * stride_ot + offs_e, score, mask=offs_e < num_entries)


def indexer_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    entry_slots: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Triton kernel; same contract as `indexer_scores_ref`. The last dims of q, weights,
    index_pool and entry_slots must be contiguous (the engine's are)."""
    if not HAS_TRITON:
        raise RuntimeError("indexer_scores_triton needs the triton package")
    _check_inputs(q, weights, index_pool, entry_slots, token_seq, visible)
    if any(v.stride(-1) != 1 for v in (q, weights, index_pool, entry_slots)):
        raise ValueError("q, weights, index_pool and entry_slots need a contiguous last dimension")
    tokens, heads, dim = q.shape
    num_entries = entry_slots.shape[1]
    out = torch.empty(tokens, num_entries, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out
    block_e = 64 if dim <= 128 else 32
    grid = (tokens, triton.cdiv(num_entries, block_e))
    _indexer_scores_kernel[grid](
        q,
        weights,
        index_pool,
        entry_slots,
        token_seq,
        visible,
        out,
        dim**-0.5,
        heads**-0.5,
        heads,
        dim,
        num_entries,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        index_pool.stride(0),
        entry_slots.stride(0),
        out.stride(0),
        BLOCK_H=max(16, triton.next_power_of_2(heads)),  # tl.dot needs M >= 16
        BLOCK_C=max(16, triton.next_power_of_2(dim)),
        BLOCK_E=block_e,
        DOT_PRECISION="ieee",  # bf16 inputs: exact products, fp32 sums, as q.float() @ k.float()
        UPCAST_DOT=not q.is_cuda,
        num_warps=4,
    )
    return out


def select_top_k(
    score: torch.Tensor, visible: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """score [T, E] -> (chosen [T, k] int64 entry indices, ok [T, k]: chosen and visible), the
    engine's `torch.topk` over the whole padded row (hidden entries fill the k slots a query with
    fewer than k visible entries leaves)."""
    chosen = score.topk(min(top_k, score.shape[1]), dim=-1).indices
    return chosen, chosen < visible[:, None]


def indexer_topk_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    entry_slots: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_top_k` of `indexer_scores_ref`: the engine's `Indexer.forward` after its
    projections."""
    score = indexer_scores_ref(q, weights, index_pool, entry_slots, token_seq, visible)
    return select_top_k(score, visible, top_k)


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    entry_slots: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_top_k` of `indexer_scores_triton`."""
    score = indexer_scores_triton(q, weights, index_pool, entry_slots, token_seq, visible)
    return select_top_k(score, visible, top_k)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_pool: torch.Tensor,
    entry_slots: torch.Tensor,
    token_seq: torch.Tensor,
    visible: torch.Tensor,
    top_k: int,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: Triton when use_triton is True, or None where `uses_triton`; else the
    reference."""
    if use_triton is None:
        use_triton = uses_triton(q.device)
    fn = indexer_topk_triton if use_triton else indexer_topk_ref
    return fn(q, weights, index_pool, entry_slots, token_seq, visible, top_k)
