"""Smoke test of `pdmesh bench admission --quick` on the tiny preset: every cap gets the same
tokens, and a cap of 2 spreads the burst over more steps than no cap."""

from __future__ import annotations

import json
import math

import pytest

from pdmesh.cli.main import main
from pdmesh.tools.model_init import init_model
from pdmesh_bench.admission import parse_caps


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bench_admission")
    model_dir = init_model(tmp / "tiny", preset="tiny", verbose=False)
    out = tmp / "admission.json"
    argv = ["bench", "admission", "--model", str(model_dir), "--quick", "--device", "cpu"]
    assert main([*argv, "--torch-threads", "1", "--caps", "off,2", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_each_cap_has_a_row_with_the_same_tokens(report: dict) -> None:
    rows = report["results"]
    assert [r["cap"] for r in rows] == ["off", "2"]
    assert all(r["same_tokens"] for r in rows)
    for r in rows:
        assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"])
        assert 0 < r["itl_ms_p50"] <= r["itl_ms_p99"]
        assert 0 < r["wait_ms_p50"] <= r["wait_ms_p99"]


def test_the_cap_spreads_the_burst_over_more_steps(report: dict) -> None:
    off, capped = report["results"]
    requests = report["config"]["requests"]  # quick: 6 requests, max_tokens 4
    assert off["max_batch"] == requests
    assert off["steps"] == report["config"]["max_tokens"] - 1
    # 2 per step: the last pair joins at step 3 and needs max_tokens - 1 steps from there
    assert capped["steps"] == math.ceil(requests / 2) - 1 + report["config"]["max_tokens"] - 1


def test_caps_parse_off_and_numbers() -> None:
    assert parse_caps("off, 2,0,8") == [None, 2, None, 8]
    with pytest.raises(ValueError, match="--caps"):
        parse_caps("two")
