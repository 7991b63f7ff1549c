"""Triton kernels for the engine's hot ops, each beside a plain-torch reference of the same
signature.

- `mla_decode`: MLA (absorbed form) decode attention over the paged latent KV cache.
- `moe`: routed-expert SwiGLU MLPs as a grouped GEMM over rows sorted by expert, and `fused_moe`.
- `v4_indexer`: DeepSeek-V4's Lightning Indexer: scores of a query's visible compressed entries
  (`indexer_scores_*`) and their top-k (`indexer_topk`).
- `v4_sparse_attention`: DeepSeek-V4 attention of a query over its window and its compressed
  entries, with per-head sinks, read through the paged pools' slots (`v4_attention`).
- `v4_compressor`: DeepSeek-V4's compressor pooling (`compressor_pool`): the compression windows
  that close in a step, gated-softmax pooled and normed into one entry each (CSA and HCA).
- `v4_mhc`: DeepSeek-V4's hyper-connections: `mhc_collapse` (pre/post/comb weights with the
  Sinkhorn steps, and the streams' collapse into the block input) and `mhc_expand`.

Rule: Triton on CUDA, torch reference on CPU. The dispatchers (`mla_decode_attention`,
`grouped_expert_mlp`, `fused_moe`, `indexer_topk`, `v4_attention`, `compressor_pool`,
`mhc_collapse`, `mhc_expand`) take `use_triton: bool | None`; None picks Triton exactly when
the tensors are on CUDA and Triton is importable (`HAS_TRITON`), or inside `force_triton()`
(`uses_triton`). Without Triton installed the references still work. On CPU the Triton kernels run
only under the Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported), which
is how the tests check them. The V4 kernels are checked against the engine's own modules and on a
GPU (`scripts/gpu_check.py`); the V4 engine calls them on CUDA (`uses_triton`).
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
from .v4_compressor import compressor_pool, compressor_pool_ref, compressor_pool_triton
from .v4_indexer import (
    indexer_scores_ref,
    indexer_scores_triton,
    indexer_topk,
    indexer_topk_ref,
    indexer_topk_triton,
)
from .v4_mhc import (
    mhc_collapse,
    mhc_collapse_ref,
    mhc_collapse_triton,
    mhc_expand,
    mhc_expand_ref,
    mhc_expand_triton,
)
from .v4_sparse_attention import v4_attention, v4_attention_ref, v4_attention_triton

__all__ = [
    "HAS_TRITON",
    "compressor_pool",
    "compressor_pool_ref",
    "compressor_pool_triton",
    "force_triton",
    "fused_moe",
    "grouped_expert_mlp",
    "grouped_expert_mlp_ref",
    "grouped_expert_mlp_triton",
    "indexer_scores_ref",
    "indexer_scores_triton",
    "indexer_topk",
    "indexer_topk_ref",
    "indexer_topk_triton",
    "mla_decode_attention",
    "mla_decode_attention_ref",
    "mla_decode_attention_triton",
    "mhc_collapse",
    "mhc_collapse_ref",
    "mhc_collapse_triton",
    "mhc_expand",
    "mhc_expand_ref",
    "mhc_expand_triton",
    "uses_triton",
    "v4_attention",
    "v4_attention_ref",
    "v4_attention_triton",
]
