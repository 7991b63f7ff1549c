"""Triton kernels for the engine's hot ops, each beside a plain-torch reference of the same
signature.

- `mla_decode`: MLA (absorbed form) decode attention over the paged latent KV cache.
- `moe`: routed-expert SwiGLU MLPs as a grouped GEMM over rows sorted by expert, and `fused_moe`.

Rule: Triton on CUDA, torch reference on CPU. The dispatchers (`mla_decode_attention`,
`grouped_expert_mlp`, `fused_moe`) take `use_triton: bool | None`; None picks Triton exactly when
the tensors are on CUDA and Triton is importable (`HAS_TRITON`), or inside `force_triton()`
(`uses_triton`). Without Triton installed the references still work. On CPU the Triton kernels run
only under the Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported), which
is how the tests check them.
"""

from __future__ import annotations

from .mla_decode import (
    HAS_TRITON,
    force_triton,
    mla_decode_attention,
    mla_decode_attention_ref,
    mla_decode_attention_triton,
    uses_triton,
)
from .moe import fused_moe, grouped_expert_mlp, grouped_expert_mlp_ref, grouped_expert_mlp_triton

__all__ = [
    "HAS_TRITON",
    "force_triton",
    "fused_moe",
    "grouped_expert_mlp",
    "grouped_expert_mlp_ref",
    "grouped_expert_mlp_triton",
    "mla_decode_attention",
    "mla_decode_attention_ref",
    "mla_decode_attention_triton",
    "uses_triton",
]
