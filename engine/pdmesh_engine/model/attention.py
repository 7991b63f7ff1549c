"""Per-step attention inputs shared by every layer, and MLA decode attention on CPU.

`AttentionMetadata` is built once per forward (`DeepseekV3ForCausalLM.forward`) from the
`ForwardBatch`: the rope tables of the step's positions and, for CPU decodes, the block ids to
gather and the padding mask. The layers then spend no ops on them.

`mla_decode_cpu` is the absorbed-form decode attention of `pdmesh_kernels.mla_decode` for CPU:
the same math as `mla_decode_attention_ref` (one gather of the sequences' blocks, scores and
values as two batched matmuls, softmax in fp32), with the gather indices and the mask taken from
the metadata instead of recomputed per layer, and no read of `seq_lens` back to the host.

Legend: T tokens, H heads, L kv_lora_rank, R qk_rope_head_dim, B decode sequences, NB blocks
gathered per sequence, BS block size, S longest decode context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh_engine.forward_batch import ForwardBatch


@dataclass(frozen=True, slots=True)
class DecodeGather:
    """Which cache rows the CPU decode attention reads, the same for every layer of a step."""

    block_ids: torch.Tensor  # [B * NB] int64: each decode's first NB blocks, row-major
    context_len: int  # S = the longest decode's tokens; NB = ceil(S / BS)
    pad_mask: torch.Tensor | None  # [B, 1, S] bool, True at positions >= seq_lens[b]; None: no pad

    @classmethod
    def build(cls, batch: ForwardBatch, block_size: int) -> DecodeGather | None:
        """None when the batch has no decodes."""
        nd = batch.num_decodes
        if not nd:
            return None
        lens = batch.seq_len_list[:nd]
        context_len = max(lens)
        num_blocks = -(-context_len // block_size)
        block_ids = batch.block_tables[:nd, :num_blocks].reshape(-1).long()
        pad_mask = None
        if min(lens) < context_len:
            positions = torch.arange(context_len, device=batch.seq_lens.device)
            pad_mask = (positions >= batch.seq_lens[:nd, None])[:, None, :]
        return cls(block_ids, context_len, pad_mask)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """What every attention layer of one forward shares."""

    cos: torch.Tensor  # [T, 1, R] rope table rows of the tokens' positions (RotaryEmbedding)
    sin: torch.Tensor  # [T, 1, R]
    decode_gather: DecodeGather | None  # CPU decodes only (the CUDA kernel reads block tables)


def mla_decode_cpu(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    gather: DecodeGather,
    scale: float,
) -> torch.Tensor:
    """q_latent [B, H, L], q_rope [B, H, R], kv_cache [num_blocks, BS, L + R] -> [B, H, L] in
    q_latent's dtype: softmax_t(scale * (q_latent . c_t + q_rope . k_rope_t)) @ c_t."""
    num_seqs, _, lat = q_latent.shape
    kv = kv_cache.index_select(0, gather.block_ids).view(num_seqs, -1, kv_cache.shape[-1])
    kv = kv[:, : gather.context_len]  # [B, S, L + R]
    q = torch.cat((q_latent, q_rope), dim=-1)  # [B, H, L + R]
    if kv.dtype != torch.float32:
        kv, q = kv.float(), q.float()
    scores = torch.bmm(q, kv.transpose(1, 2)).mul_(scale)  # [B, H, S]
    if gather.pad_mask is not None:
        scores.masked_fill_(gather.pad_mask, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), kv[..., :lat])
    return out if out.dtype == q_latent.dtype else out.to(q_latent.dtype)
