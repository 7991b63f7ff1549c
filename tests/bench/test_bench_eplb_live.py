"""`pdmesh bench eplb --dep 2 --model TINY_SKEWED`: the live mode end to end (real rank
processes in a gloo group, the real engine's staging and switch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdmesh.cli.main import main
from pdmesh.tools.model_init import init_model

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 9
INTERVAL = 3
NUM_MOE_LAYERS = 3  # tiny preset: 4 layers, the first dense


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("bench_eplb_live")
    model_dir = init_model(
        root / "tiny_skew", preset="tiny", seed=0, expert_skew=1.2, verbose=False
    )
    out, plot = root / "live.json", root / "live.png"
    # move budget 0.5: 8 experts + 2 redundant slots; the default 20% allows only 2 slots a layer
    assert (
        main(
            [
                "bench",
                "eplb",
                "--dep",
                "2",
                "--model",
                str(model_dir),
                "--steps",
                str(STEPS),
                "--warmup",
                "1",
                "--interval",
                str(INTERVAL),
                "--window",
                str(INTERVAL),
                "--requests-per-rank",
                "4",
                "--context",
                "16",
                "--num-redundant-experts",
                "2",
                "--move-budget",
                "0.5",
                "--threads-per-rank",
                "1",
                "--json",
                str(out),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    return json.loads(out.read_text()), plot


def test_three_phases_with_per_step_balancedness(live: tuple[dict, Path]) -> None:
    report, _ = live
    assert set(report["phases"]) == {"off", "on", "uniform"}
    for name, phase in report["phases"].items():
        per_step = phase["balancedness_per_step"]
        assert len(per_step) == STEPS, name
        assert all(0.0 < b <= 1.0 for b in per_step), (name, per_step)
        assert all(len(row) == NUM_MOE_LAYERS for row in phase["balancedness_per_layer"]), name
        assert phase["balancedness_p10"] <= phase["balancedness_mean"] + 1e-12, name
    for name in ("off", "on"):
        phase = report["phases"][name]
        assert len(phase["step_ms"]) == STEPS
        assert phase["step_ms_p99"] >= phase["step_ms_p50"] > 0 and phase["tokens_per_s"] > 0
        assert [m["rank"] for m in phase["moe_per_rank"]] == [0, 1]
        assert all(m["expert_ms"] > 0 for m in phase["moe_per_rank"])
    off, on = report["phases"]["off"], report["phases"]["on"]
    first = report["rebalances"][0]["switched_at_step"]
    # the same seeded workload on the same placement: identical routing until the first switch
    assert off["balancedness_per_layer"][:first] == on["balancedness_per_layer"][:first]


def test_rebalances_switch_and_keep_outputs(live: tuple[dict, Path]) -> None:
    report, _ = live
    done = [r for r in report["rebalances"] if r["accepted"] and r["switched_at_step"] is not None]
    assert done, report["rebalances"]
    first = done[0]
    assert first["version"] == 1 and first["staged_before_step"] == INTERVAL
    assert first["staged_before_step"] <= first["switched_at_step"] < STEPS
    assert first["moved_slots"] > 0
    assert first["window_balancedness_planned"] >= first["window_balancedness_before"]
    assert first["step_ms_during"]
    assert max(first["step_ms_during"]) <= report["max_rebalance_step_ms"]
    assert report["final_placement_version"] == [done[-1]["version"]] * 2  # both ranks alike
    assert report["outputs_identical"] is True
    assert report["on_settled"] is not None and math.isfinite(report["gap_recovered_all_steps"])
    assert report["steady_step_ms_p99"] > 0 and report["rebalance_step_ratio"] > 0


def test_plot_is_a_png(live: tuple[dict, Path]) -> None:
    _, plot = live
    data = plot.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_live_mode_needs_dep_and_model_without_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "eplb", "--dep", "2"])
    assert exc.value.code == 2
    assert "--model" in capsys.readouterr().err
