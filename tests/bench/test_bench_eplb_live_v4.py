"""`pdmesh bench eplb --dep 2 --model TINY_SKEWED_V4`: the live mode on DeepSeek-V4 (synthetic KV
in both of its KV groups, a hash layer and top-k layers rebalanced alike, real rank processes and
the real engine's staging and switch).

Measured (skew 1.2, the settings below): balancedness off 0.75, on from the first switch 0.85,
uniform routing 0.86; the hash layer 0.79 -> 0.86 over the same steps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdmesh.cli.main import main
from pdmesh.tools.model_init import init_model

STEPS = 9
INTERVAL = 3
NUM_MOE_LAYERS = 4  # tiny V4: every layer, the first a hash layer


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("bench_eplb_live_v4")
    model_dir = init_model(
        root / "tiny_v4_skew",
        preset="tiny",
        seed=0,
        arch="deepseek_v4",
        expert_skew=1.2,
        verbose=False,
    )
    out = root / "live.json"
    # move budget 0.5: 8 experts + 2 redundant slots; the default 20% allows only 2 slots a layer
    args = [
        *("bench", "eplb", "--dep", "2", "--model", str(model_dir)),
        *("--steps", str(STEPS), "--warmup", "1"),
        *("--interval", str(INTERVAL), "--window", str(INTERVAL)),
        *("--requests-per-rank", "4", "--context", "16"),
        *("--num-redundant-experts", "2", "--move-budget", "0.5"),
        *("--threads-per-rank", "1", "--json", str(out)),
    ]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_v4_rebalances_every_layer_and_keeps_outputs(report: dict) -> None:
    for name, phase in report["phases"].items():
        assert len(phase["balancedness_per_step"]) == STEPS, name
        assert all(len(row) == NUM_MOE_LAYERS for row in phase["balancedness_per_layer"]), name
    done = [r for r in report["rebalances"] if r["accepted"] and r["switched_at_step"] is not None]
    assert done, report["rebalances"]
    assert done[0]["moved_slots"] > 0
    assert done[0]["window_balancedness_planned"] > done[0]["window_balancedness_before"]
    assert report["final_placement_version"] == [done[-1]["version"]] * 2
    assert report["outputs_identical"] is True


def test_v4_balancedness_with_eplb_beats_before(report: dict) -> None:
    first = report["rebalances"][0]["switched_at_step"]
    off = np.array(report["phases"]["off"]["balancedness_per_layer"], dtype=float)
    settled = report["on_settled"]["balancedness_mean"]
    assert settled > report["phases"]["off"]["balancedness_mean"] + 0.05
    assert report["gap_recovered"] > 0.5
    hash_on = np.array(report["phases"]["on"]["balancedness_per_layer"], dtype=float)[first:, 0]
    assert hash_on.mean() > off[first:, 0].mean()  # the hash layer is rebalanced too
