"""DeepSeek-V4 tensor names: the three layouts a checkpoint may use, mapped to the model's.

- the release's: `embed.weight`, `head.weight`, `norm.weight`, `hc_head_fn`,
  `layers.N.attn.wq_a.weight`, `layers.N.hc_attn_fn`, `layers.N.ffn.gate.bias`,
  `layers.N.ffn.experts.E.w1.weight`, `mtp.*` ...;
- transformers' default `save_pretrained`: the same names under `model.` (except
  `model.embed_tokens.weight` and `model.hc_head.hc_fn`, which keep transformers' names);
- transformers' `save_original_format=False`: its module names (`self_attn.q_a_proj`,
  `mlp.experts.gate_up_proj` fused [E, 2I, D], `attn_hc.fn`, ...).

The model's own names are the release's, with the hyper-connection tensors as submodules
(`hc_attn.fn`, `hc_head.fn`) and the attention's K=V norm as `attn.norm`. The MTP layer keeps the
release's `mtp.K.*` names in every layout (transformers does not hold it; its saves keep the
tensors as the release names them), mapped the same way (`mtp.0.hc_head.fn`, `mtp.0.attn.norm`).
"""

from __future__ import annotations

import re

# transformers' module names -> the release's (applied in order, each once)
_FROM_TRANSFORMERS = [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.kv_norm\.", ".norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
]
_TRANSFORMERS_ONLY = re.compile(
    r"(\.self_attn\.|\.mlp\.|^embed_tokens\.|^lm_head\.|^hc_head\.hc_|_layernorm\.|_hc\.)"
)
_MODEL_NAMES = [  # the release's name -> the model's parameter
    (re.compile(r"(^|\.)hc_head_(fn|base|scale)$"), r"\1hc_head.\2"),
    (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".hc_\1.\2"),
    # the attention's K=V norm: `attn.kv_norm` in the release (llama.cpp's converter reads that
    # name), `attn.norm` in transformers' default save layout (its reverse rename)
    (re.compile(r"\.attn\.kv_norm\.weight$"), ".attn.norm.weight"),
]
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_FUSED = re.compile(r"^(layers\.\d+\.ffn)\.experts\.(gate_up_proj|down_proj)$")
_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def release_name(name: str) -> str:
    """Any of the three layouts' name -> the release's name."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if _TRANSFORMERS_ONLY.search(name):
        for pattern, repl in _FROM_TRANSFORMERS:
            name = re.sub(pattern, repl, name)
    return name


def canonical(name: str) -> str:
    """The model's parameter name for a checkpoint tensor (`mtp.*` included: the model skips the
    MTP layers it does not hold)."""
    name = release_name(name)
    for pattern, repl in _MODEL_NAMES:
        name = pattern.sub(repl, name)
    return name


def expert_part(name: str) -> tuple[str, int, str] | None:
    """(the MoE module's name, expert, part) for a routed expert's tensor: part is gate_proj /
    up_proj / down_proj of one expert, or w13 / w2_all for transformers' fused tensors."""
    m = _EXPERT.match(name)
    if m:
        return m.group(1), int(m.group(2)), _PART[m.group(3)]
    m = _FUSED.match(name)
    if m:
        return m.group(1), -1, "w13" if m.group(2) == "gate_up_proj" else "w2_all"
    return None
