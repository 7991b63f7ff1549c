"""The DeepSeek-V4 release's weight formats: FP8 dense weights and MXFP4 routed experts.

As the release stores them (read by llama.cpp's converter, `conversion/deepseek.py`
`DeepseekV4Model.dequant_model` / `repack_mxfp4_blocks`, and by transformers' FP8 integration):

- FP8: `X.weight` float8_e4m3fn [M, N] with `X.scale` [ceil(M/bm), ceil(N/bn)] (bm x bn =
  config.json's `quantization_config.weight_block_size`, [128, 128] in the release), one ue8m0
  scale per block: w = e4m3 * 2^(byte - 127). The last row/column of blocks may be partial.
- MXFP4 (routed experts, `expert_dtype` "fp4"): `X.weight` int8 [M, N/2], two e2m1 codes per
  byte, element 2i in the low nibble and 2i+1 in the high one, with `X.scale` [M, N/32], one
  ue8m0 scale per 32 consecutive elements of a row: w = e2m1 * 2^(byte - 127).

ue8m0 scales are float8_e8m0fnu tensors (safetensors F8_E8M0); raw uint8 exponents read the same.
`iter_v4_tensors` streams a checkpoint with every quantised weight dequantised; the quantisers are
the inverse, for `pdmesh model init --format official` and the tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from pdmesh_engine.checkpoint import tensor_names
from pdmesh_engine.config import CheckpointError, read_json

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
MX_GROUP = 32  # MXFP4 elements per scale
DEFAULT_BLOCK = (128, 128)
# e2m1 code -> value: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
# Midpoints between the non-negative e2m1 magnitudes (codes 0..7); a tie rounds to the smaller.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (float8_e8m0fnu or uint8 biased exponents) -> float32 2^(byte - 127)."""
    return torch.exp2(scale.view(torch.uint8).float() - 127.0)


def ue8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Integer-valued float exponents in [-127, 127] -> float8_e8m0fnu scales 2^exponent."""
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_exponent(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The least power-of-two exponent e with amax / 2^e <= top, clamped to ue8m0's [-127, 127]
    (an all-zero block gets -127)."""
    return torch.ceil(torch.log2(amax / top)).clamp(-127, 127)


def fp8_block_dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int] = DEFAULT_BLOCK,
) -> torch.Tensor:
    """float8_e4m3fn [M, N] with ue8m0 scales [ceil(M/bm), ceil(N/bn)] -> `dtype` [M, N]."""
    m, n = weight.shape
    per_element = ue8m0_to_float(scale)
    per_element = per_element.repeat_interleave(block[0], 0)[:m]
    per_element = per_element.repeat_interleave(block[1], 1)[:, :n]
    return (weight.float() * per_element).to(dtype)


def fp8_block_quantize(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] -> (float8_e4m3fn [M, N], float8_e8m0fnu [ceil(M/bm), ceil(N/bn)]): each block's scale
    is the least power of two that brings its largest magnitude within 448; elements round to
    nearest e4m3."""
    m, n = weight.shape
    bm, bn = block
    rows, cols = -(-m // bm), -(-n // bn)
    padded = torch.zeros(rows * bm, cols * bn)
    padded[:m, :n] = weight.float()
    blocks = padded.view(rows, bm, cols, bn)
    exponent = _pow2_exponent(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    scaled = blocks / torch.exp2(exponent)[:, None, :, None]
    scaled = scaled.clamp(-FP8_MAX, FP8_MAX).view(rows * bm, cols * bn)[:m, :n]
    return scaled.to(torch.float8_e4m3fn), ue8m0_from_exponent(exponent)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [M, N/2] (element 2i low nibble, 2i+1 high) with ue8m0 scales [M, N/32] ->
    `dtype` [M, N]."""
    m, half = packed.shape
    u8 = packed.view(torch.uint8)
    codes = torch.stack((u8 & 0x0F, u8 >> 4), dim=-1).view(m, 2 * half).long()
    values = torch.tensor(E2M1_VALUES)[codes].view(m, -1, MX_GROUP)
    return (values * ue8m0_to_float(scale)[..., None]).view(m, 2 * half).to(dtype)


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] (N a multiple of 32) -> (int8 [M, N/2], float8_e8m0fnu [M, N/32]): each group of 32
    takes the least power-of-two scale that brings its largest magnitude within 6; elements round
    to the nearest e2m1 (a tie to the smaller magnitude)."""
    m, n = weight.shape
    if n % MX_GROUP:
        raise ValueError(f"MXFP4 rows need a multiple of {MX_GROUP} elements, got {n}")
    groups = weight.float().view(m, n // MX_GROUP, MX_GROUP)
    exponent = _pow2_exponent(groups.abs().amax(dim=-1), FP4_MAX)
    scaled = (groups / torch.exp2(exponent)[..., None]).view(m, n)
    codes = torch.bucketize(scaled.abs(), torch.tensor(_E2M1_MIDPOINTS)).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    pairs = codes.view(m, n // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(torch.int8), ue8m0_from_exponent(exponent)


def _block_size(model_dir: Path) -> tuple[int, int]:
    """config.json's `quantization_config.weight_block_size`, [128, 128] when absent."""
    path = model_dir / "config.json"
    quant = (read_json(path) if path.is_file() else {}).get("quantization_config") or {}
    bm, bn = quant.get("weight_block_size") or DEFAULT_BLOCK
    return int(bm), int(bn)


def _dequantize(
    name: str,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int],
) -> torch.Tensor:
    """One quantised weight and its scale -> `dtype`; CheckpointError on a scale that does not
    fit."""
    if weight.dim() != 2:
        raise CheckpointError(f"{name}: a quantised weight is 2-D, this one {tuple(weight.shape)}")
    m, n = weight.shape
    if weight.dtype == torch.float8_e4m3fn:
        kind, want = "FP8", (-(-m // block[0]), -(-n // block[1]))
    else:
        kind, want = "MXFP4", (m, 2 * n // MX_GROUP)
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise CheckpointError(f"{name}: the {kind} scale is {scale.dtype}, expected ue8m0")
    if tuple(scale.shape) != want or (kind == "MXFP4" and 2 * n % MX_GROUP):
        raise CheckpointError(
            f"{name}: {kind} weight {tuple(weight.shape)} {weight.dtype} needs a scale of shape "
            f"{want}, the checkpoint's is {tuple(scale.shape)}"
        )
    if kind == "FP8":
        return fp8_block_dequantize(weight, scale, dtype, block)
    return mxfp4_dequantize(weight, scale, dtype)


def iter_v4_tensors(
    model_dir: str | Path, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(name, tensor)` over the checkpoint (file order, then key order): a float8_e4m3fn
    or int8 (MXFP4) `X.weight` comes back dequantised to `dtype` with its `X.scale` (looked up by
    name, in whichever file holds it) consumed; every other tensor as stored. CheckpointError
    for a quantised weight whose scale is missing or does not fit."""
    model_dir = Path(model_dir)
    files = tensor_names(model_dir)
    block = _block_size(model_dir)
    with ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for file in dict.fromkeys(files.values())
        }
        for name, file in files.items():
            if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in files:
                continue
            tensor = handles[file].get_tensor(name)
            if tensor.dtype in (torch.float8_e4m3fn, torch.int8):
                scale_name = name.removesuffix(".weight") + ".scale"
                if not name.endswith(".weight") or scale_name not in files:
                    raise CheckpointError(
                        f"{name}: a quantised ({tensor.dtype}) weight without its scale "
                        f"{scale_name!r} in the checkpoint"
                    )
                scale = handles[files[scale_name]].get_tensor(scale_name)
                tensor = _dequantize(name, tensor, scale, dtype, block)
            yield name, tensor
