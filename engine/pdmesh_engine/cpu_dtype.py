"""What `--dtype auto` means on a CPU: bf16 weights only where they pay.

bf16 weights (and KV) with fp32 accumulation halve the bytes a decode step reads, and CPUs with
native bf16 dot products (AVX512-BF16, AMX-BF16) run bf16 matmuls faster than fp32 once the weights
no longer fit the CPU caches; for small weights the bf16 path's fixed costs win and one user's step
gets slower. Measured on a busy 2-core AMD EPYC (Zen 4: AVX512-BF16, no AMX) VM, one thread, with
the decode linears of one forward (attention projections and shared experts of every layer, lm head;
each dim capped at 4096) of models scaled from the small default model, bf16 time / fp32 time:

    hidden size     1 token       32 tokens
    512             2.26          0.65
    1024            1.28          0.48
    2048            1.46          0.36
    4096            0.70          0.37

The whole decode forward of the small default model (hidden size 512, `pdmesh bench forward`,
context 384, 2 threads, one run each) moved little: 20.2 -> 17.0 ms at 1 decode, 60.0 -> 58.2 ms at
32 (bf16 gains on the linears, loses on conversions and on the fp32 attention over a bf16 cache).

So `auto_cpu_dtype` picks bf16 only on CPUs with native bf16 and for models of hidden size
`BF16_MIN_HIDDEN` or more, where bf16 is clearly faster for one user and for a full batch alike;
otherwise fp32 (which also keeps the small models, and the tests, exact against `transformers`).

The CPU layer path (`model.deepseek_v3.cpu_path`) has since made bf16 pay on any x86 CPU with AVX2
for the batches it runs: it reads bf16 weights and cache and computes in fp32 (`--dtype bfloat16`;
on the 157M `small` preset, 2 threads, `bench engine` decode tokens/s in bf16 against fp32: 135
against 109 at one user, 497 against 405 at 32). `auto` still keeps fp32 there: without bf16
instructions torch's bf16 GEMMs run ~30x slower than its fp32 ones, and the paths the C one does not
cover (DEP ranks) would take them. The choice is a function of the CPU's features and the model
config, never of a timing taken at start-up, so the processes of one deployment on like machines
agree (prefill and decode exchange KV in that dtype, DEP ranks exchange hidden states). AMX machines
follow the same rule (not measured here).
"""

from __future__ import annotations

import torch

from pdmesh_engine.config import ModelConfig

BF16_MIN_HIDDEN = 4096  # smallest hidden size whose decode linears ran faster in bf16 at 1 token


def has_native_bf16() -> bool:
    """True when this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def auto_cpu_dtype(config: ModelConfig, native_bf16: bool | None = None) -> torch.dtype:
    """`--dtype auto` on CPU: bf16 when the CPU has native bf16 (`native_bf16`; None: this CPU's,
    `has_native_bf16`) and the model is wide enough for bf16 to be faster, else fp32."""
    if native_bf16 is None:
        native_bf16 = has_native_bf16()
    if native_bf16 and config.hidden_size >= BF16_MIN_HIDDEN:
        return torch.bfloat16
    return torch.float32
