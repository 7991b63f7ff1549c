"""Mixture-of-Experts expert computation as a grouped GEMM over tokens sorted by expert.

Every routed (token, k) pair is a row; rows are stably sorted by expert so each expert sees one
contiguous slice, then each expert runs its SwiGLU MLP on its slice:

    out[n] = (silu(x W_gate^T) * (x W_up^T)) W_down^T      with w13 = [W_gate; W_up], w2 = W_down

`grouped_expert_mlp_ref` is the torch reference (one `.tolist()`, two matmuls per used expert;
the engine's CPU path). `grouped_expert_mlp_triton` is a grouped GEMM in two launches (gate/up
with a fused silu*mul, then down) whose programs tile (row block, column block) through a
row-block -> expert map built on the device (the moe_align_block_size idea: every expert's rows
are split into BLOCK_M row blocks; no host sync). `fused_moe` does the routing around either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mla_decode import HAS_TRITON, uses_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["fused_moe", "grouped_expert_mlp", "grouped_expert_mlp_ref", "grouped_expert_mlp_triton"]

# Legend: N: routed rows (T*K), D: hidden size, I: expert intermediate size, E: experts,
# T: tokens, K: experts per token, M: row blocks (upper bound).

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_expert_inputs(
    x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    """Shape/dtype contract of grouped_expert_mlp* (metadata only; sum(counts) == N is trusted)."""
    if x_sorted.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"expected x_sorted [N, D], w13 [E, 2I, D], w2 [E, D, I], got "
            f"{tuple(x_sorted.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    e, two_i, d = w13.shape
    if two_i % 2 or x_sorted.shape[1] != d or tuple(w2.shape) != (e, d, two_i // 2):
        raise ValueError(
            f"inconsistent shapes: x_sorted {tuple(x_sorted.shape)}, w13 "
            f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if counts.shape != (e,) or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"counts must be int32/int64 [{e}], got {counts.dtype} {tuple(counts.shape)}"
        )
    if x_sorted.dtype not in _FLOAT_DTYPES or not (x_sorted.dtype == w13.dtype == w2.dtype):
        raise ValueError(
            f"x_sorted, w13 and w2 must share one float dtype, got "
            f"{x_sorted.dtype}, {w13.dtype}, {w2.dtype}"
        )


def grouped_expert_mlp_ref(
    x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Torch reference: x_sorted [N, D] grouped by expert, counts [E] -> [N, D] in x's dtype."""
    _check_expert_inputs(x_sorted, counts, w13, w2)
    inter = w2.shape[2]
    out = torch.empty_like(x_sorted)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = x_sorted[start : start + count]
        gate_up = rows @ w13[expert].t()  # [count, 2I]
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out[start : start + count] = hidden @ w2[expert].t()
        start += count
    return out


if HAS_TRITON:

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr,
        w_ptr,
        c_ptr,
        blk_expert_ptr,
        blk_start_ptr,
        blk_end_ptr,
        n_out,
        k_dim,
        stride_am,
        stride_ak,
        stride_we,
        stride_wn,
        stride_wk,
        stride_cm,
        stride_cn,
        GATED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        # Program (row block m, column block n): c[rows, cols] = a[rows] @ w[e][cols]^T for the
        # block's expert e and rows [blk_start[m], blk_end[m]) (empty for unused row blocks).
        # GATED: w rows [0, n_out) are gate, [n_out, 2 n_out) up; c = silu(a Wg^T) * (a Wu^T).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        expert = tl.load(blk_expert_ptr + pid_m).to(tl.int64)
        row_start = tl.load(blk_start_ptr + pid_m)
        row_end = tl.load(blk_end_ptr + pid_m)
        offs_m = row_start + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < row_end
        mask_n = offs_n < n_out
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = (
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        )  # [BLOCK_K, BLOCK_N] tile of w[e]^T
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_tiles = tl.where(row_end > row_start, tl.cdiv(k_dim, BLOCK_K), 0)
        for kt in range(0, k_tiles):
            mask_k = offs_k < k_dim - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST_DOT:  # the Triton interpreter cannot tl.dot bf16 (triton#11584)
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
            if GATED:
                w_up = tl.load(
                    w_ptrs + n_out * stride_wn, mask=mask_k[:, None] & mask_n[None, :], other=0.0
                )
                if UPCAST_DOT:
                    w_up = w_up.to(tl.float32)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if GATED:
            acc = acc * tl.sigmoid(acc) * acc_up
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _row_block_map(
    counts: torch.Tensor, num_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row block -> (expert, first row, end row), int32 [M] each, M = cdiv(N, BLOCK_M) + min(E, N).

    Each expert's rows are cut into cdiv(count, BLOCK_M) blocks; blocks past the used ones get
    start == end (no work). Pure device ops: no host sync.
    """
    num_experts = counts.shape[0]
    counts = counts.long()
    blocks = (counts + block_m - 1) // block_m  # [E]
    block_end = torch.cumsum(blocks, 0)  # [E]
    row_offset = torch.cumsum(counts, 0) - counts  # [E]
    max_blocks = (num_rows + block_m - 1) // block_m + min(num_experts, num_rows)
    blk = torch.arange(max_blocks, device=counts.device)
    expert = torch.searchsorted(block_end, blk, right=True)  # == E past the last used block
    used = expert < num_experts
    expert = expert.clamp_(max=num_experts - 1)
    start = row_offset[expert] + (blk - (block_end[expert] - blocks[expert])) * block_m
    end = torch.where(used, row_offset[expert] + counts[expert], start)
    return expert.int(), start.int(), end.int()


def _launch_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    block_map: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    gated: bool,
) -> None:
    """out [N, n_out] = per-row-block a @ w[e]^T (gated: w holds [gate; up], n_out = I)."""
    n_out = out.shape[1]
    k_dim = a.shape[1]
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    block_k = 64 if k_dim >= 64 else max(16, triton.next_power_of_2(k_dim))
    grid = (block_map[0].shape[0], triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        *block_map,
        n_out,
        k_dim,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        GATED=gated,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST_DOT=not a.is_cuda,
        num_warps=4,
        num_stages=3,
    )


def grouped_expert_mlp_triton(
    x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Triton grouped GEMM; same contract as `grouped_expert_mlp_ref` (no host sync)."""
    if not HAS_TRITON:
        raise RuntimeError("grouped_expert_mlp_triton needs the triton package")
    _check_expert_inputs(x_sorted, counts, w13, w2)
    num_rows = x_sorted.shape[0]
    inter = w2.shape[2]
    out = torch.empty_like(x_sorted)
    if num_rows == 0:
        return out
    rows_per_expert = num_rows / w13.shape[0]
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64
    block_map = _row_block_map(counts.to(x_sorted.device), num_rows, block_m)
    hidden = torch.empty(num_rows, inter, dtype=x_sorted.dtype, device=x_sorted.device)
    _launch_grouped_gemm(x_sorted, w13, hidden, block_map, block_m, gated=True)
    _launch_grouped_gemm(hidden, w2, out, block_map, block_m, gated=False)
    return out


def grouped_expert_mlp(
    x_sorted: torch.Tensor,
    counts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Dispatcher: Triton when use_triton is True, or None where `uses_triton`; else the
    reference."""
    if use_triton is None:
        use_triton = uses_triton(x_sorted.device)
    fn = grouped_expert_mlp_triton if use_triton else grouped_expert_mlp_ref
    return fn(x_sorted, counts, w13, w2)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Routed experts: out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]).

    hidden [T, D], w13 [E, 2I, D], w2 [E, D, I], topk_weights [T, K] float, topk_ids [T, K] int
    in [0, E). Returns [T, D] in hidden's dtype; the weighted sum accumulates in fp32.
    """
    if hidden.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"expected hidden [T, D], topk_weights/topk_ids [T, K], got "
            f"{tuple(hidden.shape)}, {tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}"
        )
    if topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} tokens, hidden has {hidden.shape[0]}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(
            f"topk_ids must be int and topk_weights float, got {topk_ids.dtype}, "
            f"{topk_weights.dtype}"
        )
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()  # [N]
    order = torch.argsort(flat_ids, stable=True)  # [N] row n of x_sorted is pair order[n]
    token_of_row = order // top_k
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # no host sync (unlike bincount)
    expert_out = grouped_expert_mlp(hidden[token_of_row], counts, w13, w2, use_triton)  # [N, D]
    weighted = expert_out.float() * topk_weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, token_of_row, weighted)
    return out.to(hidden.dtype)
