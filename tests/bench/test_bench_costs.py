"""`pdmesh bench costs`: the least-squares helpers, the host check, and a `--quick --no-mesh` run on
the tiny preset whose JSON has the version-1 shape the simulator reads."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from pdmesh.cli import bench_cmd
from pdmesh_bench import costs_host
from pdmesh_bench.costs_fit import (
    StepModel,
    attention_tokens,
    fit_line,
    fit_shared_slope,
    interp,
)
from pdmesh_bench.costs_parts import default_tokens
from pdmesh_bench.sim.costs import parse_costs

TOP_KEYS = {
    "version",
    "source",
    "notes",
    "model",
    "engine",
    "hardware",
    "steps",
    "allreduce_s",
    "kv_transfer",
    "overheads",
    "moe",
}


def test_fit_line_recovers_a_line_and_the_least_squares_one() -> None:
    xs = [0.0, 1.0, 2.0, 5.0]
    assert fit_line(xs, [3 + 2 * x for x in xs]) == pytest.approx((3.0, 2.0))
    # y = 0, 1, 1, 2 at x = 0..3: the normal equations give slope 0.6, intercept 0.1
    assert fit_line([0, 1, 2, 3], [0, 1, 1, 2]) == pytest.approx((0.1, 0.6))
    with pytest.raises(ValueError):
        fit_line([1.0, 1.0], [2.0, 3.0])
    with pytest.raises(ValueError):
        fit_line([1.0, 2.0], [2.0])


def test_fit_shared_slope_lets_each_group_keep_its_intercept() -> None:
    groups = {
        4: [(x, 0.010 + 1e-6 * x) for x in (100.0, 2000.0, 6000.0)],
        16: [(x, 0.030 + 1e-6 * x) for x in (400.0, 8000.0, 24000.0)],
    }
    assert fit_shared_slope(groups) == pytest.approx(1e-6)
    # one pooled line through both groups would be skewed by their intercepts
    pooled = [p for points in groups.values() for p in points]
    assert fit_line([x for x, _ in pooled], [y for _, y in pooled])[1] != pytest.approx(1e-6)
    # a single group is the ordinary slope; points with one x only carry no slope
    one = {0: [(0.0, 0.0), (1.0, 1.0), (2.0, 1.0), (3.0, 2.0)], 1: [(5.0, 9.0)]}
    assert fit_shared_slope(one) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        fit_shared_slope({0: [(1.0, 1.0), (1.0, 2.0)]})


def test_interp_is_piecewise_linear_and_extends_its_ends() -> None:
    xs, ys = [1, 2, 4], [10.0, 20.0, 30.0]
    assert interp(xs, ys, 1) == 10.0
    assert interp(xs, ys, 3) == pytest.approx(25.0)
    assert interp(xs, ys, 8) == pytest.approx(50.0)  # the last segment's slope, 5 per token
    assert interp(xs, ys, 0) == pytest.approx(0.0)  # the first segment's, 10 per token
    assert interp([7], [3.0], 100) == 3.0


def test_attention_tokens_and_the_step_model() -> None:
    assert attention_tokens(0, 4) == 1 + 2 + 3 + 4  # a 4-token prompt
    assert attention_tokens(31, 1) == 32  # one decode at context 31 (+ itself)
    model = StepModel([1, 2, 4], {1: [1.0, 2.0, 3.0]}, {1: 0.5})
    assert model.step_s(1, 3, 10) == pytest.approx(2.5 + 5.0)
    with pytest.raises(ValueError):
        model.step_s(2, 1, 0)
    assert default_tokens(2048) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert default_tokens(48) == [1, 2, 4, 8, 16, 32, 48]


def _finite_positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_bench_costs_quick_no_mesh(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "costs.json"
    options = ["--model", str(tiny_model), "--quick", "--no-mesh", "--max-num-seqs", "8"]
    args = argparse.Namespace(benchmark="costs", options=[*options, "--out", str(out)])
    assert bench_cmd.run(args) == 0
    report = json.loads(out.read_text())
    assert set(report) == TOP_KEYS
    assert report["version"] == 1
    assert report["source"] == "measured by pdmesh bench costs"
    assert all(isinstance(v, str) and v for v in report["notes"].values())
    assert {"steps", "attn_s_per_token_ctx", "kv_transfer", "moe", "host"} <= set(report["notes"])
    model = report["model"]
    assert model["name"] == "tiny"
    for key in ("block_size", "kv_bytes_per_token", "max_model_len", "num_kv_blocks"):
        assert _finite_positive(model[key]), key
    # the engine options reach the engine the steps were measured on
    assert report["engine"] == {"max_num_seqs": 8, "max_num_batched_tokens": 2048}
    cores = os.cpu_count() or 1
    assert report["hardware"] == {"kind": "cpu", "cores": cores, "corun_slowdown": 1.0}  # --quick

    steps = report["steps"]
    assert sorted(s["threads"] for s in steps) == sorted({1, cores, max(1, cores // 2)})
    for entry in steps:
        assert entry["dep"] == 1
        assert entry["tokens"] == [1, 4, 16, 128]
        assert len(entry["seconds"]) == len(entry["tokens"])
        assert all(_finite_positive(s) for s in entry["seconds"]), entry
        # the model gives back a 128-token prompt's step (its A added again) above one decode's
        attn = entry["attn_s_per_token_ctx"]
        assert attn >= 0
        assert entry["seconds"][-1] + attn * attention_tokens(0, 128) > entry["seconds"][0], entry

    assert set(report["allreduce_s"]) <= {"2"}
    assert all(_finite_positive(s) for s in report["allreduce_s"].values())
    assert report["kv_transfer"]["latency_s"] >= 0
    assert _finite_positive(report["kv_transfer"]["bytes_per_s"])
    assert report["overheads"] == {
        "request_s": 0.0,
        "handoff_s": 0.0,
        "token_s": {"0": 0.0},
        "sequence_s": {"0": 0.0},
    }
    assert "--no-mesh" in report["notes"]["overheads"]
    sim_costs = parse_costs(report)  # what `pdmesh sim` reads
    assert sim_costs.curve(1, 1).tokens == tuple(report["steps"][0]["tokens"])
    moe = report["moe"]
    assert 0.0 < moe["share"] <= 1.0
    assert set(moe["balancedness"]) == {"eplb", "none"}
    assert all(0.0 < b <= 1.0 for b in moe["balancedness"].values())
    assert "step seconds" in capsys.readouterr().out


def test_host_guard_repeats_a_contended_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    verdicts = iter([(0.5, True), (0.02, False), (0.6, True), (0.6, True)])
    monkeypatch.setattr(costs_host, "others_since", lambda before: next(verdicts))
    monkeypatch.setattr(costs_host, "wait_quiet", lambda max_wait_s: 1.0)
    said: list[str] = []
    guard = costs_host.HostGuard(said.append, tries=2, max_wait_s=5.0, budget_s=100.0)
    calls = iter(range(10))
    assert guard.guarded("first", lambda: next(calls)) == 1  # contended, then quiet
    assert guard.guarded("second", lambda: next(calls)) == 3  # contended twice: the last is kept
    assert (guard.num_repeated, guard.contended, guard.waited_s) == (2, ["second (60%)"], 4.0)
    assert guard.kept == [0.02, 0.6] and len(said) == 3
    assert "2 repeated" in guard.note() and "kept contended: second (60%)" in guard.note()
    # check only: one try, no waiting
    once = costs_host.HostGuard(said.append, tries=1)
    monkeypatch.setattr(costs_host, "others_since", lambda before: (0.9, True))
    assert once.guarded("third", lambda: "x") == "x"
    assert (once.num_repeated, len(once.contended), once.waited_s) == (0, 1, 0.0)
