"""Smoke test of `pdmesh bench decode --quick` on the tiny preset: DEP1 and DEP2 rank processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdmesh.cli.main import main
from pdmesh.tools.model_init import init_model

POSITIVE = (
    "step_ms_p50",
    "step_ms_p90",
    "step_ms_mean",
    "attention_ms",
    "expert_ms",
    "cpu_sched_ms",
    "other_model_ms",
    "tokens_per_s",
)
PARTS = ("attention_ms", "expert_ms", "dispatch_combine_ms", "dp_sync_ms", "cpu_sched_ms")
TOLERANCE_MS = 0.05


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("bench_decode") / "tiny", preset="tiny", verbose=False
    )


@pytest.fixture(scope="module")
def report(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench_decode_out") / "decode.json"
    assert (
        main(
            [
                "bench",
                "decode",
                "--model",
                str(model_dir),
                "--quick",
                "--dep",
                "1,2",
                "--threads-per-rank",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_schema_and_ranks(report: dict) -> None:
    assert [(r["dep"], r["rank"]) for r in report["results"]] == [(1, 0), (2, 0), (2, 1)]
    assert [i["dep"] for i in report["instances"]] == [1, 2]
    assert report["notes"] and all(isinstance(n, str) for n in report["notes"])
    for row in report["results"]:
        for key in (*POSITIVE, *PARTS, "host_ms"):
            assert _finite(row[key]), (key, row)
        for key in POSITIVE:
            assert row[key] > 0, (key, row)
        assert min(row["dispatch_combine_ms"], row["dp_sync_ms"], row["host_ms"]) >= 0, row
        assert row["step_ms_p90"] >= row["step_ms_p50"]
    for instance in report["instances"]:
        assert instance["tokens_per_s"] > 0 and instance["step_ms_p50"] > 0


def test_components_sum_to_at_most_the_step(report: dict) -> None:
    for row in report["results"]:
        parts = sum(row[key] for key in PARTS)
        assert parts <= row["step_ms_mean"] + TOLERANCE_MS, row
        assert parts == pytest.approx(row["step_ms_mean"], rel=1e-6)  # cpu_sched is the remainder
        assert row["other_model_ms"] + row["host_ms"] == pytest.approx(
            row["cpu_sched_ms"], rel=1e-6, abs=1e-9
        )


def test_dep2_reports_dispatch_and_sync_dep1_none(report: dict) -> None:
    dep1 = [r for r in report["results"] if r["dep"] == 1]
    dep2 = [r for r in report["results"] if r["dep"] == 2]
    assert all(r["dispatch_combine_ms"] == 0 and r["dp_sync_ms"] == 0 for r in dep1)
    assert all(r["dispatch_combine_ms"] > 0 and r["dp_sync_ms"] > 0 for r in dep2)
    instance = report["instances"][1]
    assert instance["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in dep2))


def test_rejects_dep_size_that_does_not_split_the_experts(
    model_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["bench", "decode", "--model", str(model_dir), "--quick", "--dep", "3"]) == 2
    assert "divide the 8 experts" in capsys.readouterr().err
