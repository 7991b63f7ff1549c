"""`--dtype auto` on CPU (`pdmesh_engine.cpu_dtype`): bf16 only with native bf16 and a model wide
enough for it to pay, fp32 otherwise; explicit dtypes pass through; the CPU feature check agrees
with the kernel's CPU flags.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from small_models import small_config

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.cpu_dtype import BF16_MIN_HIDDEN, auto_cpu_dtype, has_native_bf16
from pdmesh_engine.model_runner import resolve_dtype


def _config(hidden_size: int) -> ModelConfig:
    return small_config(hidden_size=hidden_size)


@pytest.mark.parametrize(
    ("hidden_size", "native_bf16", "expected"),
    [
        (BF16_MIN_HIDDEN, True, torch.bfloat16),
        (2 * BF16_MIN_HIDDEN, True, torch.bfloat16),
        (BF16_MIN_HIDDEN // 2, True, torch.float32),  # small weights: bf16 loses at one token
        (BF16_MIN_HIDDEN, False, torch.float32),  # no bf16 instructions: emulated, slower
        (64, False, torch.float32),
    ],
)
def test_auto_picks_bf16_only_with_native_bf16_and_a_wide_model(
    hidden_size: int, native_bf16: bool, expected: torch.dtype
) -> None:
    assert auto_cpu_dtype(_config(hidden_size), native_bf16) == expected


def test_resolve_dtype_keeps_small_models_in_fp32_and_explicit_names() -> None:
    cpu = torch.device("cpu")
    small = _config(64)  # the test models' size: fp32 on every CPU (exact against transformers)
    assert resolve_dtype("auto", small, cpu) == torch.float32
    assert resolve_dtype("bfloat16", small, cpu) == torch.bfloat16
    assert resolve_dtype("float32", _config(BF16_MIN_HIDDEN), cpu) == torch.float32
    wide = resolve_dtype("auto", _config(BF16_MIN_HIDDEN), cpu)
    assert wide == (torch.bfloat16 if has_native_bf16() else torch.float32)


def test_native_bf16_agrees_with_the_cpu_flags() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo")
    flags: set[str] = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    if not flags or not {"avx512f", "avx2", "sse4_2"} & flags:
        pytest.skip("not an x86 CPU")
    assert has_native_bf16() == bool({"avx512_bf16", "amx_bf16"} & flags)
