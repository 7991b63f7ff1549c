"""DeepSeek-V4 compressor pooling: the reference against the engine's `Compressor.pool`, the
Triton kernel (under the Triton interpreter, on CPU) against the reference, on ragged steps
whose closing windows are addressed the way the engine's `Closing` addresses them."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import; see conftest.py

import pytest
import torch
from triton_checks import TOLERANCE, needs_triton, require_interpreted

from pdmesh.tools.model_init_v4 import v4_preset_config
from pdmesh_engine.model.deepseek_v4.attention import Compressor
from pdmesh_engine.model.deepseek_v4.blocks import Rope, apply_rope
from pdmesh_engine.model.deepseek_v4.config import V4Config
from pdmesh_kernels import (
    compressor_pool,
    compressor_pool_ref,
    compressor_pool_triton,
    v4_compressor,
)

# C: closing windows, S: series, D: entry channels, BS: block size.

GARBAGE = 100.0  # fills row slots no window may read; a misread shows up as a large error


def _make_step(
    spans: list[tuple[int, int]],
    rate: int,
    series: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A row pool of shuffled blocks and the windows that close in a step of sequences that
    computed positions [start, end) each (a decode, a prefill chunk, a whole prompt).

    Returns (rows [R, 2*S*D], row_slots [C, S*rate], first [C], positions [C], ape, weight):
    as `kv._entries` builds them (CSA window 0's previous-window slots clamped to position 0).
    Slots of positions no sequence has reached hold GARBAGE.
    """
    gen = torch.Generator().manual_seed(seed)
    used = [(end + block_size - 1) // block_size for _, end in spans]
    num_blocks = sum(used) + 2
    rows = torch.full((num_blocks * block_size, 2 * series * dim), GARBAGE)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    slots, first, positions = [], [], []
    for (start, end), blocks in zip(spans, used, strict=True):
        table = [perm.pop() for _ in range(blocks)]
        for pos in range(end):
            slot = table[pos // block_size] * block_size + pos % block_size
            rows[slot] = torch.randn(2 * series * dim, generator=gen) * 2
        for win in range(start // rate, end // rate):
            first_row = win * rate - (rate if series == 2 else 0)
            row_pos = [max(first_row + j, 0) for j in range(series * rate)]
            slots.append([table[p // block_size] * block_size + p % block_size for p in row_pos])
            first.append(win == 0)
            positions.append(win * rate)
    ape = torch.randn(rate, series * dim, generator=gen)
    weight = torch.rand(dim, generator=gen) + 0.5
    return (
        rows.to(dtype),
        torch.tensor(slots, dtype=torch.int64).view(-1, series * rate),
        torch.tensor(first, dtype=torch.bool),
        torch.tensor(positions, dtype=torch.int64),
        ape,
        weight,
    )


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


# (rate, series, dim, block size, per-sequence [start, end)): the presets' CSA (rate 4, two
# series) and HCA (tiny 16, coder-v4 64, small 128) at their head and indexer dims; decodes that
# close a window, chunks that close several, window 0 of CSA, sequences that close none.
CASES = [
    (4, 2, 32, 16, [(3, 4), (0, 13), (7, 8), (20, 22)]),
    (4, 2, 16, 16, [(0, 4), (9, 12), (30, 31)]),
    (16, 1, 32, 16, [(15, 16), (0, 50), (31, 32), (3, 9)]),
    (4, 2, 128, 128, [(0, 9), (127, 128), (60, 64)]),
    (64, 1, 64, 64, [(63, 64), (0, 130)]),
    (128, 1, 128, 128, [(127, 128), (100, 260)]),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_engine_compressor(case) -> None:
    """The reference, rotated as the engine rotates, is `Compressor.pool` on the same rows."""
    rate, series, dim, block_size, spans = case
    rows, slots, first, positions, ape, weight = _make_step(
        spans, rate, series, dim, block_size, seed=1
    )
    config = V4Config.from_dict(v4_preset_config("tiny", "float32"))
    compressor = Compressor(config, rate, dim, series)
    rope = Rope(config.compress_rope)
    with torch.no_grad():
        compressor.ape.copy_(ape)
        compressor.norm.weight.copy_(weight)
        expected = compressor.pool(rows[slots], first, rope, positions)
    ours = compressor_pool_ref(rows, slots, first, ape, weight, config.rms_norm_eps)
    cos, sin = rope.tables(positions, ours.dtype)
    torch.testing.assert_close(apply_rope(ours, cos, sin), expected, atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, dtype) -> None:
    require_interpreted(v4_compressor._compressor_pool_kernel)
    rate, series, dim, block_size, spans = case
    rows, slots, first, _, ape, weight = _make_step(
        spans, rate, series, dim, block_size, dtype=dtype, seed=2
    )
    expected = compressor_pool_ref(rows, slots, first, ape, weight, 1e-6)
    out = compressor_pool_triton(rows, slots, first, ape, weight, 1e-6)
    assert out.shape == expected.shape and out.dtype == dtype
    assert _rel_err(out, expected) <= TOLERANCE[dtype]


@needs_triton
def test_triton_int32_slots_and_no_closing_window() -> None:
    require_interpreted(v4_compressor._compressor_pool_kernel)
    rows, slots, first, _, ape, weight = _make_step([(1, 9), (0, 5)], 4, 2, 32, 16, seed=3)
    expected = compressor_pool_ref(rows, slots, first, ape, weight, 1e-6)
    out = compressor_pool_triton(rows, slots.int(), first, ape, weight, 1e-6)
    assert _rel_err(out, expected) <= 1e-4
    none = compressor_pool_triton(rows, slots[:0], first[:0], ape, weight, 1e-6)
    assert none.shape == (0, 32)


def test_dispatcher_uses_reference_on_cpu() -> None:
    args = _make_step([(0, 13), (3, 4)], 4, 2, 32, 16, seed=4)
    rows, slots, first, _, ape, weight = args
    assert torch.equal(
        compressor_pool(rows, slots, first, ape, weight, 1e-6),
        compressor_pool_ref(rows, slots, first, ape, weight, 1e-6),
    )


@needs_triton
def test_dispatcher_forced_triton() -> None:
    require_interpreted(v4_compressor._compressor_pool_kernel)
    rows, slots, first, _, ape, weight = _make_step([(0, 13), (15, 16)], 16, 1, 32, 16, seed=5)
    out = compressor_pool(rows, slots, first, ape, weight, 1e-6, use_triton=True)
    assert _rel_err(out, compressor_pool_ref(rows, slots, first, ape, weight, 1e-6)) <= 1e-4


def test_bad_inputs_raise_value_error() -> None:
    rows, slots, first, _, ape, weight = _make_step([(0, 13)], 4, 2, 32, 16)
    with pytest.raises(ValueError, match="widths"):
        compressor_pool_ref(rows[:, :-1], slots, first, ape, weight, 1e-6)
    with pytest.raises(ValueError, match="row_slots"):
        compressor_pool_ref(rows, slots[:, :4], first, ape, weight, 1e-6)
    with pytest.raises(ValueError, match="first"):
        compressor_pool_ref(rows, slots, first.int(), ape, weight, 1e-6)
    with pytest.raises(ValueError, match="float32"):
        compressor_pool_ref(rows, slots, first, ape.double(), weight, 1e-6)
