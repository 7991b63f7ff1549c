"""Routed-expert compute over a layer's slots: `routed_experts` (sort, compute, combine) and
`expert_rows` (each row through its slot's MLP).

    out[t] = sum_k weights[t, k] * expert_{slot_ids[t, k]}(x[t])
    expert_e(x) = W_down (silu(W_gate x) * (W_up x)),  w13[e] = [W_gate; W_up], w2[e] = W_down

With `swiglu_limit` (DeepSeek-V4) the gate is clamped to at most the limit and the up projection to
[-limit, limit] before the product.

On CUDA the Triton kernels of `pdmesh_kernels` run (`fused_moe`, `grouped_expert_mlp`). On CPU,
with the weights in the row-table layout (`to_row_tables`; the model runner stores CPU experts
that way), each matrix-vector product is one `embedding_bag` over rows of the transposed weights:

    W13t = w13.transpose(1, 2)  [P, D, 2I] contiguous: gate_up(x) = sum_d x[d] * W13t[e, d]
    W2t  = w2.transpose(1, 2)   [P, I, D] contiguous:  down(h)    = sum_i h[i] * W2t[e, i]

No Python loop over experts, no read back to the host, a fixed number of ops whatever the batch;
each row reads only its own slot's weights, once, and rows are sorted by slot so that a slot's
weights stay in cache across its rows. Measured on a 2-core CPU (64 experts, D 512, I 128, cold
weights, one thread): about 0.19 ms per layer for one token (a per-expert `mm` loop 0.39, a
`torch._grouped_mm` over every slot 0.47, gathering the chosen weights with `index_select` for a
`bmm` 1.04) and 3.1 ms for 32 tokens (the per-expert loop 6.3, `_grouped_mm` 6.1). From
`GROUPED_ROWS_PER_SLOT` rows per slot on (prefill) matrix-vector products lose to one matmul per
slot: there `torch._grouped_mm` runs over the sorted rows (2048 tokens: 42 ms per layer against
100). Weights in the plain layout on CPU fall back to the per-slot torch reference.

Legend: T tokens, K experts per token, N rows (T * K), D hidden, I expert width, P slots.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from pdmesh_kernels import fused_moe, grouped_expert_mlp

# CPU: at this many rows per slot and more (prefill chunks), one matmul per slot beats one
# matrix-vector product per row (measured crossover 8 rows per slot with one thread, 25 with two).
GROUPED_ROWS_PER_SLOT = 16


def to_row_tables(weight: torch.Tensor) -> torch.Tensor:
    """The same values [P, A, B], stored so that `weight.transpose(1, 2)` is contiguous."""
    return weight.transpose(1, 2).contiguous().transpose(1, 2)


def has_row_tables(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the embedding-bag path applies: CPU weights in the row-table layout (a check of
    metadata only)."""
    return w13.device.type == "cpu" and _is_row_table(w13) and _is_row_table(w2)


def _is_row_table(weight: torch.Tensor) -> bool:
    """[P, A, B] with strides (A * B, 1, A): `weight.transpose(1, 2)` is contiguous."""
    _, rows, cols = weight.shape
    return weight.stride() == (rows * cols, 1, rows)


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    slot_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """x [T, D], weights [T, K] float, slot_ids [T, K] int in [0, P), w13 [P, 2I, D], w2 [P, D, I]
    -> [T, D] in x's dtype (the weighted sum in fp32)."""
    if not has_row_tables(w13, w2) and swiglu_limit is None:
        return fused_moe(x, w13, w2, weights, slot_ids)
    (num_tokens, top_k), hidden = slot_ids.shape, x.shape[1]
    slots, order = torch.sort(slot_ids.reshape(-1), stable=True)  # sorted row n is pair order[n]
    out_sorted = expert_rows(x.index_select(0, order // top_k), slots, w13, w2, swiglu_limit)
    rows = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)  # token-major
    if rows.dtype != torch.float32:
        rows = rows.float()
    combined = torch.bmm(
        weights.float().view(num_tokens, 1, top_k), rows.view(num_tokens, top_k, hidden)
    )
    combined = combined.view(num_tokens, hidden)
    return combined if combined.dtype == x.dtype else combined.to(x.dtype)


def expert_rows(
    rows: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """rows [N, D], slots [N] int sorted ascending -> [N, D] in rows' dtype: row n through the
    MLP of slot slots[n]."""
    if not has_row_tables(w13, w2):
        counts = torch.bincount(slots.long(), minlength=w13.shape[0])
        if swiglu_limit is None:
            return grouped_expert_mlp(rows, counts, w13, w2)
        return _looped_rows(rows, counts, w13, w2, swiglu_limit)
    if rows.shape[0] >= GROUPED_ROWS_PER_SLOT * w13.shape[0] and _can_group(rows, w2):
        return _grouped_rows(rows, slots, w13, w2, swiglu_limit)
    return _embedding_bag_rows(rows, slots, w13, w2, swiglu_limit)


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[N, 2I] (gate; up) -> [N, I]: silu(gate) * up, both clamped first when `limit` is set."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def _looped_rows(
    rows: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float
) -> torch.Tensor:
    """One matmul pair per slot that has rows (the plain layout with a clamp)."""
    out = torch.empty_like(rows)
    start = 0
    for slot, count in enumerate(counts.tolist()):
        if count:
            part = rows[start : start + count]
            out[start : start + count] = swiglu(part @ w13[slot].t(), limit) @ w2[slot].t()
            start += count
    return out


def _embedding_bag_rows(
    rows: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """One matrix-vector product per row and matrix, as an embedding bag over the row tables."""
    num_slots, hidden, width = w2.shape
    d_index = torch.arange(hidden, device=slots.device)
    i_index = torch.arange(width, device=slots.device)
    gate_up = F.embedding_bag(  # [N, 2I]
        slots[:, None] * hidden + d_index,
        w13.transpose(1, 2).view(num_slots * hidden, 2 * width),
        mode="sum",
        per_sample_weights=rows,
    )
    act = swiglu(gate_up, limit)  # [N, I]
    return F.embedding_bag(
        slots[:, None] * width + i_index,
        w2.transpose(1, 2).view(num_slots * width, hidden),
        mode="sum",
        per_sample_weights=act,
    )


def _grouped_rows(
    rows: torch.Tensor,
    slots: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float | None = None,
) -> torch.Tensor:
    """One matrix-matrix product per slot over its rows (`torch._grouped_mm`; a C++ loop)."""
    offsets = torch.cumsum(torch.bincount(slots, minlength=w13.shape[0]), 0, dtype=torch.int32)
    gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)  # [N, 2I]
    act = swiglu(gate_up, limit)  # [N, I]
    return torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)


def _can_group(rows: torch.Tensor, w2: torch.Tensor) -> bool:
    """`_grouped_mm` runs here: this torch has it on CPU, and the row strides of D, I and 2I
    elements are multiples of 16 bytes (its contract)."""
    size = rows.element_size()
    return (w2.shape[1] * size) % 16 == 0 and (w2.shape[2] * size) % 16 == 0 and _has_grouped_mm()


@cache
def _has_grouped_mm() -> bool:
    """Whether this torch runs `torch._grouped_mm` on CPU tensors (probed once, on first use)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        probe = torch._grouped_mm(
            torch.ones(4, 4), torch.ones(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32)
        )
    except (RuntimeError, NotImplementedError):
        return False
    return bool((probe == 4).all())
