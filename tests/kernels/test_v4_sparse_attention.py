"""DeepSeek-V4 sparse attention with sinks: the reference against the engine's `Attention`
(sliding, CSA and HCA layers), the Triton kernel (under the Triton interpreter, on CPU) against
the reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import; see conftest.py

import pytest
import torch
from triton_checks import TOLERANCE, needs_triton, require_interpreted
from v4_cases import engine_layer, paged_step, pool

from pdmesh_engine.model.deepseek_v4.config import CSA, HCA, SLIDING
from pdmesh_kernels import (
    HAS_TRITON,
    force_triton,
    v4_attention,
    v4_attention_ref,
    v4_attention_triton,
)
from pdmesh_kernels import v4_sparse_attention as attention_module
from pdmesh_kernels.v4_indexer import select_top_k

# H: heads, C: head_dim, W: window, rate: compress rate, top_k: CSA's chosen entries (None: HCA,
# every visible entry; 0: a sliding layer, no entries).


def _make_case(heads, dim, window, rate, top_k, seqs, dtype=torch.float32, seed=0):
    """(args, kwargs) of a random step: paged pools holding GARBAGE where no token or entry
    lives; CSA's `chosen` is the top-k of random scores, so a query seeing fewer than k entries
    gets hidden ones too, as from the indexer."""
    gen = torch.Generator().manual_seed(seed)
    step = paged_step(seqs, rate, window, gen)
    tokens = step.token_seq.shape[0]
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    sink = torch.randn(heads, generator=gen)
    args = (q, pool(step.window_used, dim, gen, dtype), step.window_slots, step.window_valid)
    args += (sink, dim**-0.5)
    if top_k == 0:
        return args, {}
    kwargs = {
        "entry_pool": pool(step.entry_used, dim, gen, dtype),
        "entry_slots": step.entry_slots,
        "token_seq": step.token_seq,
        "visible": step.visible,
    }
    if top_k is not None:
        score = torch.randn(tokens, step.entry_slots.shape[1], generator=gen)
        hidden = torch.arange(score.shape[1])[None, :] >= step.visible[:, None]
        kwargs["chosen"] = select_top_k(
            score.masked_fill(hidden, float("-inf")), step.visible, top_k
        )[0]
    return args, kwargs


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


# (H, C, W, rate, top_k, seqs: (cached tokens, queried tokens)): the tiny preset's shapes (4 x 32,
# window 16, CSA 4 top-8, HCA 16) and the small preset's (head_dim 128, window 128, CSA top-128,
# HCA 128) with 16 heads; decodes and chunks of ragged lengths, queries seeing no entry, fewer and
# more than top-k.
CASES = [
    (4, 32, 16, 4, 8, [(45, 1), (22, 7), (9, 9)]),
    (4, 32, 16, 16, None, [(70, 1), (40, 5), (3, 3)]),
    (16, 64, 16, 4, 0, [(20, 2), (5, 5)]),
    (16, 128, 128, 4, 128, [(600, 1), (530, 1), (40, 3)]),
    (16, 128, 128, 128, None, [(700, 1), (300, 2)]),
]


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_reference_equals_engine_attention(kind) -> None:
    layer = engine_layer(kind)
    step, attn = layer.step, layer.attn
    kwargs = {}
    if kind != SLIDING:
        entries = step.entries[kind]
        kwargs = {
            "entry_pool": layer.entries,
            "entry_slots": entries.slots,
            "token_seq": step.token_seq,
            "visible": entries.visible,
            "chosen": layer.chosen if kind == CSA else None,
        }
    args = (layer.q, layer.window, step.window_slots, step.window_valid, attn.attn_sink)
    out = v4_attention_ref(*args, attn.dim**-0.5, **kwargs)
    torch.testing.assert_close(out, layer.out, atol=1e-6, rtol=1e-5)
    if HAS_TRITON:
        require_interpreted(attention_module._v4_sparse_attention_kernel)
        triton_out = v4_attention_triton(*args, attn.dim**-0.5, **kwargs)
        assert _rel_err(triton_out, layer.out) <= 1e-4


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, dtype) -> None:
    require_interpreted(attention_module._v4_sparse_attention_kernel)
    args, kwargs = _make_case(*case, dtype=dtype, seed=case[0] + case[1] + case[3])
    ref = v4_attention_ref(*args, **kwargs)
    out = v4_attention_triton(*args, **kwargs)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) <= TOLERANCE[dtype]


def test_sink_takes_its_share() -> None:
    # One valid key k and a sink s per head: out = k * e^(q.k*scale) / (e^(q.k*scale) + e^s).
    args, _ = _make_case(4, 32, 16, 4, 0, [(1, 1)], seed=6)
    q, window_pool, slots, valid, sink, scale = args
    key = window_pool[slots[0, -1]]
    logit = (q[0] @ key) * scale
    expected = key[None, :] * (logit.exp() / (logit.exp() + sink.exp()))[:, None]
    torch.testing.assert_close(v4_attention_ref(*args)[0], expected, atol=1e-6, rtol=1e-5)


def test_dispatcher_uses_reference_on_cpu() -> None:
    args, kwargs = _make_case(4, 32, 16, 4, 8, [(20, 3), (9, 1)], seed=3)
    assert torch.equal(v4_attention(*args, **kwargs), v4_attention_ref(*args, **kwargs))


@needs_triton
def test_dispatcher_forced_triton() -> None:
    require_interpreted(attention_module._v4_sparse_attention_kernel)
    args, kwargs = _make_case(4, 32, 16, 4, 8, [(20, 3), (9, 1)], seed=4)
    with force_triton():
        out = v4_attention(*args, **kwargs)
    assert _rel_err(out, v4_attention_ref(*args, **kwargs)) <= 1e-4


def test_bad_inputs_raise_value_error() -> None:
    args, kwargs = _make_case(4, 32, 16, 4, 8, [(20, 3), (9, 1)])
    q, window_pool, slots, valid, sink, scale = args
    with pytest.raises(ValueError, match="window_pool"):
        v4_attention_ref(q, window_pool[:, :8], slots, valid, sink, scale, **kwargs)
    with pytest.raises(ValueError, match="window_valid"):
        v4_attention_ref(q, window_pool, slots, valid.int(), sink, scale, **kwargs)
    with pytest.raises(ValueError, match="sink"):
        v4_attention_ref(q, window_pool, slots, valid, sink[:2], scale, **kwargs)
    with pytest.raises(ValueError, match="entry_pool"):
        v4_attention_ref(*args, **(kwargs | {"entry_pool": kwargs["entry_pool"].double()}))
    with pytest.raises(ValueError, match="visible"):
        v4_attention_ref(*args, **(kwargs | {"visible": None}))
    with pytest.raises(ValueError, match="chosen"):
        v4_attention_ref(*args, chosen=kwargs["chosen"])
