"""`pdmesh model init --expert-skew`: the engine, routing as ever, sees Zipf-law expert popularity.

A tiny checkpoint with skew 1.2 and one with 0 (same seed) run the same held-out English prompts
(the skew is fitted on standard-library docstrings) greedily on CPU; the engine's expert-load ring
gives each MoE layer's tokens per expert. Measured (478 prompt tokens, E = 8): skewed, the hottest
expert takes 3.1-3.3x the uniform share and the sorted shares' log-log slopes are 1.10-1.32 (mean
1.21); unskewed, 1.6-2.4x and 0.57-1.31 (mean 0.83).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdmesh.cli.main import build_parser
from pdmesh.tools.expert_skew import expert_ranking, zipf_frequencies
from pdmesh.tools.model_init import init_model

ZIPF_S = 1.2
HOT_FACTOR = 2.8  # hottest expert's share / (1/E): skewed layers reach it, unskewed do not
SLOPE_TOLERANCE = 0.2  # |mean fitted exponent - ZIPF_S|; the unskewed model misses by ~0.4
PROMPTS = [
    "Return the number of items in the container, raising an error when it is closed.",
    "The quick brown fox jumps over the lazy dog while the server restarts its workers.",
    "Open the file at path and read its contents as text, decoding with the given encoding.",
    "Compute the greatest common divisor of two integers using the Euclidean algorithm.",
    "Create a new thread that runs the target function with the given arguments.",
    "Split the string at each separator and return a list of the pieces, dropping empty ones.",
    "A small town by the river holds a market every Saturday morning, selling bread and fish.",
    "Send the request to the remote host and wait for the reply, retrying twice on a timeout.",
    "She wrote the letter slowly, choosing each word as if it might be the last one she sent.",
    "Sort the records by date, newest first, and keep only those that belong to this account.",
    "Parse the configuration file and report every unknown key with its line number.",
    "The committee met on Tuesday to discuss the budget for the coming year and the new roof.",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[float, Path]:
    root = tmp_path_factory.mktemp("skew")
    return {
        s: init_model(root / f"skew-{s}", "tiny", seed=0, expert_skew=s, verbose=False)
        for s in (0.0, ZIPF_S)
    }


def _expert_shares(model_dir: Path) -> torch.Tensor:
    """[MoE layers, E]: each expert's share of the routed picks over the prompts (greedy, CPU)."""
    from pdmesh_engine.llm import LLM
    from pdmesh_engine.sampling import SamplingParams

    llm = LLM(model_dir, device="cpu")
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
    totals = llm.engine.runner.expert_load.window_totals().double()  # [L, P]; P = E here
    return totals / totals.sum(1, keepdim=True)


def _zipf_exponent(shares: torch.Tensor) -> torch.Tensor:
    """[L]: minus the least-squares slope of log(sorted share) against log(rank)."""
    num_experts = shares.shape[1]
    x = torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64))
    y = torch.log(shares.sort(dim=1, descending=True).values.clamp(min=1e-6))
    xc = x - x.mean()
    return -((y - y.mean(1, keepdim=True)) * xc).sum(1) / (xc * xc).sum()


def test_skew_shows_in_the_engine_expert_load(models: dict[float, Path]) -> None:
    skewed, flat = _expert_shares(models[ZIPF_S]), _expert_shares(models[0.0])
    num_experts = skewed.shape[1]
    assert skewed.shape[0] == 3
    hot_skewed, hot_flat = skewed.max(1).values * num_experts, flat.max(1).values * num_experts
    assert (hot_skewed >= HOT_FACTOR).all(), hot_skewed
    assert (hot_flat < HOT_FACTOR).all(), hot_flat
    assert len(set(skewed.argmax(1).tolist())) >= 2  # layers rank experts differently
    exponent = _zipf_exponent(skewed)
    assert abs(float(exponent.mean()) - ZIPF_S) <= SLOPE_TOLERANCE, exponent
    assert ((exponent - ZIPF_S).abs() <= 0.3).all(), exponent
    assert abs(float(_zipf_exponent(flat).mean()) - ZIPF_S) > SLOPE_TOLERANCE


def test_only_the_router_biases_change(models: dict[float, Path], tmp_path: Path) -> None:
    skewed = load_file(str(models[ZIPF_S] / "model.safetensors"))
    flat = load_file(str(models[0.0] / "model.safetensors"))
    assert skewed.keys() == flat.keys()
    biases = {k for k in flat if k.endswith(".mlp.gate.e_score_correction_bias")}
    assert len(biases) == 4  # 3 MoE layers + the MTP layer
    assert all(torch.equal(skewed[k], flat[k]) for k in flat if k not in biases)
    assert all(not torch.equal(skewed[k], flat[k]) for k in biases)
    assert all(skewed[k].dtype == torch.float32 for k in biases)
    assert json.loads((models[ZIPF_S] / "pdmesh_init.json").read_text())["expert_skew"] == ZIPF_S
    assert "expert_skew" not in json.loads((models[0.0] / "pdmesh_init.json").read_text())
    default = init_model(tmp_path / "default", "tiny", seed=0, verbose=False)  # no expert_skew
    for name in ("model.safetensors", "config.json", "pdmesh_init.json"):
        assert (default / name).read_bytes() == (models[0.0] / name).read_bytes()


def test_skewed_checkpoint_loads_in_transformers(models: dict[float, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(models[ZIPF_S]), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]


def test_targets_and_rankings() -> None:
    freq = zipf_frequencies(64, 4, ZIPF_S)
    assert float(freq.sum()) == pytest.approx(4.0) and float(freq.max()) <= 0.97
    assert bool((freq[:-1] >= freq[1:]).all())
    tail = torch.log(freq[8:])  # uncapped ranks follow r^-s exactly
    assert float(tail[-1] - tail[0]) == pytest.approx(-ZIPF_S * math.log(64 / 9))
    a, b = expert_ranking(0, 1, 8, 2), expert_ranking(0, 2, 8, 2)
    assert sorted(a.tolist()) == list(range(8)) and not torch.equal(a, b)
    assert torch.equal(a, expert_ranking(0, 1, 8, 2))
    assert not torch.equal(a, expert_ranking(1, 1, 8, 2))
    assert len({int(e) // 4 for e in a[:4]}) == 1  # the hottest ranks share a router group
    with pytest.raises(ValueError, match="expert_skew"):
        init_model(Path("unused"), "tiny", expert_skew=-1.0)


def test_cli_flag() -> None:
    args = build_parser().parse_args(["model", "init", "out", "--expert-skew", "1.5"])
    assert args.expert_skew == 1.5
    assert build_parser().parse_args(["model", "init", "out"]).expert_skew == 0.0
