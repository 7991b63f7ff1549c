"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the N residual streams around
every block, collapsed into the block's input and expanded again with its output.

Per token, from the streams x [N, D] (all weights in fp32):

    mixes   = fn @ (x.flatten() * rsqrt(mean(x^2) + norm_eps))             [(2+N)*N]
    pre     = sigmoid(mixes[:N] * scale[0] + base[:N]) + hc_eps              [N]
    post    = 2 * sigmoid(mixes[N:2N] * scale[1] + base[N:2N])               [N]
    comb    = softmax_j(mixes[2N:].view(N, N) * scale[2] + base[2N:]) + hc_eps, then divided by
              its column sums, then `sinkhorn_iters` - 1 times by its row sums and its column
              sums (Sinkhorn-Knopp: comb tends to doubly stochastic; each sum gets + hc_eps)
    block input = sum_n pre[n] * x[n]                                        [D]
    new streams = post[m] * block output + sum_n comb[n, m] * x[n]           [N, D]

`mhc_collapse*` computes (block input, post, comb): the Triton kernel is one program per token
that reads the streams twice (the fn projection and the norm's sum of squares in one pass, the
collapse in a second, once `pre` is known) with the gates, the softmax and every Sinkhorn step in
registers between them. `mhc_expand*` computes the new streams, one program per (token, channel
block), with the comb mix and the post term fused. The expansion cannot join the next block's
collapse: that one needs the whole new row's norm first. The `*_ref` functions are the engine's
`HyperConnection` math on plain tensors; `mhc_collapse` / `mhc_expand` pick between the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mla_decode import HAS_TRITON, uses_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "mhc_collapse",
    "mhc_collapse_ref",
    "mhc_collapse_triton",
    "mhc_expand",
    "mhc_expand_ref",
    "mhc_expand_triton",
]

# Legend: T: tokens, N: hc_mult streams, D: hidden size, M: (2 + N) * N mixes.

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_collapse_inputs(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
) -> None:
    """Shape/dtype contract of mhc_collapse* (metadata only)."""
    if streams.dim() != 3 or streams.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"streams must be float [T, N, D], got {streams.dtype} {streams.shape}")
    _, n, d = streams.shape
    m = (2 + n) * n
    if tuple(fn.shape) != (m, n * d) or tuple(base.shape) != (m,) or tuple(scale.shape) != (3,):
        raise ValueError(
            f"expected fn [{m}, {n * d}], base [{m}], scale [3] for streams "
            f"{tuple(streams.shape)}, got {tuple(fn.shape)}, {tuple(base.shape)}, "
            f"{tuple(scale.shape)}"
        )
    if not (fn.dtype == base.dtype == scale.dtype == torch.float32):
        raise ValueError(
            f"fn, base and scale must be float32, got {fn.dtype}, {base.dtype}, {scale.dtype}"
        )


def _check_expand_inputs(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> None:
    """Shape/dtype contract of mhc_expand* (metadata only)."""
    if streams.dim() != 3 or streams.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"streams must be float [T, N, D], got {streams.dtype} {streams.shape}")
    t, n, d = streams.shape
    if tuple(out.shape) != (t, d) or out.dtype != streams.dtype:
        raise ValueError(
            f"out must be {streams.dtype} [{t}, {d}], got {out.dtype} {tuple(out.shape)}"
        )
    if tuple(post.shape) != (t, n) or tuple(comb.shape) != (t, n, n):
        raise ValueError(
            f"expected post [{t}, {n}], comb [{t}, {n}, {n}], got {tuple(post.shape)}, "
            f"{tuple(comb.shape)}"
        )
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        raise ValueError(f"post and comb must be float32, got {post.dtype}, {comb.dtype}")


def mhc_collapse_ref(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: `HyperConnection.forward` on plain tensors.

    streams [T, N, D], fn [M, N*D], base [M], scale [3] (fp32). Returns (block input [T, D] in
    streams' dtype, post [T, N] fp32, comb [T, N, N] fp32).
    """
    _check_collapse_inputs(streams, fn, base, scale)
    n = streams.shape[1]
    x = streams.flatten(1).float()
    flat = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mixes = F.linear(flat, fn)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


def mhc_expand_ref(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Torch reference: `HyperConnection.expand`. streams [T, N, D], block output out [T, D],
    post [T, N] and comb [T, N, N] fp32 -> new streams [T, N, D] in streams' dtype (the weights
    rounded to it first, as the engine does)."""
    _check_expand_inputs(streams, out, post, comb)
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


if HAS_TRITON:

    @triton.jit
    def _mhc_collapse_kernel(
        streams_ptr,
        fn_ptr,
        base_ptr,
        scale_ptr,
        collapsed_ptr,
        post_ptr,
        comb_ptr,
        hidden,
        sinkhorn_iters,
        hc_eps,
        norm_eps,
        stride_st,
        stride_sn,
        stride_ct,
        N: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program t: token t. fn's rows are read in the (pre [N], post [N], comb [N, N]) layout
        # directly, so no mix needs moving between registers; padded rows/columns (N < BLOCK_N)
        # are masked to 0 and stay 0 through the Sinkhorn steps.
        t = tl.program_id(0)
        width = N * hidden
        offs_n = tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        mask_nn = mask_n[:, None] & mask_n[None, :]
        comb_rows = 2 * N + offs_n[:, None] * N + offs_n[None, :]  # [BLOCK_N, BLOCK_N]
        acc_pre = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_post = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_comb = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        x_row = streams_ptr + t.to(tl.int64) * stride_st
        for k0 in range(0, width, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < width
            x = tl.load(
                x_row + (offs_k // hidden) * stride_sn + offs_k % hidden, mask=mask_k, other=0.0
            ).to(tl.float32)
            sum_sq += x * x
            mask_nk = mask_n[:, None] & mask_k[None, :]
            w_pre = tl.load(
                fn_ptr + offs_n[:, None] * width + offs_k[None, :], mask=mask_nk, other=0.0
            )
            w_post = tl.load(
                fn_ptr + (N + offs_n)[:, None] * width + offs_k[None, :], mask=mask_nk, other=0.0
            )
            w_comb = tl.load(
                fn_ptr + comb_rows[:, :, None] * width + offs_k[None, None, :],
                mask=mask_nn[:, :, None] & mask_k[None, None, :],
                other=0.0,
            )
            acc_pre += tl.sum(w_pre * x[None, :], axis=1)
            acc_post += tl.sum(w_post * x[None, :], axis=1)
            acc_comb += tl.sum(w_comb * x[None, None, :], axis=2)
        inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=0) / width + norm_eps)

        pre_s = tl.load(scale_ptr)
        post_s = tl.load(scale_ptr + 1)
        comb_s = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(
            acc_pre * inv_rms * pre_s + tl.load(base_ptr + offs_n, mask=mask_n, other=0.0)
        )
        pre = tl.where(mask_n, pre + hc_eps, 0.0)
        post = 2 * tl.sigmoid(
            acc_post * inv_rms * post_s + tl.load(base_ptr + N + offs_n, mask=mask_n, other=0.0)
        )
        logits = acc_comb * inv_rms * comb_s + tl.load(
            base_ptr + comb_rows, mask=mask_nn, other=0.0
        )
        logits = tl.where(mask_n[None, :], logits, float("-inf"))  # padded rows stay finite
        logits = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = tl.where(mask_nn, logits / tl.sum(logits, axis=1)[:, None] + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + t * N + offs_n, post, mask=mask_n)
        tl.store(comb_ptr + t * N * N + offs_n[:, None] * N + offs_n[None, :], comb, mask=mask_nn)

        for d0 in range(0, hidden, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < hidden
            x = tl.load(
                x_row + offs_n[:, None] * stride_sn + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            ).to(tl.float32)
            y = tl.sum(pre[:, None] * x, axis=0)
            tl.store(
                collapsed_ptr + t * stride_ct + offs_d,
                y.to(collapsed_ptr.dtype.element_ty),
                mask=mask_d,
            )

    @triton.jit
    def _mhc_expand_kernel(
        streams_ptr,
        out_ptr,
        post_ptr,
        comb_ptr,
        new_ptr,
        hidden,
        stride_st,
        stride_sn,
        stride_ot,
        stride_nt,
        stride_nn,
        N: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # Program (t, channel block): new[m, d] = post[m] * out[d] + sum_n comb[n, m] * x[n, d].
        t = tl.program_id(0)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        mask_d = offs_d < hidden
        mask = mask_n[:, None] & mask_d[None, :]
        x = tl.load(
            streams_ptr
            + t.to(tl.int64) * stride_st
            + offs_n[:, None] * stride_sn
            + offs_d[None, :],
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        comb = tl.load(
            comb_ptr + t * N * N + offs_n[:, None] * N + offs_n[None, :],
            mask=mask_n[:, None] & mask_n[None, :],
            other=0.0,
        )  # [n, m]
        post = tl.load(post_ptr + t * N + offs_n, mask=mask_n, other=0.0)
        out = tl.load(out_ptr + t.to(tl.int64) * stride_ot + offs_d, mask=mask_d, other=0.0)
        new = post[:, None] * out.to(tl.float32)[None, :] + tl.sum(
            comb[:, :, None] * x[:, None, :], axis=0
        )
        tl.store(
            new_ptr + t.to(tl.int64) * stride_nt + offs_n[:, None] * stride_nn + offs_d[None, :],
            new.to(new_ptr.dtype.element_ty),
            mask=mask,
        )


def mhc_collapse_triton(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton kernel; same contract as `mhc_collapse_ref`. streams' last dimension, fn, base and
    scale must be contiguous."""
    if not HAS_TRITON:
        raise RuntimeError("mhc_collapse_triton needs the triton package")
    _check_collapse_inputs(streams, fn, base, scale)
    if streams.stride(-1) != 1 or not (
        fn.is_contiguous() and base.is_contiguous() and scale.is_contiguous()
    ):
        raise ValueError("streams need a contiguous last dimension; fn, base, scale contiguity")
    tokens, n, hidden = streams.shape
    collapsed = torch.empty(tokens, hidden, dtype=streams.dtype, device=streams.device)
    post = torch.empty(tokens, n, dtype=torch.float32, device=streams.device)
    comb = torch.empty(tokens, n, n, dtype=torch.float32, device=streams.device)
    if tokens == 0:
        return collapsed, post, comb
    block_n = triton.next_power_of_2(n)
    _mhc_collapse_kernel[(tokens,)](
        streams,
        fn,
        base,
        scale,
        collapsed,
        post,
        comb,
        hidden,
        sinkhorn_iters,
        hc_eps,
        norm_eps,
        streams.stride(0),
        streams.stride(1),
        collapsed.stride(0),
        N=n,
        BLOCK_N=block_n,
        BLOCK_K=min(triton.next_power_of_2(n * hidden), 4096 // (block_n * block_n)),
        BLOCK_D=min(triton.next_power_of_2(hidden), 1024),
        num_warps=4,
    )
    return collapsed, post, comb


def mhc_expand_triton(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Triton kernel; same contract as `mhc_expand_ref` (the weights stay fp32 in the kernel).
    The last dimensions of streams and out, and post and comb, must be contiguous."""
    if not HAS_TRITON:
        raise RuntimeError("mhc_expand_triton needs the triton package")
    _check_expand_inputs(streams, out, post, comb)
    if streams.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("streams and out need a contiguous last dimension")
    if not (post.is_contiguous() and comb.is_contiguous()):
        raise ValueError("post and comb must be contiguous")
    tokens, n, hidden = streams.shape
    new = torch.empty(tokens, n, hidden, dtype=streams.dtype, device=streams.device)
    if tokens == 0:
        return new
    block_n = triton.next_power_of_2(n)
    block_d = min(triton.next_power_of_2(hidden), 4096 // (block_n * block_n))
    _mhc_expand_kernel[(tokens, triton.cdiv(hidden, block_d))](
        streams,
        out,
        post,
        comb,
        new,
        hidden,
        streams.stride(0),
        streams.stride(1),
        out.stride(0),
        new.stride(0),
        new.stride(1),
        N=n,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=4,
    )
    return new


def mhc_collapse(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatcher: Triton when use_triton is True, or None where `uses_triton`; else the
    reference."""
    if use_triton is None:
        use_triton = uses_triton(streams.device)
    fn_ = mhc_collapse_triton if use_triton else mhc_collapse_ref
    return fn_(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)


def mhc_expand(
    streams: torch.Tensor,
    out: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Dispatcher: Triton when use_triton is True, or None where `uses_triton`; else the
    reference."""
    if use_triton is None:
        use_triton = uses_triton(streams.device)
    fn = mhc_expand_triton if use_triton else mhc_expand_ref
    return fn(streams, out, post, comb)
