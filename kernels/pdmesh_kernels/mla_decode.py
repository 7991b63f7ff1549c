"""MLA paged decode attention in the absorbed form (DeepSeek-V3), over a paged latent KV cache.

One decode token per sequence attends to that sequence's cached tokens. The cache of one layer
holds, per token, the compressed latent `c` (kv_lora_rank wide) followed by the rope key
(qk_rope_head_dim wide); the absorbed queries score against both and read values from `c`:

    scores[b, h, t] = scale * (q_latent[b, h] . c[b, t] + q_rope[b, h] . k_rope[b, t]),
                      t < seq_lens[b]
    out[b, h]       = softmax_t(scores[b, h]) @ c[b, t]

`mla_decode_attention_ref` is the torch reference (vectorised over the batch; the engine's CPU
path), `mla_decode_attention_triton` a flash-decoding Triton kernel (online softmax, split-K over
the context, then a log-sum-exp merge), and `mla_decode_attention` picks between them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the torch references still work without Triton
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "force_triton",
    "uses_triton",
    "mla_decode_attention",
    "mla_decode_attention_ref",
    "mla_decode_attention_triton",
]

# Legend: B: batch (sequences), H: heads, L: kv_lora_rank, R: qk_rope_head_dim,
# NB: cache blocks, BS: tokens per block, MB: block-table width, T: padded context, S: KV splits.

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
_forced = False  # inside `force_triton`


def uses_triton(device: torch.device) -> bool:
    """Whether the dispatchers run the Triton kernels for tensors on `device`: on CUDA when Triton
    is installed, on any device inside `force_triton()`."""
    return HAS_TRITON and (device.type == "cuda" or _forced)


@contextmanager
def force_triton() -> Iterator[None]:
    """Run the Triton kernels on CPU tensors too (under TRITON_INTERPRET=1): how the tests walk
    the engine's CUDA path (its kernels, its CUDA-graph buffers) on a machine without a GPU."""
    global _forced
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before


def _check_inputs(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Shape/dtype contract of the public functions (metadata only: no device sync)."""
    if q_latent.dim() != 3 or q_rope.dim() != 3:
        raise ValueError(
            f"q_latent and q_rope must be [B, H, *], got {tuple(q_latent.shape)} "
            f"and {tuple(q_rope.shape)}"
        )
    b, h, lat = q_latent.shape
    rope = q_rope.shape[2]
    if q_rope.shape[:2] != (b, h):
        raise ValueError(
            f"q_rope {tuple(q_rope.shape)} does not match q_latent {tuple(q_latent.shape)}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[2] != lat + rope:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, {lat}+{rope}], got {tuple(kv_cache.shape)}"
        )
    if (
        block_tables.dim() != 2
        or block_tables.shape[0] != b
        or block_tables.dtype not in _INT_DTYPES
    ):
        raise ValueError(
            f"block_tables must be int32/int64 [{b}, max_blocks], got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (b,) or seq_lens.dtype not in _INT_DTYPES:
        raise ValueError(
            f"seq_lens must be int32/int64 [{b}], got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if q_latent.dtype not in _FLOAT_DTYPES or not (
        q_latent.dtype == q_rope.dtype == kv_cache.dtype
    ):
        raise ValueError(
            f"q_latent, q_rope and kv_cache must share one float dtype, got "
            f"{q_latent.dtype}, {q_rope.dtype}, {kv_cache.dtype}"
        )


def mla_decode_attention_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference: gathers every sequence's blocks at once and runs two batched matmuls.

    q_latent [B, H, L], q_rope [B, H, R], kv_cache [NB, BS, L+R], block_tables [B, MB] int,
    seq_lens [B] int (>= 1). Returns [B, H, L] in q_latent's dtype; softmax in fp32.
    """
    _check_inputs(q_latent, q_rope, kv_cache, block_tables, seq_lens)
    bsz, _, lat = q_latent.shape
    block_size = kv_cache.shape[1]
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    # kv [B, T, L+R] with T = num_blocks * BS >= max_len; positions >= seq_lens[b] are masked.
    kv = kv_cache[block_tables[:, :num_blocks].long()].reshape(bsz, num_blocks * block_size, -1)
    kv = kv[:, :max_len].float()
    q = torch.cat([q_latent, q_rope], dim=-1).float()  # [B, H, L+R]
    scores = torch.bmm(q, kv.transpose(1, 2)).mul_(scale)  # [B, H, T]
    pad = torch.arange(max_len, device=seq_lens.device)[None, :] >= seq_lens[:, None].long()
    scores.masked_fill_(pad[:, None, :].to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, kv[..., :lat]).to(q_latent.dtype)


if HAS_TRITON:

    @triton.jit
    def _mla_decode_split_kernel(
        q_lat_ptr,
        q_rope_ptr,
        kv_ptr,
        bt_ptr,
        seq_lens_ptr,
        part_ptr,
        lse_ptr,
        out_ptr,
        scale_log2e,
        num_heads,
        kv_lora_rank,
        rope_dim,
        block_size,
        stride_qlb,
        stride_qlh,
        stride_qrb,
        stride_qrh,
        stride_kvn,
        stride_kvt,
        stride_btb,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_ob,
        stride_oh,
        NUM_SPLITS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_L: tl.constexpr,
        BLOCK_R: tl.constexpr,
        DIRECT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        # Program (b, head block, split s): online softmax over split s's share of sequence b.
        # DIRECT (S == 1): writes normalised out [B, H, L]; else the split's normalised partial
        # part [B, H, S, L] fp32 and its log2-sum-exp lse [B, H, S] (-inf for an empty split).
        b = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        mask_h = offs_h < num_heads
        mask_l = offs_l < kv_lora_rank
        mask_r = offs_r < rope_dim
        q_lat = tl.load(
            q_lat_ptr + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_l[None, :],
            mask=mask_h[:, None] & mask_l[None, :],
            other=0.0,
        )
        q_rope = tl.load(
            q_rope_ptr + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :],
            mask=mask_h[:, None] & mask_r[None, :],
            other=0.0,
        )
        if UPCAST_DOT:  # the Triton interpreter cannot tl.dot bf16 (triton#11584)
            q_lat = q_lat.to(tl.float32)
            q_rope = q_rope.to(tl.float32)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        per_split = tl.cdiv(seq_len, NUM_SPLITS)
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            block_id = tl.load(bt_ptr + b * stride_btb + offs_n // block_size, mask=mask_n, other=0)
            row = block_id.to(tl.int64) * stride_kvn + (offs_n % block_size) * stride_kvt
            c = tl.load(
                kv_ptr + row[:, None] + offs_l[None, :],
                mask=mask_n[:, None] & mask_l[None, :],
                other=0.0,
            )  # [BLOCK_N, BLOCK_L]
            k_rope = tl.load(
                kv_ptr + row[:, None] + kv_lora_rank + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :],
                other=0.0,
            )
            if UPCAST_DOT:
                c = c.to(tl.float32)
                k_rope = k_rope.to(tl.float32)
            qk = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
            qk = tl.dot(q_rope, tl.trans(k_rope), qk, input_precision=DOT_PRECISION)
            qk = tl.where(mask_n[None, :], qk * scale_log2e, float("-inf"))  # [BLOCK_H, BLOCK_N]
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: offs_n[0] < end always
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0, l_i, 1.0)  # l_i == 0 only for an empty split
        acc = acc / l_safe[:, None]
        mask_out = mask_h[:, None] & mask_l[None, :]
        if DIRECT:
            out_ptrs = out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_l[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)
        else:
            base = b * stride_pb + offs_h * stride_ph + split * stride_ps
            tl.store(part_ptr + base[:, None] + offs_l[None, :], acc, mask=mask_out)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(
                lse_ptr + b * num_heads * NUM_SPLITS + offs_h * NUM_SPLITS + split, lse, mask=mask_h
            )

    @triton.jit
    def _mla_decode_merge_kernel(
        part_ptr,
        lse_ptr,
        out_ptr,
        num_heads,
        kv_lora_rank,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_ob,
        stride_oh,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_L: tl.constexpr,
    ):
        # Program (b, h): out[b, h] = sum_s 2^lse_s * part_s / sum_s 2^lse_s (split 0 is never
        # empty).
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_l = tl.arange(0, BLOCK_L)
        mask_s = offs_s < NUM_SPLITS
        mask_l = offs_l < kv_lora_rank
        lse = tl.load(
            lse_ptr + (b * num_heads + h) * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf")
        )
        weight = tl.exp2(lse - tl.max(lse, axis=0))  # [BLOCK_S], 0 for empty splits
        part = tl.load(
            part_ptr
            + b * stride_pb
            + h * stride_ph
            + offs_s[:, None] * stride_ps
            + offs_l[None, :],
            mask=mask_s[:, None] & mask_l[None, :],
            other=0.0,
        )
        out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + offs_l,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_l,
        )


def _default_num_splits(batch_heads: int, max_context: int) -> int:
    """KV splits so that short batches still fill a GPU (~2 programs per SM of an H100/H200)."""
    by_length = max(1, max_context // 256)
    by_occupancy = max(1, 264 // max(batch_heads, 1))
    return max(1, min(16, by_length, by_occupancy))


def mla_decode_attention_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Triton flash-decoding kernel; same contract as `mla_decode_attention_ref`.

    num_kv_splits: how many programs share one sequence's context (None: a heuristic from the
    block-table width, no device sync). The last dims of q_latent, q_rope, kv_cache must be
    contiguous.
    """
    if not HAS_TRITON:
        raise RuntimeError("mla_decode_attention_triton needs the triton package")
    _check_inputs(q_latent, q_rope, kv_cache, block_tables, seq_lens)
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q_latent, q_rope and kv_cache need a contiguous last dimension")
    bsz, heads, lat = q_latent.shape
    rope = q_rope.shape[2]
    block_size = kv_cache.shape[1]
    block_h = 16  # tl.dot needs M >= 16; padded heads are masked
    head_blocks = triton.cdiv(heads, block_h)
    splits = num_kv_splits or _default_num_splits(
        bsz * head_blocks, block_tables.shape[1] * block_size
    )
    out = torch.empty_like(q_latent)
    if splits > 1:
        part = torch.empty(bsz, heads, splits, lat, dtype=torch.float32, device=q_latent.device)
        lse = torch.empty(bsz, heads, splits, dtype=torch.float32, device=q_latent.device)
    else:
        part = lse = out  # unused by the DIRECT variant
    block_l = max(16, triton.next_power_of_2(lat))
    block_r = max(16, triton.next_power_of_2(rope))
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"
    _mla_decode_split_kernel[(bsz, head_blocks, splits)](
        q_latent,
        q_rope,
        kv_cache,
        block_tables,
        seq_lens,
        part,
        lse,
        out,
        scale * _LOG2E,
        heads,
        lat,
        rope,
        block_size,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_tables.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2) if splits > 1 else 0,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=splits,
        BLOCK_H=block_h,
        BLOCK_N=32,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        DIRECT=splits == 1,
        DOT_PRECISION=precision,
        UPCAST_DOT=not q_latent.is_cuda,
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _mla_decode_merge_kernel[(bsz, heads)](
            part,
            lse,
            out,
            heads,
            lat,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_L=block_l,
            num_warps=4,
        )
    return out


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Dispatcher: Triton when use_triton is True, or None where `uses_triton`; else the
    reference."""
    if use_triton is None:
        use_triton = uses_triton(q_latent.device)
    fn = mla_decode_attention_triton if use_triton else mla_decode_attention_ref
    return fn(q_latent, q_rope, kv_cache, block_tables, seq_lens, scale)
