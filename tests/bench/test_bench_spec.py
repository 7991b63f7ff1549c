"""`pdmesh bench engine --num-speculative-tokens`: speculation off and on side by side, on prompts
cut from the held-out standard-library sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdmesh.cli.main import main
from pdmesh_bench.spec import cut_prompts, parse_k_list

ROW_KEYS = (
    "concurrency",
    "num_speculative_tokens",
    "speculative_method",
    "engine_tokens_per_s",
    "acceptance_rate",
    "mean_accepted_length",
)


def _bench(model: Path, out: Path, *extra: str) -> dict:
    argv = ["bench", "engine", "--model", str(model), "--quick", "--torch-threads", "1"]
    argv += ["--concurrency", "1,3", "--output-len", "12", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_self_draft_accepts_everything_and_matches_k0(tiny_model: Path, tmp_path: Path) -> None:
    """The target as its own draft model: every draft is accepted, outputs equal K=0's."""
    report = _bench(
        tiny_model,
        tmp_path / "self.json",
        "--num-speculative-tokens",
        "0,2",
        "--speculative-method",
        "draft_model",
        "--draft-model",
        str(tiny_model),
    )
    rows = report["results"]
    assert [(r["concurrency"], r["num_speculative_tokens"]) for r in rows] == [
        (1, 0),
        (1, 2),
        (3, 0),
        (3, 2),
    ]
    for r in rows:
        assert all(key in r for key in ROW_KEYS)
        assert r["outputs_match_k0"] == r["concurrency"]
        if r["num_speculative_tokens"] == 0:
            assert r["speculative_method"] is None and r["acceptance_rate"] is None
            assert r["mean_accepted_length"] == 1.0 and r["speedup_vs_k0"] == 1.0
        else:
            assert r["speculative_method"] == "draft_model" and r["acceptance_rate"] == 1.0
            assert r["acceptance_per_position"] == [1.0, 1.0]
            assert r["mean_accepted_length"] > 2.0  # 3 per step but the last may be cut short
            assert r["steps"] < 12  # fewer steps than tokens


def test_mtp_on_a_random_model_accepts_little_but_matches(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    report = _bench(tiny_model, tmp_path / "mtp.json", "--num-speculative-tokens", "0,1")
    assert report["speculative_method"] == "mtp"
    spec = [r for r in report["results"] if r["num_speculative_tokens"] == 1]
    assert all(r["outputs_match_k0"] == r["concurrency"] for r in spec)
    assert all(0.0 <= r["acceptance_rate"] < 0.5 for r in spec)
    assert "speculative decoding (mtp) against K=0" in capsys.readouterr().out


def test_k_list_needs_the_baseline() -> None:
    assert parse_k_list(None) == [0, 1, 2, 3]
    assert parse_k_list("0,3") == [0, 3]
    for bad in ("1,2", "0,0", "0,-1", "x"):
        with pytest.raises(ValueError):
            parse_k_list(bad)


def test_prompts_are_seeded_windows() -> None:
    stream = torch.arange(1000)
    a = cut_prompts(stream, 3, 50, seed=4)
    assert a == cut_prompts(stream, 3, 50, seed=4) != cut_prompts(stream, 3, 50, seed=5)
    assert all(len(p) == 50 and p == list(range(p[0], p[0] + 50)) for p in a)
