"""DeepSeek-V4 Lightning Indexer: the reference against the engine's `Indexer`, the Triton score
kernel (under the Triton interpreter, on CPU) against the reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import; see conftest.py

import pytest
import torch
from triton_checks import TOLERANCE, needs_triton, require_interpreted
from v4_cases import engine_layer, paged_step, pool

from pdmesh_engine.model.deepseek_v4.config import CSA
from pdmesh_kernels import (
    force_triton,
    indexer_scores_ref,
    indexer_scores_triton,
    indexer_topk,
    indexer_topk_ref,
    indexer_topk_triton,
)
from pdmesh_kernels import v4_indexer as indexer_module

# Hi: indexer heads, Ci: indexer head dim, rate: CSA compress rate.


def _make_case(heads, dim, seqs, dtype=torch.float32, seed=0, rate=4):
    """Random queries/weights and a paged index pool (GARBAGE where no entry lives)."""
    gen = torch.Generator().manual_seed(seed)
    step = paged_step(seqs, rate, 4, gen)
    tokens = step.token_seq.shape[0]
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    weights = torch.randn(tokens, heads, generator=gen).to(dtype)
    index_pool = pool(step.entry_used, dim, gen, dtype)
    return q, weights, index_pool, step.entry_slots, step.token_seq, step.visible


def _assert_same_choice(score, chosen, ok, ref_score, ref_chosen, ref_ok) -> None:
    """Same visible count per row; where the reference's chosen score is not tied with another
    visible score of its row, the same index."""
    assert torch.equal(ok, ref_ok)
    picked = ref_score.gather(1, ref_chosen)  # [T, k]
    ties = (ref_score[:, None, :] == picked[:, :, None]).sum(dim=-1) > 1
    unique = ref_ok & ~ties
    assert torch.equal(chosen[unique], ref_chosen[unique])
    assert torch.isfinite(score.gather(1, chosen)[ok]).all()


# (Hi, Ci, top_k, seqs: (cached tokens, queried tokens)): the tiny preset's indexer (16 x 16,
# top-8), 4 heads, the small preset's (16 x 64, top-128); decodes and chunks of ragged lengths,
# queries seeing no entry, fewer than top-k and more than top-k.
CASES = [
    (16, 16, 8, [(45, 1), (22, 7), (9, 9)]),
    (4, 32, 8, [(3, 3), (70, 1), (33, 5)]),
    (16, 64, 128, [(600, 1), (530, 2), (40, 4)]),
]


def test_reference_equals_engine_indexer() -> None:
    layer = engine_layer(CSA)
    entries = layer.step.entries[CSA]
    args = (layer.index_q, layer.index_weights, layer.index, entries.slots)
    chosen, ok = indexer_topk_ref(
        *args, layer.step.token_seq, entries.visible, layer.attn.indexer.top_k
    )
    assert torch.equal(chosen, layer.chosen) and torch.equal(ok, layer.ok)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, dtype) -> None:
    require_interpreted(indexer_module._indexer_scores_kernel)
    heads, dim, top_k, seqs = case
    args = _make_case(heads, dim, seqs, dtype, seed=heads + dim)
    visible = args[-1]
    ref_score = indexer_scores_ref(*args)
    score = indexer_scores_triton(*args)
    assert score.dtype == torch.float32 and score.shape == ref_score.shape
    hidden = torch.arange(score.shape[1])[None, :] >= visible[:, None]
    assert torch.equal(torch.isinf(score), hidden) and torch.equal(torch.isinf(ref_score), hidden)
    scale = ref_score[~hidden].abs().max()
    torch.testing.assert_close(
        score[~hidden], ref_score[~hidden], atol=TOLERANCE[dtype] * scale, rtol=0
    )
    ref_chosen, ref_ok = indexer_topk_ref(*args, top_k)
    chosen, ok = indexer_topk_triton(*args, top_k)
    assert chosen.shape == (score.shape[0], min(top_k, score.shape[1]))
    _assert_same_choice(score, chosen, ok, ref_score, ref_chosen, ref_ok)


@needs_triton
def test_triton_on_the_engine_step() -> None:
    require_interpreted(indexer_module._indexer_scores_kernel)
    layer = engine_layer(CSA, seed=1)
    entries = layer.step.entries[CSA]
    args = (layer.index_q, layer.index_weights, layer.index, entries.slots, layer.step.token_seq)
    ref_score = indexer_scores_ref(*args, entries.visible)
    score = indexer_scores_triton(*args, entries.visible)
    chosen, ok = indexer_topk_triton(*args, entries.visible, layer.attn.indexer.top_k)
    _assert_same_choice(score, chosen, ok, ref_score, layer.chosen, layer.ok)


def test_dispatcher_uses_reference_on_cpu() -> None:
    args = _make_case(16, 16, [(20, 3), (9, 1)], seed=3)
    for got, want in zip(indexer_topk(*args, 4), indexer_topk_ref(*args, 4), strict=True):
        assert torch.equal(got, want)


@needs_triton
def test_dispatcher_forced_triton() -> None:
    require_interpreted(indexer_module._indexer_scores_kernel)
    args = _make_case(16, 16, [(20, 3), (9, 1)], seed=4)
    with force_triton():
        chosen, ok = indexer_topk(*args, 4)
    ref_chosen, ref_ok = indexer_topk_ref(*args, 4)
    score = indexer_scores_triton(*args)
    _assert_same_choice(score, chosen, ok, indexer_scores_ref(*args), ref_chosen, ref_ok)


def test_bad_inputs_raise_value_error() -> None:
    q, weights, index_pool, slots, seq, visible = _make_case(4, 16, [(20, 3), (9, 1)])
    with pytest.raises(ValueError, match="weights"):
        indexer_topk_ref(q, weights[:, :2], index_pool, slots, seq, visible, 4)
    with pytest.raises(ValueError, match="index_pool"):
        indexer_topk_ref(q, weights, index_pool[:, :8], slots, seq, visible, 4)
    with pytest.raises(ValueError, match="entry_slots"):
        indexer_topk_ref(q, weights, index_pool, slots.float(), seq, visible, 4)
    with pytest.raises(ValueError, match="visible"):
        indexer_topk_ref(q, weights, index_pool, slots, seq, visible[:2], 4)
