"""MLA paged decode attention: the reference against a naive per-token loop, the Triton kernel
(under the Triton interpreter, on CPU) against the reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import; see conftest.py

import pytest
import torch
from triton_checks import needs_triton, require_interpreted

from pdmesh_kernels import mla_decode as mla
from pdmesh_kernels import (
    mla_decode_attention,
    mla_decode_attention_ref,
    mla_decode_attention_triton,
)

# B: batch, H: heads, L: kv_lora_rank, R: rope dim, BS: block size.

GARBAGE = 100.0  # fills cache slots no sequence may read; a masking bug shows up as a large error


def _make_case(
    batch: int,
    heads: int,
    lat: int,
    rope: int,
    block_size: int,
    seq_lens: list[int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """Random queries and a paged cache whose blocks are shuffled across sequences.

    Slots past each sequence's length hold GARBAGE; block-table entries past the used blocks
    are 0 (a valid block owned by some other sequence). block_tables is a column slice of a
    wider table, so its row stride differs from its width.
    """
    assert len(seq_lens) == batch
    gen = torch.Generator().manual_seed(seed)
    used = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(used) + 1
    num_blocks = sum(used) + 3
    kv = torch.full((num_blocks, block_size, lat + rope), GARBAGE)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(batch, max_blocks + 2, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        for j in range(used[b]):
            block = perm.pop()
            table[b, j] = block
            valid = min(block_size, n - j * block_size)
            kv[block, :valid] = torch.randn(valid, lat + rope, generator=gen)
    q_latent = torch.randn(batch, heads, lat, generator=gen)
    q_rope = torch.randn(batch, heads, rope, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q_latent.to(dtype), q_rope.to(dtype), kv.to(dtype), table[:, :max_blocks], lens)


def _naive(q_latent, q_rope, kv_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """Per-sequence, per-token loop in float64."""
    batch, heads, lat = q_latent.shape
    block_size = kv_cache.shape[1]
    out = torch.empty(batch, heads, lat, dtype=torch.float64)
    for b in range(batch):
        rows = [
            kv_cache[int(block_tables[b, p // block_size]), p % block_size]
            for p in range(int(seq_lens[b]))
        ]
        kv = torch.stack(rows).double()  # [n, L+R]
        scores = scale * (q_latent[b].double() @ kv[:, :lat].T + q_rope[b].double() @ kv[:, lat:].T)
        out[b] = torch.softmax(scores, dim=-1) @ kv[:, :lat]
    return out


# (B, H, L, R, BS, seq_lens): every value of the brief's grid appears; lengths are not
# multiples of BS, include 1, and include a full last block.
CASES = [
    (1, 1, 16, 8, 4, [7]),
    (3, 4, 32, 16, 16, [1, 17, 40]),
    (5, 4, 16, 8, 4, [3, 9, 1, 12, 22]),
    (3, 1, 32, 8, 16, [33, 5, 16]),
    (5, 1, 16, 16, 16, [50, 2, 31, 18, 1]),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_naive_loop(case) -> None:
    batch, heads, lat, rope, block_size, lens = case
    args = _make_case(batch, heads, lat, rope, block_size, lens)
    out = mla_decode_attention_ref(*args, scale=0.3)
    assert out.shape == (batch, heads, lat) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _naive(*args, scale=0.3), atol=1e-5, rtol=1e-5)


def test_reference_bf16_keeps_dtype_and_is_close() -> None:
    args = _make_case(3, 4, 32, 16, 4, [5, 13, 2], dtype=torch.bfloat16)
    out = mla_decode_attention_ref(*args, scale=0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _naive(*args, scale=0.2), atol=1e-2, rtol=1e-2)


@needs_triton
@pytest.mark.parametrize("num_kv_splits", [1, 3, None])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference_fp32(case, num_kv_splits) -> None:
    require_interpreted(mla._mla_decode_split_kernel)
    batch, heads, lat, rope, block_size, lens = case
    args = _make_case(batch, heads, lat, rope, block_size, lens, seed=1)
    expected = mla_decode_attention_ref(*args, scale=0.25)
    out = mla_decode_attention_triton(*args, scale=0.25, num_kv_splits=num_kv_splits)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_triton_matches_reference_bf16(num_kv_splits) -> None:
    # bf16 tolerance 2e-2 (bf16 output rounding; on CUDA also the bf16 p @ c). The interpreter
    # runs tl.dot in fp32 (UPCAST_DOT), so this checks bf16 loads, casts and stores.
    require_interpreted(mla._mla_decode_split_kernel)
    args = _make_case(3, 4, 32, 16, 4, [5, 13, 2], dtype=torch.bfloat16, seed=2)
    expected = mla_decode_attention_ref(*args, scale=0.2)
    out = mla_decode_attention_triton(*args, scale=0.2, num_kv_splits=num_kv_splits)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_triton
def test_more_splits_than_tokens_leaves_empty_splits_harmless() -> None:
    require_interpreted(mla._mla_decode_split_kernel)
    args = _make_case(3, 4, 16, 8, 4, [1, 2, 6], seed=3)
    expected = mla_decode_attention_ref(*args, scale=0.5)
    out = mla_decode_attention_triton(*args, scale=0.5, num_kv_splits=4)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_dispatcher_uses_reference_on_cpu() -> None:
    args = _make_case(3, 4, 16, 8, 4, [5, 9, 2], seed=4)
    assert torch.equal(
        mla_decode_attention(*args, scale=0.3), mla_decode_attention_ref(*args, scale=0.3)
    )


@needs_triton
def test_dispatcher_forced_triton() -> None:
    require_interpreted(mla._mla_decode_split_kernel)
    args = _make_case(3, 4, 16, 8, 4, [5, 9, 2], seed=5)
    out = mla_decode_attention(*args, scale=0.3, use_triton=True)
    torch.testing.assert_close(
        out, mla_decode_attention_ref(*args, scale=0.3), atol=1e-4, rtol=1e-4
    )


def test_bad_inputs_raise_value_error() -> None:
    q_latent, q_rope, kv, table, lens = _make_case(3, 4, 16, 8, 4, [5, 9, 2])
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode_attention_ref(q_latent, q_rope, kv[..., :-1], table, lens, 0.3)
    with pytest.raises(ValueError, match="q_rope"):
        mla_decode_attention_ref(q_latent, q_rope[:2], kv, table, lens, 0.3)
    with pytest.raises(ValueError, match="block_tables"):
        mla_decode_attention_ref(q_latent, q_rope, kv, table.float(), lens, 0.3)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode_attention_ref(q_latent, q_rope, kv, table, lens[:2], 0.3)
    with pytest.raises(ValueError, match="dtype"):
        mla_decode_attention_ref(q_latent, q_rope, kv.double(), table, lens, 0.3)
