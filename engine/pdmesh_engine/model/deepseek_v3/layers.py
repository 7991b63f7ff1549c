"""Building blocks of the DeepSeek-V3 decoder: RMSNorm, rotary embedding, dense MLP, MLA attention.

MLA caches one latent per token per layer: `c` (kv_lora_rank, after kv_a_layernorm) and the
decoupled rope key `k_pe` (qk_rope_head_dim, rotated), side by side in one row of the paged cache.
Prefill chunks expand the latent to per-head keys/values; decodes use the absorbed form (queries
projected into latent space), which never expands the cache.

Legend: T tokens, H heads, L kv_lora_rank, R qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim,
D hidden size, S context length of one sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v3.attention import AttentionMetadata, mla_decode_cpu
from pdmesh_engine.model.rope import rope_inv_freq, yarn_mscale
from pdmesh_kernels import mla_decode_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 == self.weight.dtype:  # one fused op, the same fp32 arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def attention_scale(config: ModelConfig) -> float:
    scale = config.qk_head_dim**-0.5
    p = config.rope_scaling or {}
    if config.rope_type != "default" and p.get("mscale_all_dim"):
        factor = (
            p.get("factor")
            or config.max_position_embeddings / p["original_max_position_embeddings"]
        )
        scale *= yarn_mscale(factor, p["mscale_all_dim"]) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    """Applies rope to q_pe [T, H, R] and k_pe [T, R] at the given positions.

    With `interleave` the input pairs are (x0, x1), (x2, x3), ... and the output is laid out
    de-interleaved (all even outputs, then all odd), as DeepSeek's reference does; queries and keys
    use the same layout, so their dot products are unaffected.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.interleave = config.rope_interleave
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.materialize(config)

    def materialize(self, config: ModelConfig) -> None:
        """(Re)compute the tables [P, 1, R] in fp32 on the buffers' device: cos holds each pair's
        cos twice (cos, cos), sin holds (-sin, sin), so one multiply-add rotates the whole head."""
        device = self.cos.device if self.cos.device.type != "meta" else torch.device("cpu")
        with torch.device("cpu"):
            inv_freq, scaling = rope_inv_freq(config)
            positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]
            cos, sin = freqs.cos() * scaling, freqs.sin() * scaling  # [P, R/2]
        self.cos = torch.cat((cos, cos), dim=-1)[:, None].to(device)
        self.sin = torch.cat((-sin, sin), dim=-1)[:, None].to(device)

    def forward(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [T, H, R], k_pe [T, R] -> rotated (q_pe, k_pe) at `positions` [T]."""
        return self.rotate(q_pe, k_pe, *self.tables(positions, q_pe.dtype))

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) rows [T, 1, R] of `positions` [T], in `dtype` (once per step)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def rotate(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [T, H, R], k_pe [T, R], cos/sin [T, 1, R] (`tables`) -> rotated (q_pe, k_pe), both
        in one pass.

        (x1, x2) * (cos, cos) + (x2, x1) * (-sin, sin) = (x1 cos - x2 sin, x2 cos + x1 sin), bit for
        bit.
        """
        x = torch.cat((q_pe, k_pe[:, None]), dim=1)  # [T, H + 1, R]
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            y = torch.cat((x1, x2), dim=-1)
        else:
            x1, x2 = x.chunk(2, dim=-1)
            y = x
        out = y * cos + torch.cat((x2, x1), dim=-1) * sin
        return out[:, :-1], out[:, -1]


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLAttention(nn.Module):
    """Multi-head latent attention over a paged latent cache `[num_blocks, block_size, L + R]`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.kv_lora_rank = c.num_attention_heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.scale = attention_scale(c)
        qk_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, qk_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(c.q_lora_rank, qk_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_cache_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(
            c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias
        )
        self.has_q_lora = c.q_lora_rank is not None
        self.w_uk: torch.Tensor | None = None  # [H, N, L], set by process_weights()
        self.w_uv_t: torch.Tensor | None = None  # [H, L, V]

    def process_weights(self) -> None:
        """Split kv_b_proj into the key and value up-projections of the absorbed decode path, laid
        out for `bmm`."""
        w = self.kv_b_proj.weight.view(
            self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank
        )
        self.w_uk = w[:, : self.nope_dim].contiguous()
        self.w_uv_t = w[:, self.nope_dim :].transpose(1, 2).contiguous()

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]; writes the tokens' latents into `kv_cache` first. `meta`: the
        step's shared inputs (rope tables, the CPU decode gather)."""
        num_tokens = x.shape[0]
        q = (
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            if self.has_q_lora
            else self.q_proj(x)
        )
        q = q.view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe, k_pe = rope.rotate(q_pe, k_pe, meta.cos, meta.sin)
        entries = torch.cat((self.kv_a_layernorm(latent), k_pe), dim=-1)
        if entries.dtype != kv_cache.dtype:
            entries = entries.to(kv_cache.dtype)
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, batch.slot_mapping, entries)

        nd = batch.num_decodes
        if nd == num_tokens:  # decodes only: no output buffer to fill
            out = self._decode(q_nope, q_pe, kv_cache, batch, meta)
            return self.o_proj(out.reshape(num_tokens, -1))
        out = x.new_empty(num_tokens, self.num_heads, self.v_dim)
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], kv_cache, batch, meta)
        for b in range(nd, batch.num_seqs):
            start, end = batch.query_start_list[b], batch.query_start_list[b + 1]
            out[start:end] = self._prefill(q_nope[start:end], q_pe[start:end], kv_cache, batch, b)
        return self.o_proj(out.view(num_tokens, -1))

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Absorbed form: q_nope [B, H, N] -> latent queries [B, H, L] -> attention over the
        cached latents -> values [B, H, V]."""
        nd = q_nope.shape[0]
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, H, L]
        if meta.decode_gather is not None:
            out_latent = mla_decode_cpu(q_latent, q_pe, kv_cache, meta.decode_gather, self.scale)
        else:
            out_latent = mla_decode_attention(
                q_latent.contiguous(),
                q_pe.contiguous(),
                kv_cache,
                batch.block_tables[:nd],
                batch.seq_lens[:nd],
                self.scale,
            )
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [B, H, V]

    def _prefill(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: ForwardBatch,
        b: int,
    ) -> torch.Tensor:
        seq_len = batch.seq_len_list[b]
        block_size = kv_cache.shape[1]
        num_blocks = -(-seq_len // block_size)
        ctx = kv_cache[batch.block_tables[b, :num_blocks].long()].view(-1, kv_cache.shape[-1])[
            :seq_len
        ]
        ctx = ctx.to(q_nope.dtype)
        kv = self.kv_b_proj(ctx[:, : self.kv_lora_rank]).view(seq_len, self.num_heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [S, H, N], [S, H, V]
        k_pe = ctx[:, None, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)[None]  # [1, H, Q, N+R]
        k = torch.cat((k_nope, k_pe), dim=-1).transpose(0, 1)[None]  # [1, H, S, N+R]
        v = v.transpose(0, 1)[None]  # [1, H, S, V]
        # SDPA's fused (flash) kernels need 4-d inputs and one head dim for q, k and v: zero-pad the
        # narrower side (zeros change neither the scores, the scale being explicit, nor the values).
        width = max(self.nope_dim + self.rope_dim, self.v_dim)
        q, k = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k))
        v = F.pad(v, (0, width - self.v_dim)) if self.v_dim < width else v
        num_queries = q.shape[2]
        if num_queries == seq_len:  # the whole sequence: plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:  # query i sits at position seq_len - num_queries + i
            mask = torch.ones(num_queries, seq_len, dtype=torch.bool, device=q.device).tril(
                seq_len - num_queries
            )
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out[0, :, :, : self.v_dim].transpose(0, 1)  # [Q, H, V]
