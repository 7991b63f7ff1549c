"""DeepSeek-V4 sparse attention with sinks: each query row attends to its sliding window of K=V
entries and to compressed entries (CSA: the Lightning Indexer's choice; HCA: every visible
entry), one KV head shared by all query heads (MQA, K = V), a learned sink per head in the
softmax's denominator:

    keys[t]   = window_pool[window_slots[t, w]] where window_valid[t, w]
                ++ entry_pool[entry_slots[token_seq[t], e]] for e in chosen[t] (CSA) or
                   e < visible[t] (HCA), an e >= visible[t] left out
    logits    = scale * q[t, h] . keys[t]
    out[t, h] = sum_k exp(logits_k) keys[t, k] / (sum_k exp(logits_k) + exp(sink[h]))

exactly the engine's `Attention._keys` + `Attention._attend` (pdmesh_engine.model.deepseek_v4.
attention), before its output rope and projection. Inputs are what the engine already holds for
a step, so a call copies nothing: the flat [slots, C] views of the layer's window and entry pools
and the `V4Step` / `Entries` index tensors (plus the indexer's `chosen` on CSA layers). The kernel
reads the keys through those slots; the torch path gathers a [t, K, C] key copy per slice of
queries, which is the step's largest transient and what this kernel avoids.

`v4_attention_ref` is the torch reference (the engine's math, logits and softmax in fp32),
`v4_attention_triton` a Triton kernel (one program per query and block of heads: online
softmax started from the sink, over the window then the entries), `v4_attention` the
dispatcher. A ragged batch needs nothing more: every query row carries its own slots.
"""

from __future__ import annotations

import torch

from .mla_decode import HAS_TRITON, uses_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["v4_attention", "v4_attention_ref", "v4_attention_triton"]

# Legend: T query tokens, H heads, C head_dim, W window, S sequences, E entries per sequence (the
# step's widest), k chosen entries per query (CSA), NR / NE window / entry pool slots.

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


def _check_inputs(
    q: torch.Tensor,
    window_pool: torch.Tensor,
    window_slots: torch.Tensor,
    window_valid: torch.Tensor,
    sink: torch.Tensor,
    entry_pool: torch.Tensor | None,
    entry_slots: torch.Tensor | None,
    token_seq: torch.Tensor | None,
    visible: torch.Tensor | None,
    chosen: torch.Tensor | None,
) -> None:
    """Shape/dtype contract of the public functions (metadata only: no device sync)."""
    if q.dim() != 3 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be a float [T, H, C], got {q.dtype} {tuple(q.shape)}")
    t, heads, dim = q.shape
    if window_pool.dim() != 2 or window_pool.shape[1] != dim or window_pool.dtype != q.dtype:
        raise ValueError(
            f"window_pool must be {q.dtype} [slots, {dim}], got {window_pool.dtype} "
            f"{tuple(window_pool.shape)}"
        )
    if (
        window_slots.dim() != 2
        or window_slots.shape[0] != t
        or window_slots.dtype not in (_INT_DTYPES)
    ):
        raise ValueError(
            f"window_slots must be int32/int64 [{t}, W], got {window_slots.dtype} "
            f"{tuple(window_slots.shape)}"
        )
    if window_valid.shape != window_slots.shape or window_valid.dtype != torch.bool:
        raise ValueError(
            f"window_valid must be bool {tuple(window_slots.shape)}, got {window_valid.dtype} "
            f"{tuple(window_valid.shape)}"
        )
    if sink.shape != (heads,):
        raise ValueError(f"sink must be [{heads}], got {tuple(sink.shape)}")
    if entry_pool is None:
        if chosen is not None:
            raise ValueError("chosen needs entry_pool")
        return
    if entry_pool.dim() != 2 or entry_pool.shape[1] != dim or entry_pool.dtype != q.dtype:
        raise ValueError(
            f"entry_pool must be {q.dtype} [slots, {dim}], got {entry_pool.dtype} "
            f"{tuple(entry_pool.shape)}"
        )
    if entry_slots is None or entry_slots.dim() != 2 or entry_slots.dtype not in _INT_DTYPES:
        raise ValueError("entry_pool needs entry_slots, int32/int64 [S, E]")
    for name, v in (("token_seq", token_seq), ("visible", visible)):
        if v is None or v.shape != (t,) or v.dtype not in _INT_DTYPES:
            raise ValueError(f"entry_pool needs {name}, int32/int64 [{t}]")
    if chosen is not None and (
        chosen.dim() != 2 or chosen.shape[0] != t or chosen.dtype not in _INT_DTYPES
    ):
        raise ValueError(
            f"chosen must be int32/int64 [{t}, k], got {chosen.dtype} {tuple(chosen.shape)}"
        )


def v4_attention_ref(
    q: torch.Tensor,
    window_pool: torch.Tensor,
    window_slots: torch.Tensor,
    window_valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    entry_pool: torch.Tensor | None = None,
    entry_slots: torch.Tensor | None = None,
    token_seq: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
    chosen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: gathers every query's keys, then the engine's `_attend` in fp32.

    q [T, H, C] (normed, rope'd), window_pool [NR, C], window_slots [T, W] int, window_valid
    [T, W] bool, sink [H] (any float dtype), scale (the engine's C^-0.5). Compressed layers add
    entry_pool [NE, C], entry_slots [S, E] int, token_seq [T] int, visible [T] int; CSA adds
    chosen [T, k] int entry indices (entries at or past visible are left out; HCA reads e <
    visible). Sliding layers pass none of them. Returns [T, H, C] in q's dtype.
    """
    _check_inputs(
        q,
        window_pool,
        window_slots,
        window_valid,
        sink,
        entry_pool,
        entry_slots,
        token_seq,
        visible,
        chosen,
    )
    keys = window_pool[window_slots.long()]  # [T, W, C]
    valid = window_valid
    if entry_pool is not None:
        slots = entry_slots[token_seq.long()]  # [T, E]
        if chosen is not None:
            slots, index = slots.gather(1, chosen.long()), chosen
        else:
            index = torch.arange(slots.shape[1], device=q.device)[None, :]
        keys = torch.cat((keys, entry_pool[slots.long()]), dim=1)
        valid = torch.cat((valid, (index < visible[:, None]).expand_as(slots)), dim=1)
    keys = keys.float()
    logits = torch.einsum("thc,tkc->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sinks = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.cat((logits, sinks), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkc->thc", probs, keys).to(q.dtype)


if HAS_TRITON:

    @triton.jit
    def _online_softmax_block(q, k, live, m_i, l_i, acc, scale_log2e, DOT_PRECISION: tl.constexpr):
        # One block of keys k [BLOCK_N, BLOCK_C] (live [BLOCK_N]) into the running (max, sum,
        # acc) of the [BLOCK_H] heads, in log2 units. m_i is finite from the start (the sink).
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        qk = tl.where(live[None, :], qk * scale_log2e, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _v4_sparse_attention_kernel(
        q_ptr,
        win_pool_ptr,
        win_slots_ptr,
        win_valid_ptr,
        sink_ptr,
        ent_pool_ptr,
        ent_slots_ptr,
        seq_ptr,
        vis_ptr,
        chosen_ptr,
        out_ptr,
        scale_log2e,
        num_heads,
        head_dim,
        window,
        num_chosen,
        stride_qt,
        stride_qh,
        stride_wp,
        stride_wst,
        stride_wvt,
        stride_ep,
        stride_ess,
        stride_ct,
        stride_ot,
        stride_oh,
        HAS_ENTRIES: tl.constexpr,
        HAS_CHOSEN: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        # Program (t, head block): the sink seeds the online softmax (max = sink, sum = 1, acc
        # = 0), then blocks of window keys, then blocks of entries (chosen or the visible ones).
        t = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_c = tl.arange(0, BLOCK_C)
        mask_h = offs_h < num_heads
        mask_c = offs_c < head_dim
        q = tl.load(
            q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_c[None, :],
            mask=mask_h[:, None] & mask_c[None, :],
            other=0.0,
        )
        if UPCAST_DOT:  # the Triton interpreter cannot tl.dot bf16 (triton#11584)
            q = q.to(tl.float32)
        sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        m_i = sink * 1.4426950408889634  # log2 units, as the logits
        l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        for n0 in range(0, window, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_range = offs_n < window
            live = tl.load(win_valid_ptr + t * stride_wvt + offs_n, mask=in_range, other=0) != 0
            slot = tl.load(win_slots_ptr + t * stride_wst + offs_n, mask=live, other=0)
            k = tl.load(
                win_pool_ptr + slot.to(tl.int64)[:, None] * stride_wp + offs_c[None, :],
                mask=live[:, None] & mask_c[None, :],
                other=0.0,
            )
            if UPCAST_DOT:
                k = k.to(tl.float32)
            m_i, l_i, acc = _online_softmax_block(
                q, k, live, m_i, l_i, acc, scale_log2e, DOT_PRECISION
            )
        if HAS_ENTRIES:
            seq = tl.load(seq_ptr + t).to(tl.int64)
            visible = tl.load(vis_ptr + t)
            count = num_chosen if HAS_CHOSEN else visible
            for n0 in range(0, count, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                if HAS_CHOSEN:
                    index = tl.load(
                        chosen_ptr + t * stride_ct + offs_n, mask=offs_n < count, other=visible
                    )
                else:
                    index = offs_n
                live = (index < visible) & (index >= 0)
                slot = tl.load(ent_slots_ptr + seq * stride_ess + index, mask=live, other=0)
                k = tl.load(
                    ent_pool_ptr + slot.to(tl.int64)[:, None] * stride_ep + offs_c[None, :],
                    mask=live[:, None] & mask_c[None, :],
                    other=0.0,
                )
                if UPCAST_DOT:
                    k = k.to(tl.float32)
                m_i, l_i, acc = _online_softmax_block(
                    q, k, live, m_i, l_i, acc, scale_log2e, DOT_PRECISION
                )
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_h[:, None] & mask_c[None, :],
        )


def v4_attention_triton(
    q: torch.Tensor,
    window_pool: torch.Tensor,
    window_slots: torch.Tensor,
    window_valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    entry_pool: torch.Tensor | None = None,
    entry_slots: torch.Tensor | None = None,
    token_seq: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
    chosen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton kernel; same contract as `v4_attention_ref`. The last dims of every tensor
    argument must be contiguous (the engine's are)."""
    if not HAS_TRITON:
        raise RuntimeError("v4_attention_triton needs the triton package")
    _check_inputs(
        q,
        window_pool,
        window_slots,
        window_valid,
        sink,
        entry_pool,
        entry_slots,
        token_seq,
        visible,
        chosen,
    )
    given = [q, window_pool, window_slots, window_valid, entry_pool, entry_slots, chosen]
    if any(v is not None and v.stride(-1) != 1 for v in given):
        raise ValueError("the tensor arguments need a contiguous last dimension")
    tokens, heads, dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    has_entries = entry_pool is not None
    has_chosen = chosen is not None
    # unused pointers (a sliding layer's entries, HCA's chosen) point at q; never read
    ent_pool = entry_pool if has_entries else q
    ent_slots = entry_slots if has_entries else window_slots
    seq = token_seq if has_entries else window_slots
    vis = visible if has_entries else window_slots
    pick = chosen if has_chosen else window_slots
    block_c = max(16, triton.next_power_of_2(dim))
    block_h = 16  # tl.dot needs M >= 16; padded heads are masked
    _v4_sparse_attention_kernel[(tokens, triton.cdiv(heads, block_h))](
        q,
        window_pool,
        window_slots,
        window_valid.view(torch.uint8),
        sink,
        ent_pool,
        ent_slots,
        seq,
        vis,
        pick,
        out,
        scale * _LOG2E,
        heads,
        dim,
        window_slots.shape[1],
        pick.shape[1],
        q.stride(0),
        q.stride(1),
        window_pool.stride(0),
        window_slots.stride(0),
        window_valid.stride(0),
        ent_pool.stride(0),
        ent_slots.stride(0),
        pick.stride(0),
        out.stride(0),
        out.stride(1),
        HAS_ENTRIES=has_entries,
        HAS_CHOSEN=has_chosen,
        BLOCK_H=block_h,
        BLOCK_N=32 if block_c <= 256 else 16,
        BLOCK_C=block_c,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=not q.is_cuda,
        num_warps=4 if block_c <= 128 else 8,
    )
    return out


def v4_attention(
    q: torch.Tensor,
    window_pool: torch.Tensor,
    window_slots: torch.Tensor,
    window_valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    entry_pool: torch.Tensor | None = None,
    entry_slots: torch.Tensor | None = None,
    token_seq: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
    chosen: torch.Tensor | None = None,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Dispatcher: Triton when use_triton is True, or None where `uses_triton`; else the
    reference."""
    if use_triton is None:
        use_triton = uses_triton(q.device)
    fn = v4_attention_triton if use_triton else v4_attention_ref
    return fn(
        q,
        window_pool,
        window_slots,
        window_valid,
        sink,
        scale,
        entry_pool,
        entry_slots,
        token_seq,
        visible,
        chosen,
    )
