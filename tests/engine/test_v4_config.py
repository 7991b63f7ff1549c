"""`V4Config` reads both spellings of a DeepSeek-V4 config.json the way transformers folds them:
its own (`layer_types`, `compress_rates`, `mlp_layer_types`, nested `rope_parameters`) and the
release's (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, a flat yarn block)."""

from __future__ import annotations

from typing import Any

import pytest

from pdmesh_engine.config import CheckpointError
from pdmesh_engine.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Config

RELEASE: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 1000,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "compress_ratios": [0, 4, 128, 4, 128, 0],
    "num_hash_layers": 2,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 4,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 64,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
}


def test_the_release_spelling_folds_as_transformers_folds_it() -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.DeepseekV4Config(
        **{k: v for k, v in RELEASE.items() if k != "architectures"}
    )
    ours = V4Config.from_dict(RELEASE)
    assert list(ours.layer_types) == theirs.layer_types == [SLIDING, CSA, HCA, CSA, HCA, SLIDING]
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.mlp_layer_types[:2] == ("hash_moe", "hash_moe")
    assert ours.qk_rope_head_dim == theirs.qk_rope_head_dim == 8
    compress = theirs.rope_parameters["compress"]
    assert ours.compress_rope_theta == compress["rope_theta"]
    assert ours.compress_rope_scaling is not None
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        assert ours.compress_rope_scaling[key] == compress[key]
    assert ours.compress_rope_scaling["attention_factor"] == 1.0 == compress["attention_factor"]
    assert theirs.rope_parameters["main"]["rope_type"] == "default"
    assert ours.main_rope.rope_type == "default"


def test_transformers_spelling_round_trips() -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.DeepseekV4Config(
        **{k: v for k, v in RELEASE.items() if k != "architectures"}
    )
    assert V4Config.from_dict(theirs.to_dict()) == V4Config.from_dict(RELEASE)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"compress_ratios": [0, 4, 64, 4, 128, 0]}, "compress ratio"),
        ({"layer_types": [SLIDING] * 5}, "layer_types has 5 entries"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"head_dim": None}, "missing 'head_dim'"),
        ({"o_groups": 3}, "o_groups"),
    ],
)
def test_bad_configs_name_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        V4Config.from_dict({**RELEASE, **change})


def test_rates_and_window_span() -> None:
    config = V4Config.from_dict(RELEASE)
    assert config.rate(CSA) == 4 and config.rate(HCA) == 128 and config.rate(SLIDING) == 0
    assert config.window_span == 127  # HCA's open window outreaches the 63 of the window
