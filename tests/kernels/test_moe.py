"""MoE grouped expert MLP and fused_moe: the references against a naive per-token loop, the
Triton grouped GEMM (under the Triton interpreter, on CPU) against the reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import; see conftest.py

import pytest
import torch
import torch.nn.functional as F
from triton_checks import needs_triton, require_interpreted

from pdmesh_kernels import (
    HAS_TRITON,
    fused_moe,
    grouped_expert_mlp,
    grouped_expert_mlp_ref,
    grouped_expert_mlp_triton,
    moe,
)

# T: tokens, K: experts per token, E: experts, D: hidden, I: intermediate, N: sorted rows.


def _weights(experts: int, dim: int, inter: int, gen: torch.Generator):
    w13 = torch.randn(experts, 2 * inter, dim, generator=gen) / dim**0.5
    w2 = torch.randn(experts, dim, inter, generator=gen) / inter**0.5
    return w13, w2


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator):
    """Distinct experts per token drawn from all but the last expert (which stays unused)."""
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return weights, ids.reshape(tokens, top_k)


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, e: int) -> torch.Tensor:
    inter = w2.shape[2]
    gate, up = w13[e, :inter].double(), w13[e, inter:].double()
    return (F.silu(x.double() @ gate.T) * (x.double() @ up.T)) @ w2[e].double().T


def _naive_fused(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            out[t] += float(topk_weights[t, k]) * _expert_mlp(hidden[t : t + 1], w13, w2, e)[0]
    return out


def _sorted_rows(counts: list[int], dim: int, gen: torch.Generator):
    x = torch.randn(sum(counts), dim, generator=gen)
    return x, torch.tensor(counts, dtype=torch.int64)


COUNT_CASES = [  # (counts per expert, D, I): zeros, a single row, rows spanning several row blocks
    ([3, 0, 5, 1], 32, 16),
    ([0, 0, 7, 0], 16, 24),
    ([40, 0, 1, 17, 0, 2, 0, 9], 80, 40),
]


@pytest.mark.parametrize("case", COUNT_CASES)
def test_grouped_reference_matches_naive_loop(case) -> None:
    counts, dim, inter = case
    gen = torch.Generator().manual_seed(0)
    w13, w2 = _weights(len(counts), dim, inter, gen)
    x, counts_t = _sorted_rows(counts, dim, gen)
    out = grouped_expert_mlp_ref(x, counts_t, w13, w2)
    experts = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    expected = torch.cat(
        [_expert_mlp(x[n : n + 1], w13, w2, int(experts[n])) for n in range(x.shape[0])]
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


ROUTING_CASES = [  # (T, E, K, D, I)
    (1, 4, 1, 32, 16),
    (7, 4, 2, 16, 24),
    (33, 8, 4, 48, 40),
    (7, 8, 1, 32, 16),
    (33, 4, 2, 80, 16),
]


@pytest.mark.parametrize("case", ROUTING_CASES)
def test_fused_moe_reference_matches_naive_loop(case) -> None:
    tokens, experts, top_k, dim, inter = case
    gen = torch.Generator().manual_seed(1)
    w13, w2 = _weights(experts, dim, inter, gen)
    hidden = torch.randn(tokens, dim, generator=gen)
    weights, ids = _routing(tokens, experts, top_k, gen)
    out = fused_moe(hidden, w13, w2, weights, ids, use_triton=False)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    torch.testing.assert_close(
        out.double(), _naive_fused(hidden, w13, w2, weights, ids), atol=1e-5, rtol=1e-5
    )


@needs_triton
@pytest.mark.parametrize("case", COUNT_CASES)
def test_grouped_triton_matches_reference_fp32(case) -> None:
    require_interpreted(moe._grouped_gemm_kernel)
    counts, dim, inter = case
    gen = torch.Generator().manual_seed(2)
    w13, w2 = _weights(len(counts), dim, inter, gen)
    x, counts_t = _sorted_rows(counts, dim, gen)
    out = grouped_expert_mlp_triton(x, counts_t, w13, w2)
    torch.testing.assert_close(
        out, grouped_expert_mlp_ref(x, counts_t, w13, w2), atol=1e-4, rtol=1e-4
    )


@needs_triton
@pytest.mark.parametrize("case", ROUTING_CASES)
def test_fused_moe_triton_matches_reference_fp32(case) -> None:
    require_interpreted(moe._grouped_gemm_kernel)
    tokens, experts, top_k, dim, inter = case
    gen = torch.Generator().manual_seed(3)
    w13, w2 = _weights(experts, dim, inter, gen)
    hidden = torch.randn(tokens, dim, generator=gen)
    weights, ids = _routing(tokens, experts, top_k, gen)
    out = fused_moe(hidden, w13, w2, weights, ids, use_triton=True)
    expected = fused_moe(hidden, w13, w2, weights, ids, use_triton=False)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@needs_triton
def test_fused_moe_triton_matches_reference_bf16() -> None:
    # bf16 tolerance 3e-2: the reference rounds gate/up to bf16 before silu, the kernel does not.
    # The interpreter runs tl.dot in fp32 (UPCAST_DOT), so this checks bf16 loads, casts, stores.
    require_interpreted(moe._grouped_gemm_kernel)
    gen = torch.Generator().manual_seed(4)
    w13, w2 = _weights(8, 48, 40, gen)
    hidden = torch.randn(33, 48, generator=gen)
    weights, ids = _routing(33, 8, 2, gen)
    args = (hidden.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    out = fused_moe(*args, use_triton=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), fused_moe(*args, use_triton=False).float(), atol=3e-2, rtol=3e-2
    )


@needs_triton
def test_row_block_map_covers_every_row_once() -> None:
    counts = torch.tensor([40, 0, 1, 17, 0, 2, 0, 9])
    experts, starts, ends = moe._row_block_map(counts, int(counts.sum()), 16)
    owner = torch.full((int(counts.sum()),), -1)
    for e, s, t in zip(experts.tolist(), starts.tolist(), ends.tolist(), strict=True):
        rows = torch.arange(s, min(t, s + 16))
        assert (owner[rows] == -1).all()
        owner[rows] = e
    assert torch.equal(owner, torch.repeat_interleave(torch.arange(8), counts))


def test_dispatchers_use_reference_on_cpu() -> None:
    gen = torch.Generator().manual_seed(5)
    w13, w2 = _weights(4, 16, 16, gen)
    x, counts = _sorted_rows([2, 0, 3, 1], 16, gen)
    assert torch.equal(
        grouped_expert_mlp(x, counts, w13, w2), grouped_expert_mlp_ref(x, counts, w13, w2)
    )


def test_no_tokens_gives_empty_output() -> None:
    gen = torch.Generator().manual_seed(6)
    w13, w2 = _weights(4, 16, 16, gen)
    hidden = torch.zeros(0, 16)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    out = fused_moe(hidden, w13, w2, torch.zeros(0, 2), ids, use_triton=False)
    assert out.shape == (0, 16)
    if HAS_TRITON:
        assert fused_moe(hidden, w13, w2, torch.zeros(0, 2), ids, use_triton=True).shape == (0, 16)


def test_bad_inputs_raise_value_error() -> None:
    gen = torch.Generator().manual_seed(7)
    w13, w2 = _weights(4, 16, 8, gen)
    x, counts = _sorted_rows([2, 0, 3, 1], 16, gen)
    with pytest.raises(ValueError, match="inconsistent"):
        grouped_expert_mlp_ref(x, counts, w13, w2[:, :, :4])
    with pytest.raises(ValueError, match="counts"):
        grouped_expert_mlp_ref(x, counts[:3], w13, w2)
    with pytest.raises(ValueError, match="dtype"):
        grouped_expert_mlp_ref(x.double(), counts, w13, w2)
    with pytest.raises(ValueError, match="topk"):
        fused_moe(x, w13, w2, torch.ones(6, 2), torch.zeros(6, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="topk_ids must be int"):
        fused_moe(x, w13, w2, torch.ones(6, 2), torch.zeros(6, 2))
