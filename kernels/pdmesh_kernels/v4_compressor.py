"""DeepSeek-V4's compressor pooling: the windows that close in a step, each pooled into one entry.

A compressed layer caches per token a row (kv, gate) of `series` x `dim` channels each. When a
compression window of `rate` tokens closes, its rows become one entry (per channel d):

    w[j, d]    = softmax_j(gate[j, d] + ape[j % rate, d])        j over the window's span rows
    pooled[d]  = sum_j w[j, d] * kv[j, d]
    entry      = RMSNorm(pooled) (weighted, fp32)

HCA (series 1) pools the window's own `rate` rows. CSA (series 2) pools 2 * rate rows that
overlap: the previous window's rows through series 0 (channels [0, dim) of kv and gate, ape's
first `dim` columns), then this window's rows through series 1; window 0 has no previous
window, its first `rate` rows are left out (gate -inf). The engine's `Compressor.pool` then
rotates the entry's rope slice at the window's first position: that rotation is `apply_rope`, a
separate op the engine keeps in torch, and not part of these functions.

The rows are read where the engine caches them: `rows` is the flat row pool [R, 2*S*dim] and
`row_slots` names the span rows of each closing window (`Closing.row_slots`), so windows of any
sequences and any number per sequence (ragged) are pooled in one launch with no gather.

`compressor_pool_ref` is the torch reference (the engine's math on plain tensors),
`compressor_pool_triton` a Triton kernel (one program per closing window: an online softmax
over the span in row chunks, per channel, then the norm on the whole entry), and
`compressor_pool` picks between them.
"""

from __future__ import annotations

import torch

from .mla_decode import HAS_TRITON, uses_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["compressor_pool", "compressor_pool_ref", "compressor_pool_triton"]

# Legend: C: closing windows, R: cached rows (flat row pool), S: series (1 HCA, 2 CSA),
# P: span rows per window (S * rate), D: entry channels (dim).

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_inputs(
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    first: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[int, int, int]:
    """Shape/dtype contract of the public functions (metadata only); returns (rate, S, D)."""
    if norm_weight.dim() != 1 or ape.dim() != 2 or rows.dim() != 2:
        raise ValueError(
            f"expected rows [R, 2*S*D], ape [rate, S*D], norm_weight [D], got "
            f"{tuple(rows.shape)}, {tuple(ape.shape)}, {tuple(norm_weight.shape)}"
        )
    dim = norm_weight.shape[0]
    rate, width = ape.shape
    series = width // dim
    if series not in (1, 2) or width != series * dim or rows.shape[1] != 2 * width:
        raise ValueError(
            f"inconsistent widths: rows {tuple(rows.shape)}, ape {tuple(ape.shape)}, "
            f"norm_weight {tuple(norm_weight.shape)} (series must be 1 or 2)"
        )
    if (
        row_slots.dim() != 2
        or row_slots.shape[1] != series * rate
        or row_slots.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            f"row_slots must be int32/int64 [C, {series * rate}], got "
            f"{row_slots.dtype} {tuple(row_slots.shape)}"
        )
    if first.shape != (row_slots.shape[0],) or first.dtype != torch.bool:
        raise ValueError(
            f"first must be bool [{row_slots.shape[0]}], got {first.dtype} {tuple(first.shape)}"
        )
    if rows.dtype not in _FLOAT_DTYPES or not (ape.dtype == norm_weight.dtype == torch.float32):
        raise ValueError(
            f"rows must be a float dtype, ape and norm_weight float32, got {rows.dtype}, "
            f"{ape.dtype}, {norm_weight.dtype}"
        )
    return rate, series, dim


def compressor_pool_ref(
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    first: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Torch reference: `Compressor.pool` up to its norm, on plain tensors.

    rows [R, 2*S*D] (kv then gate, each S*D), row_slots [C, P] int, first [C] bool (window 0),
    ape [rate, S*D] fp32, norm_weight [D] fp32. Returns entries [C, D] in rows' dtype (not yet
    rotated); softmax and norm in fp32.
    """
    rate, series, dim = _check_inputs(rows, row_slots, first, ape, norm_weight)
    gathered = rows[row_slots.long()]  # [C, P, 2*S*D]
    kv, gate = gathered.split(series * dim, dim=-1)
    gate = gate + ape.repeat(gathered.shape[1] // rate, 1)
    if series == 2:  # previous window's first series, then this window's second
        kv = torch.cat((kv[:, :rate, :dim], kv[:, rate:, dim:]), dim=1)
        gate = torch.cat((gate[:, :rate, :dim], gate[:, rate:, dim:]), dim=1)
        head = torch.zeros_like(first[:, None]).expand(-1, 2 * rate).clone()
        head[:, :rate] = first[:, None]
        kv = kv.masked_fill(head[..., None], 0.0)
        gate = gate.masked_fill(head[..., None], float("-inf"))
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    pooled = (kv * weights).sum(dim=1)
    x32 = pooled.float()
    normed = norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))
    return normed.to(rows.dtype)


if HAS_TRITON:

    @triton.jit
    def _compressor_pool_kernel(
        rows_ptr,
        slots_ptr,
        first_ptr,
        ape_ptr,
        weight_ptr,
        out_ptr,
        dim,
        rate,
        span,
        eps,
        stride_rows,
        stride_slots,
        stride_out,
        SERIES: tl.constexpr,
        BLOCK_P: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program c: window c's entry. Span row j reads series j // rate (always 0 for HCA) at
        # kv columns [s*D, (s+1)*D) and gate columns S*D + the same; CSA's window 0 starts at
        # row `rate`, so every chunk holds a valid row and the running max stays finite.
        c = tl.program_id(0)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < dim
        start = (tl.load(first_ptr + c) != 0).to(tl.int32) * rate * (SERIES - 1)
        m_i = tl.full([BLOCK_D], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for p0 in range(start, span, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            mask_p = offs_p < span
            slot = tl.load(slots_ptr + c * stride_slots + offs_p, mask=mask_p, other=0)
            col = (offs_p // rate) * dim
            mask = mask_p[:, None] & mask_d[None, :]
            row = rows_ptr + slot.to(tl.int64)[:, None] * stride_rows + col[:, None]
            kv = tl.load(row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            gate = tl.load(row + SERIES * dim + offs_d[None, :], mask=mask, other=0.0)
            ape = tl.load(
                ape_ptr
                + (offs_p % rate)[:, None] * (SERIES * dim)
                + col[:, None]
                + offs_d[None, :],
                mask=mask,
                other=0.0,
            )
            # padded channels keep gate 0 (finite, never stored); rows past the span get -inf
            gate = tl.where(mask_p[:, None], gate.to(tl.float32) + ape, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(gate, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(gate - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p * kv, axis=0)
            m_i = m_new
        # round the pooled entry to the rows' dtype as the engine does before its norm
        pooled = (acc / l_i).to(out_ptr.dtype.element_ty).to(tl.float32)
        pooled = tl.where(mask_d, pooled, 0.0)
        inv_rms = tl.rsqrt(tl.sum(pooled * pooled, axis=0) / dim + eps)
        weight = tl.load(weight_ptr + offs_d, mask=mask_d, other=0.0)
        out = weight * (pooled * inv_rms)
        tl.store(out_ptr + c * stride_out + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def compressor_pool_triton(
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    first: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Triton kernel; same contract as `compressor_pool_ref`. The last dimensions of rows and
    row_slots, and ape and norm_weight, must be contiguous."""
    if not HAS_TRITON:
        raise RuntimeError("compressor_pool_triton needs the triton package")
    rate, series, dim = _check_inputs(rows, row_slots, first, ape, norm_weight)
    if rows.stride(-1) != 1 or row_slots.stride(-1) != 1:
        raise ValueError("rows and row_slots need a contiguous last dimension")
    if not (ape.is_contiguous() and norm_weight.is_contiguous()):
        raise ValueError("ape and norm_weight must be contiguous")
    windows, span = row_slots.shape
    out = torch.empty(windows, dim, dtype=rows.dtype, device=rows.device)
    if windows == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    # a chunk of span rows x the whole entry: ~8K fp32 per tile
    block_p = max(1, min(triton.next_power_of_2(span), 8192 // block_d))
    _compressor_pool_kernel[(windows,)](
        rows,
        row_slots,
        first.view(torch.uint8),
        ape,
        norm_weight,
        out,
        dim,
        rate,
        span,
        eps,
        rows.stride(0),
        row_slots.stride(0),
        out.stride(0),
        SERIES=series,
        BLOCK_P=block_p,
        BLOCK_D=block_d,
        num_warps=4 if block_d <= 256 else 8,
    )
    return out


def compressor_pool(
    rows: torch.Tensor,
    row_slots: torch.Tensor,
    first: torch.Tensor,
    ape: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Dispatcher: Triton when use_triton is True, or None where `uses_triton`; else the
    reference."""
    if use_triton is None:
        use_triton = uses_triton(rows.device)
    fn = compressor_pool_triton if use_triton else compressor_pool_ref
    return fn(rows, row_slots, first, ape, norm_weight, eps)
