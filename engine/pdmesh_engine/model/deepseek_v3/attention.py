"""Per-step attention inputs shared by every layer, and MLA decode attention on CPU.

`AttentionMetadata` is built once per forward (`DeepseekV3ForCausalLM.forward`) from the
`ForwardBatch`: the rope tables of the step's positions and, for CPU decodes, the chunks of the
block tables to read and their padding masks. The layers then spend no ops on them.

`mla_decode_cpu` is the absorbed-form decode attention of `pdmesh_kernels.mla_decode` for CPU, with
no Python loop over requests: the decodes' block tables are padded to the longest decode and the
tail is masked. A small context (B x S rows up to `ONE_READ_ROWS`) is read from the paged cache in
one copy and attended with the arithmetic of `mla_decode_attention_ref` (two batched matmuls,
softmax in fp32). A larger one is walked in chunks of block positions (`CHUNK_ROWS` rows each, all
decodes at once): each chunk's rows are copied into a buffer that stays in the CPU cache, scored and
summed with an online softmax (running max and sum, fp32), so no copy of the whole context is made.

Measured (mla_decode_cpu alone, a 2-core AMD EPYC Zen 4 VM, 8 heads, L + R = 160, block size 16,
fp32, scattered blocks; median ms per layer, one read vs 4K-row chunks, 1 thread | 2 threads):

    B   S      rows    one read      chunks
    32  385    12.3K   2.5 | 1.0     2.4-3.0 (2K-8K rows, one thread): a tie, the copy fits the L3
    8   1025   8.2K    1.04          1.26 (one thread)
    8   2049   16.4K   3.8 | 2.0     3.0 | 3.1
    32  1025   32.8K   9.6 | 4.5     6.4 | 4.0
    32  2049   65.6K   43.0 | 28.3   18.5 | 9.6 (2K rows 13.2 | 11.2, 8K rows 21.0 | 14.5)

Whole decode forward of the small default model (`pdmesh bench forward`, 32 decodes, context 2048,
2 threads): 370 ms -> 130 ms (mla_decode_cpu 319 -> 92 ms); at context 384 (10-12K rows, one read)
nothing changes. The attention is compute-bound on the two matmuls (8-row queries per sequence)
while the copy fits the L3 cache; past it the whole-context copy costs 2-3x. The online softmax
adds ~20 ops per extra chunk, which is why contexts that fit one read keep it.

Legend: T tokens, H heads, L kv_lora_rank, R qk_rope_head_dim, B decode sequences, NB blocks per
chunk, BS block size, S longest decode context, C rows of one chunk per sequence (<= NB * BS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh_engine.forward_batch import ForwardBatch

CHUNK_ROWS = 4096  # cache rows (B x C) read per chunk: ~2.6 MB in fp32 at L + R = 160
ONE_READ_ROWS = 24576  # up to this many rows (B x S) the whole context is read at once (~16 MB)


@dataclass(frozen=True, slots=True)
class DecodeChunk:
    """Block positions [first, first + NB) of every decode's block table."""

    block_ids: torch.Tensor  # [B * NB] int64: the decodes' blocks at these positions, row-major
    num_rows: int  # C: the chunk's context positions (the last chunk stops at S)
    pad_mask: torch.Tensor | None  # [B, 1, C] bool, True at positions >= seq_lens[b]; None: no pad


@dataclass(frozen=True, slots=True)
class DecodeGather:
    """Which cache rows the CPU decode attention reads, the same for every layer of a step."""

    chunks: tuple[DecodeChunk, ...]  # in block order; the first holds position 0 of every decode
    context_len: int  # S = the longest decode's tokens

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        block_size: int,
        chunk_rows: int | None = None,
        one_read_rows: int | None = None,
    ) -> DecodeGather | None:
        """None when the batch has no decodes. One chunk when the padded context has at most
        `one_read_rows` rows (B x S; None: `ONE_READ_ROWS`), else chunks of at most `chunk_rows`
        rows (None: `CHUNK_ROWS`) and at least one block position."""
        nd = batch.num_decodes
        if not nd:
            return None
        lens = batch.seq_len_list[:nd]
        context_len, shortest = max(lens), min(lens)
        num_blocks = -(-context_len // block_size)
        if nd * num_blocks * block_size <= (
            ONE_READ_ROWS if one_read_rows is None else one_read_rows
        ):
            per_chunk = num_blocks
        else:
            per_chunk = max(
                1, (CHUNK_ROWS if chunk_rows is None else chunk_rows) // (nd * block_size)
            )
        tables = batch.block_tables[:nd, :num_blocks].long()
        chunks = []
        for first in range(0, num_blocks, per_chunk):
            last = min(num_blocks, first + per_chunk)
            start, end = first * block_size, min(last * block_size, context_len)
            pad_mask = None
            if shortest < end:
                positions = torch.arange(start, end, device=batch.seq_lens.device)
                pad_mask = (positions >= batch.seq_lens[:nd, None])[:, None, :]
            block_ids = tables[:, first:last].reshape(-1)
            chunks.append(DecodeChunk(block_ids, end - start, pad_mask))
        return cls(tuple(chunks), context_len)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """What every attention layer of one forward shares."""

    cos: torch.Tensor  # [T, 1, R] rope table rows of the tokens' positions (RotaryEmbedding)
    sin: torch.Tensor  # [T, 1, R]
    decode_gather: DecodeGather | None  # CPU decodes only (the CUDA kernel reads block tables)


def _read_chunk(kv_cache: torch.Tensor, chunk: DecodeChunk, num_seqs: int) -> torch.Tensor:
    """The chunk's cache rows [B, C, L + R] in fp32 (a copy of the chunk only)."""
    kv = kv_cache.index_select(0, chunk.block_ids).view(num_seqs, -1, kv_cache.shape[-1])
    kv = kv[:, : chunk.num_rows]
    return kv if kv.dtype == torch.float32 else kv.float()


def mla_decode_cpu(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    gather: DecodeGather,
    scale: float,
) -> torch.Tensor:
    """q_latent [B, H, L], q_rope [B, H, R], kv_cache [num_blocks, BS, L + R] -> [B, H, L] in
    q_latent's dtype: softmax_t(scale * (q_latent . c_t + q_rope . k_rope_t)) @ c_t, in fp32."""
    q = torch.cat((q_latent, q_rope), dim=-1)  # [B, H, L + R]
    if q.dtype != torch.float32:
        q = q.float()
    if len(gather.chunks) == 1:
        out = _attend_one_chunk(q, kv_cache, gather.chunks[0], q_latent.shape[-1], scale)
    else:
        out = _attend_chunks_online(q, kv_cache, gather.chunks, q_latent.shape[-1], scale)
    return out if out.dtype == q_latent.dtype else out.to(q_latent.dtype)


def _attend_one_chunk(
    q: torch.Tensor, kv_cache: torch.Tensor, chunk: DecodeChunk, lat: int, scale: float
) -> torch.Tensor:
    """The whole context in one read: q [B, H, L + R] fp32 -> [B, H, L] fp32."""
    kv = _read_chunk(kv_cache, chunk, q.shape[0])
    scores = torch.bmm(q, kv.transpose(1, 2)).mul_(scale)  # [B, H, C]
    if chunk.pad_mask is not None:
        scores.masked_fill_(chunk.pad_mask, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), kv[..., :lat])


def _attend_chunks_online(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    chunks: tuple[DecodeChunk, ...],
    lat: int,
    scale: float,
) -> torch.Tensor:
    """Online softmax over the chunks: q [B, H, L + R] fp32 -> [B, H, L] fp32.

    Invariant after each chunk: `acc` = sum_t exp(s_t - m) c_t and `total` = sum_t exp(s_t - m)
    over the positions seen so far, `m` their running max score [B, H, 1]. The first chunk holds
    position 0 of every decode, so `m` is finite from then on and a fully padded later chunk
    (scores -inf) adds exp(-inf) = 0.
    """
    num_seqs = q.shape[0]
    q = q * scale
    running_max, total, acc = None, None, None
    for chunk in chunks:
        kv = _read_chunk(kv_cache, chunk, num_seqs)
        scores = torch.bmm(q, kv.transpose(1, 2))  # [B, H, C]
        if chunk.pad_mask is not None:
            scores.masked_fill_(chunk.pad_mask, float("-inf"))
        chunk_max = scores.amax(dim=-1, keepdim=True)
        if running_max is None or total is None or acc is None:  # the first chunk
            running_max = chunk_max
            probs = scores.sub_(running_max).exp_()
            total = probs.sum(dim=-1, keepdim=True)
            acc = torch.bmm(probs, kv[..., :lat])
            continue
        new_max = torch.maximum(running_max, chunk_max)
        rescale = running_max.sub_(new_max).exp_()  # [B, H, 1], <= 1
        probs = scores.sub_(new_max).exp_()
        total = total.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
        acc = acc.mul_(rescale).baddbmm_(probs, kv[..., :lat])
        running_max = new_max
    if acc is None or total is None:
        raise ValueError("no chunk to attend over")
    return acc.div_(total)
