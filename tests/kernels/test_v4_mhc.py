"""DeepSeek-V4 hyper-connections (mHC): the references against the engine's `HyperConnection`,
the Triton kernels (under the Triton interpreter, on CPU) against the references."""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import; see conftest.py

import pytest
import torch
from triton_checks import TOLERANCE, needs_triton, require_interpreted

from pdmesh.tools.model_init_v4 import v4_preset_config
from pdmesh_engine.model.deepseek_v4.blocks import HyperConnection
from pdmesh_engine.model.deepseek_v4.config import V4Config
from pdmesh_kernels import (
    mhc_collapse,
    mhc_collapse_ref,
    mhc_collapse_triton,
    mhc_expand,
    mhc_expand_ref,
    mhc_expand_triton,
    v4_mhc,
)

# T: tokens, N: hc_mult, D: hidden size, M: (2 + N) * N.

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6  # the presets' hc_sinkhorn_iters, hc_eps, rms_norm_eps


def _make_case(tokens: int, n: int, hidden: int, dtype=torch.float32, seed: int = 0):
    """Streams of varied scale per token, and weights at the scale `model_init_v4` draws them
    (fn ~ 1/sqrt(N*D)) times 4, so that the gates and the comb softmax are far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    m = (2 + n) * n
    streams = torch.randn(tokens, n, hidden, generator=gen) * torch.rand(
        tokens, 1, 1, generator=gen
    )
    fn = torch.randn(m, n * hidden, generator=gen) * 4 / (n * hidden) ** 0.5
    base = torch.randn(m, generator=gen)
    scale = torch.rand(3, generator=gen) + 0.5
    out = torch.randn(tokens, hidden, generator=gen)
    return streams.to(dtype), fn, base, scale, out.to(dtype)


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


# (T, N, D): hc_mult 1-4 at the presets' hidden sizes (tiny 64, coder-v4 256, small 512).
CASES = [(5, 1, 64), (7, 2, 64), (3, 3, 256), (6, 4, 256), (4, 4, 512), (2, 2, 512)]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_engine_hyper_connection(case) -> None:
    tokens, n, hidden = case
    streams, fn, base, scale, out = _make_case(tokens, n, hidden, seed=1)
    config = V4Config.from_dict(v4_preset_config("tiny", "float32"))
    config = dataclasses.replace(config, hidden_size=hidden, hc_mult=n)
    hc = HyperConnection(config)
    with torch.no_grad():
        hc.fn.copy_(fn)
        hc.base.copy_(base)
        hc.scale.copy_(scale)
        expected = hc(streams)
        expanded = hc.expand(streams, out, expected[1], expected[2])
    ours = mhc_collapse_ref(
        streams, fn, base, scale, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
    )
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(
        mhc_expand_ref(streams, out, ours[1], ours[2]), expanded, atol=0, rtol=0
    )


def test_reference_comb_is_doubly_stochastic() -> None:
    streams, fn, base, scale, _ = _make_case(6, 4, 64, seed=2)
    _, post, comb = mhc_collapse_ref(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    ones = torch.ones(6, 4)
    # the last Sinkhorn step normalises the columns; 20 steps leave sharp rows only near 1
    torch.testing.assert_close(comb.sum(dim=-2), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(dim=-1), ones, atol=0.1, rtol=0)
    assert bool(((post > 0) & (post < 2)).all())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_triton_collapse_matches_reference(case, dtype) -> None:
    require_interpreted(v4_mhc._mhc_collapse_kernel)
    tokens, n, hidden = case
    streams, fn, base, scale, _ = _make_case(tokens, n, hidden, dtype, seed=3)
    expected = mhc_collapse_ref(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    ours = mhc_collapse_triton(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert ours[0].dtype == dtype and ours[1].dtype == ours[2].dtype == torch.float32
    # the weights are fp32 in both: fp32's tolerance whatever the streams' dtype
    for got, want, tol in zip(ours, expected, (TOLERANCE[dtype], 1e-4, 1e-4), strict=True):
        assert got.shape == want.shape
        assert _rel_err(got, want) <= tol


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_triton_expand_matches_reference(case, dtype) -> None:
    require_interpreted(v4_mhc._mhc_collapse_kernel)
    tokens, n, hidden = case
    streams, fn, base, scale, out = _make_case(tokens, n, hidden, dtype, seed=4)
    _, post, comb = mhc_collapse_ref(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    expected = mhc_expand_ref(streams, out, post, comb)
    ours = mhc_expand_triton(streams, out, post, comb)
    assert ours.shape == expected.shape and ours.dtype == dtype
    assert _rel_err(ours, expected) <= TOLERANCE[dtype]


@needs_triton
def test_triton_strided_streams_and_no_tokens() -> None:
    """Streams as a slice of a wider buffer (strided tokens and streams); an empty step."""
    require_interpreted(v4_mhc._mhc_collapse_kernel)
    streams, fn, base, scale, out = _make_case(5, 3, 64, seed=5)
    wide = torch.zeros(5, 4, 80)
    wide[:, :3, :64] = streams
    view = wide[:, :3, :64]
    expected = mhc_collapse_ref(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    ours = mhc_collapse_triton(view, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    for got, want in zip(ours, expected, strict=True):
        assert _rel_err(got, want) <= 1e-4
    new = mhc_expand_triton(view, out, expected[1], expected[2])
    assert _rel_err(new, mhc_expand_ref(streams, out, expected[1], expected[2])) <= 1e-4
    empty = mhc_collapse_triton(streams[:0], fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert [tuple(t.shape) for t in empty] == [(0, 64), (0, 3), (0, 3, 3)]
    new = mhc_expand_triton(streams[:0], out[:0], expected[1][:0], expected[2][:0])
    assert new.shape == (0, 3, 64)


def test_dispatchers_use_reference_on_cpu() -> None:
    streams, fn, base, scale, out = _make_case(4, 2, 64, seed=6)
    ours = mhc_collapse(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    expected = mhc_collapse_ref(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True))
    assert torch.equal(
        mhc_expand(streams, out, ours[1], ours[2]), mhc_expand_ref(streams, out, ours[1], ours[2])
    )


@needs_triton
def test_dispatchers_forced_triton() -> None:
    require_interpreted(v4_mhc._mhc_collapse_kernel)
    streams, fn, base, scale, out = _make_case(4, 4, 64, seed=7)
    ours = mhc_collapse(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS, use_triton=True)
    expected = mhc_collapse_ref(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
    assert _rel_err(ours[0], expected[0]) <= 1e-4
    new = mhc_expand(streams, out, ours[1], ours[2], use_triton=True)
    assert _rel_err(new, mhc_expand_ref(streams, out, ours[1], ours[2])) <= 1e-4


def test_bad_inputs_raise_value_error() -> None:
    streams, fn, base, scale, out = _make_case(4, 2, 64)
    with pytest.raises(ValueError, match="fn"):
        mhc_collapse_ref(streams, fn[:, :-1], base, scale, ITERS, HC_EPS, NORM_EPS)
    with pytest.raises(ValueError, match="float32"):
        mhc_collapse_ref(streams, fn, base.double(), scale, ITERS, HC_EPS, NORM_EPS)
    post, comb = torch.rand(4, 2), torch.rand(4, 2, 2)
    with pytest.raises(ValueError, match="out"):
        mhc_expand_ref(streams, out[:, :-1], post, comb)
    with pytest.raises(ValueError, match="comb"):
        mhc_expand_ref(streams, out, post, comb[:, :1])
    with pytest.raises(ValueError, match="float32"):
        mhc_expand_ref(streams, out, post.double(), comb)
