"""The CPU decode paths: routed experts as embedding bags over row tables, the per-step attention
metadata and MLA decode attention, and the CPU weight layouts.

- `routed_experts` / `expert_rows` equal the per-slot torch reference (`fused_moe` on CPU) in fp32,
  for one token, many tokens (slots shared between tokens), no token, bf16, weights in the plain
  layout (the fallback), through both the embedding-bag and the grouped (prefill) paths;
- the row-table layout survives slot writes and the placement switch's `index_copy_`;
- a MoE layer's op count does not grow with the batch (no Python loop over experts) and it reads
  no scalar back to the host;
- `mla_decode_cpu` over a `DecodeGather` equals `mla_decode_attention_ref` for scattered blocks
  and unequal context lengths, read in one chunk (the same arithmetic) or in many (the online
  softmax, also with scores far apart between chunks); chunks split the block tables by rows
  and need no mask where every decode is long enough;
- `use_cpu_layouts` keeps every weight's values and shape, and the logits (torch path and C path).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from small_models import small_config
from torch.utils._python_dispatch import TorchDispatchMode

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model import experts
from pdmesh_engine.model.deepseek_v3 import cpu_path
from pdmesh_engine.model.deepseek_v3.attention import DecodeGather, mla_decode_cpu
from pdmesh_engine.model.deepseek_v3.model import DeepseekV3ForCausalLM
from pdmesh_engine.model.experts import (
    expert_rows,
    has_row_tables,
    routed_experts,
    to_row_tables,
)
from pdmesh_engine.model.moe import ExpertPlacement, LocalDispatcher, MoE
from pdmesh_kernels import fused_moe, mla_decode_attention_ref


def _experts(num_tokens: int, top_k: int, num_slots: int, seed: int) -> tuple[torch.Tensor, ...]:
    """x [T, D], weights [T, K], slot_ids [T, K] (distinct per token), w13, w2 in fp32."""
    gen = torch.Generator().manual_seed(seed)
    hidden, width = 24, 12
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = 0.3 * torch.randn(num_slots, 2 * width, hidden, generator=gen)
    w2 = 0.3 * torch.randn(num_slots, hidden, width, generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    slot_ids = torch.rand(num_tokens, num_slots, generator=gen).argsort(dim=1)[:, :top_k]
    return x, weights, slot_ids, w13, w2


@pytest.mark.parametrize(("num_tokens", "top_k", "num_slots"), [(1, 4, 16), (13, 3, 5), (0, 2, 4)])
def test_routed_experts_match_the_per_slot_reference(
    num_tokens: int, top_k: int, num_slots: int
) -> None:
    x, weights, slot_ids, w13, w2 = _experts(num_tokens, top_k, num_slots, seed=num_tokens)
    expected = fused_moe(x, w13, w2, weights, slot_ids, use_triton=False)
    tables = (to_row_tables(w13), to_row_tables(w2))
    assert has_row_tables(*tables) and not has_row_tables(w13, w2)
    out = routed_experts(x, weights, slot_ids, *tables)
    assert out.shape == (num_tokens, x.shape[1]) and out.dtype == x.dtype
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the plain layout takes the reference path: the same numbers
    torch.testing.assert_close(routed_experts(x, weights, slot_ids, w13, w2), expected)


@pytest.mark.parametrize("rows_per_slot", [0, 10**9])  # always grouped, never grouped
def test_grouped_and_embedding_bag_paths_agree(
    monkeypatch: pytest.MonkeyPatch, rows_per_slot: int
) -> None:
    monkeypatch.setattr(experts, "GROUPED_ROWS_PER_SLOT", rows_per_slot)
    x, weights, slot_ids, w13, w2 = _experts(40, 2, 4, seed=11)  # 20 rows per slot
    out = routed_experts(x, weights, slot_ids, to_row_tables(w13), to_row_tables(w2))
    expected = fused_moe(x, w13, w2, weights, slot_ids, use_triton=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_expert_rows_agree_between_layouts_and_in_bf16() -> None:
    x, _, slot_ids, w13, w2 = _experts(9, 2, 6, seed=7)
    rows = x.repeat_interleave(2, dim=0)
    slots, order = torch.sort(slot_ids.reshape(-1), stable=True)
    plain = expert_rows(rows[order], slots, w13, w2)
    tables = expert_rows(rows[order], slots, to_row_tables(w13), to_row_tables(w2))
    torch.testing.assert_close(tables, plain, rtol=1e-5, atol=1e-5)
    bf16 = [t.bfloat16() for t in (x, w13, w2)]
    out = routed_experts(
        bf16[0], torch.ones(9, 2), slot_ids, to_row_tables(bf16[1]), to_row_tables(bf16[2])
    )
    ref = fused_moe(x, w13, w2, torch.ones(9, 2), slot_ids, use_triton=False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2)


def _moe(config: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    placement = ExpertPlacement.initial(config.n_routed_experts, num_redundant=2)
    moe = MoE(config, placement, LocalDispatcher(), range(placement.num_physical), 0)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.2)
    return moe


def test_row_tables_keep_their_layout_through_slot_writes() -> None:
    moe = _moe(small_config())
    before = (moe.w13.detach().clone(), moe.w2.detach().clone())
    moe.use_row_tables()
    assert has_row_tables(moe.w13, moe.w2)
    assert torch.equal(moe.w13, before[0]) and torch.equal(moe.w2, before[1])
    gate = torch.randn(moe.w2.shape[2], moe.w2.shape[1])
    moe.write_slot(3, "gate_proj", gate)  # a checkpoint read (load, EPLB staging)
    staged = torch.randn(2, *moe.w13.shape[1:])
    moe.w13.data.index_copy_(0, torch.tensor([0, 5]), staged)  # the placement switch
    assert has_row_tables(moe.w13, moe.w2)
    assert torch.equal(moe.w13[3, : moe.w2.shape[2]], gate)
    assert torch.equal(moe.w13[5], staged[1])


class _OpLog(TorchDispatchMode):
    """Names of the aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_moe_op_count_does_not_grow_with_the_batch() -> None:
    moe = _moe(small_config())
    moe.use_row_tables()
    logs = {}
    for num_tokens in (1, 24):
        x = torch.randn(num_tokens, 32)
        moe(x)  # first call: cached placement properties
        with _OpLog() as log:
            moe(x)
        logs[num_tokens] = log.names
    assert len(logs[1]) == len(logs[24])  # the per-slot loop of the reference: 75 vs 166
    host_reads = ("aten._local_scalar_dense", "aten.item")  # `.item()`, `int(t)`
    assert not [name for name in logs[24] if name.startswith(host_reads)], logs[24]


def _scattered_batch(seq_lens: list[int], block_size: int, gen: torch.Generator) -> ForwardBatch:
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_ids = []
    for n in seq_lens:
        count = -(-n // block_size)
        block_ids.append(free[:count])
        free = free[count:]
    return ForwardBatch.build(
        [[1]] * len(seq_lens),
        [n - 1 for n in seq_lens],
        block_ids,
        block_size,
        [True] * len(seq_lens),
        torch.device("cpu"),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [10**6, 16, 1])  # one chunk; 1 block each; 1 block
def test_mla_decode_cpu_matches_the_reference(dtype: torch.dtype, chunk_rows: int) -> None:
    gen = torch.Generator().manual_seed(3)
    block_size, heads, lat, rope = 4, 3, 16, 8
    batch = _scattered_batch([5, 13, 1, 8], block_size, gen)
    cache = torch.randn(40, block_size, lat + rope, generator=gen).to(dtype)
    q_latent = torch.randn(4, heads, lat, generator=gen).to(dtype)
    q_rope = torch.randn(4, heads, rope, generator=gen).to(dtype)
    gather = DecodeGather.build(batch, block_size, chunk_rows, one_read_rows=0)
    assert gather is not None and gather.context_len == 13
    assert len(gather.chunks) == (1 if chunk_rows > 16 else 4)
    assert sum(chunk.num_rows for chunk in gather.chunks) == 13
    assert gather.chunks[-1].pad_mask is not None  # the 13-token decode sets the width
    out = mla_decode_cpu(q_latent, q_rope, cache, gather, 0.3)
    ref = mla_decode_attention_ref(q_latent, q_rope, cache, batch.block_tables, batch.seq_lens, 0.3)
    assert out.dtype == dtype
    # one chunk: the reference's arithmetic; several: the online softmax reorders the sums
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)


def test_online_softmax_survives_far_apart_scores_and_long_contexts() -> None:
    """Scores that grow along the context (a later chunk's max far above the first chunk's) and a
    context of many chunks: the rescaling keeps the result equal to the one-read softmax."""
    gen = torch.Generator().manual_seed(8)
    block_size, heads, lat, rope = 16, 8, 32, 8
    seq_lens = [300, 17, 257, 1]
    batch = _scattered_batch(seq_lens, block_size, gen)
    cache = torch.randn(64, block_size, lat + rope, generator=gen)
    cache *= torch.linspace(0.1, 6.0, 64)[:, None, None]  # blocks of very different magnitude
    q_latent = torch.randn(4, heads, lat, generator=gen)
    q_rope = torch.randn(4, heads, rope, generator=gen)
    one = DecodeGather.build(batch, block_size, 10**6)
    many = DecodeGather.build(batch, block_size, 4 * 2 * block_size, 0)  # 2 blocks a chunk
    assert one is not None and many is not None
    assert len(one.chunks) == 1 and len(many.chunks) == 10
    assert many.chunks[0].pad_mask is not None  # the 1-token decode pads from the first chunk
    expected = mla_decode_cpu(q_latent, q_rope, cache, one, 0.5)
    out = mla_decode_cpu(q_latent, q_rope, cache, many, 0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    ref = mla_decode_attention_ref(q_latent, q_rope, cache, batch.block_tables, batch.seq_lens, 0.5)
    torch.testing.assert_close(expected, ref, rtol=0, atol=0)  # one chunk: the same arithmetic


def test_decode_gather_chunks_by_rows_and_skips_prefills() -> None:
    gen = torch.Generator().manual_seed(4)
    equal = DecodeGather.build(_scattered_batch([6, 6], 4, gen), 4)
    assert equal is not None and len(equal.chunks) == 1
    assert equal.chunks[0].pad_mask is None and equal.chunks[0].block_ids.shape == (4,)
    # 2 decodes x 4 rows per block, 16 rows per chunk: 2 block positions per chunk
    batch = _scattered_batch([21, 9], 4, gen)
    chunked = DecodeGather.build(batch, 4, chunk_rows=16, one_read_rows=0)
    assert chunked is not None
    assert [chunk.num_rows for chunk in chunked.chunks] == [8, 8, 5]
    assert [chunk.pad_mask is None for chunk in chunked.chunks] == [True, False, False]
    tables = batch.block_tables.long()
    assert torch.equal(chunked.chunks[1].block_ids, tables[:, 2:4].reshape(-1))
    mask = chunked.chunks[1].pad_mask
    assert mask is not None and mask.shape == (2, 1, 8)
    assert mask[0].sum() == 0 and mask[1, 0].tolist() == [False] + [True] * 7  # position 8 < 9
    # up to one_read_rows (B x S padded to blocks) rows: one read, whatever chunk_rows says
    assert len(DecodeGather.build(batch, 4, chunk_rows=16, one_read_rows=48).chunks) == 1
    assert len(DecodeGather.build(batch, 4, chunk_rows=16, one_read_rows=47).chunks) == 3
    prefill = ForwardBatch.build([[1, 2, 3]], [0], [[0]], 4, [True], torch.device("cpu"))
    assert DecodeGather.build(prefill, 4) is None


@torch.inference_mode()
def test_cpu_layouts_keep_weights_and_logits() -> None:
    config = small_config()
    torch.manual_seed(5)
    model = DeepseekV3ForCausalLM(config, load_mtp=False)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.rope.materialize(config)
    for layer in model.layers:
        layer.self_attn.process_weights()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    batch = ForwardBatch.build(
        [[3, 4, 5, 6], [7]], [0, 0], [[0, 1], [2]], 4, [True, True], torch.device("cpu")
    )
    caches = torch.zeros(config.num_hidden_layers, 4, 4, config.kv_cache_dim)
    expected = model.compute_logits(model(batch, caches))
    cpu_path.use_cpu_layouts(model)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert has_row_tables(model.moe_layers[0].w13, model.moe_layers[0].w2)
    # every linear and router weight stored [in, out] (the CPU layer path's layout)
    assert model.lm_head.weight.t().is_contiguous()
    assert model.layers[0].self_attn.kv_a_proj_with_mqa.weight.t().is_contiguous()
    assert model.moe_layers[0].gate.weight.t().is_contiguous()
    logits = model.compute_logits(model(batch, caches.zero_()))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
