"""`pdmesh model init --arch deepseek_v4 --expert-skew`: V3's Zipf-law expert popularity in both
kinds of V4 MoE layer, the hash layers' frozen tables and the top-k layers' router biases.

A tiny V4 with skew 1.2 and one with 0 (same seed) prefill random token ids greedily on CPU; the
engine's expert-load ring gives each layer's tokens per expert. Measured (16 prompts of 32 random
ids, 4 tokens decoded, E = 8, top-2): skewed, the hottest expert takes 3.2-3.5x the uniform share
in every layer (the target 3.44x: 0.86 of the tokens pick it, of 2 picks each); unskewed,
1.1-2.0x.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdmesh.tools.expert_skew import expert_ranking, zipf_frequencies
from pdmesh.tools.model_init import init_model

ZIPF_S = 1.2
HOT_FACTOR = 2.8  # hottest expert's share / (1/E): skewed layers reach it, unskewed do not


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[float, Path]:
    root = tmp_path_factory.mktemp("skew-v4")
    return {
        s: init_model(
            root / f"skew-{s}", "tiny", seed=0, arch="deepseek_v4", expert_skew=s, verbose=False
        )
        for s in (0.0, ZIPF_S)
    }


def _expert_shares(model_dir: Path) -> torch.Tensor:
    """[layers, E]: each expert's share of the routed picks over random token ids (greedy, CPU)."""
    from pdmesh_engine.llm import LLM
    from pdmesh_engine.sampling import SamplingParams

    llm = LLM(model_dir, device="cpu")
    gen = torch.Generator().manual_seed(1)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        {"prompt_ids": torch.randint(3, vocab, (32,), generator=gen).tolist()} for _ in range(16)
    ]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    totals = llm.engine.runner.expert_load.window_totals().double()  # [L, P]; P = E here
    return totals / totals.sum(1, keepdim=True)


def test_skew_shows_in_hash_and_topk_layers(models: dict[float, Path]) -> None:
    skewed, flat = _expert_shares(models[ZIPF_S]), _expert_shares(models[0.0])
    num_experts = skewed.shape[1]
    assert skewed.shape[0] == 4  # layer 0 routes by hash, layers 1-3 by top-k
    hot_skewed, hot_flat = skewed.max(1).values * num_experts, flat.max(1).values * num_experts
    assert (hot_skewed >= HOT_FACTOR).all(), hot_skewed
    assert (hot_flat < HOT_FACTOR).all(), hot_flat
    assert len(set(skewed.argmax(1).tolist())) >= 2  # layers rank experts differently


def test_the_hash_table_gives_each_expert_its_target_share_of_token_ids(
    models: dict[float, Path],
) -> None:
    table = load_file(str(models[ZIPF_S] / "model.safetensors"))["model.layers.0.ffn.gate.tid2eid"]
    vocab, top_k = table.shape
    assert (table.sort(1).values.diff(dim=1) > 0).all()  # distinct experts per token
    target = torch.empty(8, dtype=torch.float64)
    target[expert_ranking(0, 0, 8, 1)] = zipf_frequencies(8, top_k, ZIPF_S)
    counts = torch.bincount(table.flatten(), minlength=8)
    assert (counts - target * vocab).abs().max() < 1, (counts, target * vocab)


def test_only_hash_tables_and_router_biases_change(models: dict[float, Path]) -> None:
    skewed = load_file(str(models[ZIPF_S] / "model.safetensors"))
    flat = load_file(str(models[0.0] / "model.safetensors"))
    assert skewed.keys() == flat.keys()
    routing = {k for k in flat if k.endswith((".ffn.gate.tid2eid", ".ffn.gate.bias"))}
    assert len(routing) == 4
    assert all(torch.equal(skewed[k], flat[k]) for k in flat if k not in routing)
    assert all(not torch.equal(skewed[k], flat[k]) for k in routing)
    assert all(skewed[k].dtype == flat[k].dtype for k in routing)
    assert json.loads((models[ZIPF_S] / "pdmesh_init.json").read_text())["expert_skew"] == ZIPF_S
    assert "expert_skew" not in json.loads((models[0.0] / "pdmesh_init.json").read_text())


def test_the_official_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="hf format only"):
        init_model(Path("unused"), "tiny", arch="deepseek_v4", format="official", expert_skew=1.0)
