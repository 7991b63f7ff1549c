"""`pdmesh bench eplb` offline (both planners' numbers; ours moves fewer slots); `pdmesh eplb
plan`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pdmesh.cli.main import main

NUM_LAYERS, NUM_EXPERTS = 4, 32


def _write_loads(path: Path, zipf_s: float, seed: int) -> Path:
    """Zipf(zipf_s) expert loads [L, E], its own ranking per layer; layer 0 dense (all zeros)."""
    rng = np.random.default_rng(seed)
    zipf = np.arange(1, NUM_EXPERTS + 1) ** -zipf_s * 1e4
    loads = np.stack([rng.permutation(zipf) for _ in range(NUM_LAYERS)])
    loads[0] = 0.0
    path.write_text(json.dumps({"logical_count": loads.tolist()}))
    return path


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_bench_eplb_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = [
        _write_loads(tmp_path / "skew10.json", 1.0, 0),
        _write_loads(tmp_path / "skew14.json", 1.4, 1),
    ]
    out = tmp_path / "eplb.json"
    assert (
        main(
            [
                "bench",
                "eplb",
                "--loads",
                *map(str, files),
                "--ranks",
                "8",
                "--redundant",
                "8",
                "--steps",
                "3",
                "--top-k",
                "4",
                "--tokens",
                "512",
                "--step-samples",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    rows = report["results"]
    expected = [(f.name, p) for f in files for p in ("ours", "baseline")]
    assert [(r["loads"], r["planner"]) for r in rows] == expected
    for r in rows:
        for key in ("window_balancedness", "next_window_balancedness", "step_balancedness"):
            assert _finite(r[key]) and 0 < r[key] <= 1, (key, r)
        moved = r["moved_fraction_per_rebalance"]
        assert _finite(moved) and 0 <= moved <= 1
        assert _finite(r["plan_ms"]["scratch"]) and r["plan_ms"]["scratch"] > 0
    for ours, base in zip(rows[::2], rows[1::2], strict=True):
        assert ours["moved_fraction_per_rebalance"] < base["moved_fraction_per_rebalance"]
        assert ours["moved_fraction_per_rebalance"] <= 0.2 + 1e-9  # the default move budget
        assert ours["colocated_replicas"] == 0
        assert _finite(ours["plan_ms"]["rebalance_median"])
    assert len(report["simulation"]["results"]) == 2
    assert report["config"]["num_ranks"] == 8 and report["config"]["num_redundant"] == 8
    table = capsys.readouterr().out
    assert "from scratch" in table and "moved per rebalance" in table and "skew14.json" in table


@pytest.mark.parametrize("option", [["--dep", "2"], ["--model", "some/dir"]])
def test_bench_eplb_rejects_the_live_mode(
    tmp_path: Path, option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    loads = _write_loads(tmp_path / "w.json", 1.0, 0)
    with pytest.raises(SystemExit) as exc:
        main(["bench", "eplb", "--loads", str(loads), *option])
    assert exc.value.code == 2
    assert "live mode" in capsys.readouterr().err


def test_eplb_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loads = _write_loads(tmp_path / "w.json", 1.2, 3)
    out = tmp_path / "plan.json"
    layout = ["--ranks", "8", "--redundant", "8", "--out", str(out)]
    assert main(["eplb", "plan", "--loads", str(loads), *layout]) == 0
    plan = json.loads(out.read_text())
    p2l = np.asarray(plan["physical_to_logical"])
    assert plan["num_ranks"] == 8 and p2l.shape == (NUM_LAYERS, NUM_EXPERTS + 8)
    assert all(set(row.tolist()) == set(range(NUM_EXPERTS)) for row in p2l)  # no expert lost
    assert "balancedness" in capsys.readouterr().out
    assert main(["eplb", "plan", "--loads", str(tmp_path / "missing.json"), *layout]) == 2
