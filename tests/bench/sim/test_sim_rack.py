"""The GB300 / DeepSeek-V4-Flash example cost file and `pdmesh bench rack`: every figure of the file
says where it comes from, and a quick projection keeps the directions the followed system saw."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdmesh_bench.serve import Result
from pdmesh_bench.sim.costs import load_costs
from pdmesh_bench.sim.rack import (
    BalanceOptions,
    RackOptions,
    decode_jobs,
    main,
    measure_balancedness,
    steady,
)

EXAMPLE = (
    Path(__file__).resolve().parents[3] / "bench/pdmesh_bench/sim/examples/gb300-v4-flash.json"
)
LOADS = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "expert_load"
KINDS = ("STATED", "DERIVED", "ASSUMED", "MEASURED")


def figures(node: Any, path: str = "") -> Iterator[str]:
    """Dotted paths of the numbers in a cost file (a `steps` entry named by its DEP size), the
    notes and the published comparisons left out."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not path and key in ("version", "notes", "published"):
                continue
            yield from figures(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list) and path == "steps":
        for entry in node:
            yield from figures(entry, f"steps.dep{entry['dep']}")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield path
    elif isinstance(node, list):
        for value in node:
            yield from figures(value, path)


def test_the_example_loads_and_every_figure_says_where_it_comes_from() -> None:
    costs = load_costs(EXAMPLE)
    assert costs.cores is None and costs.block_size == 256
    assert {c.dep for c in costs.curves} == {1, 2, 4, 8, 16, 32}
    assert all(costs.balance(d, True) > costs.balance(d, False) for d in (2, 4, 8, 16, 32))
    data = json.loads(EXAMPLE.read_text())
    notes = data["notes"]
    paths = sorted(set(figures(data)))
    assert "steps.dep32.seconds" in paths and "moe.balancedness.eplb.32" in paths
    for path in paths:
        generic = re.sub(r"\.dep\d+", "", path)  # a note for every steps entry's field
        covering = [k for k in notes if k in (path, generic) or path.startswith(k + ".")]
        assert covering, f"{path} has no note"
        note = notes[max(covering, key=len)]
        assert any(kind in note for kind in KINDS), (path, note)
        if note.startswith("STATED"):  # a source: a URL, or the design notes' reference figures
            assert "http" in note or "DESIGN.md" in note, (path, note)
    for ref in data["published"]:
        assert ref["value"] > 0 and ("http" in ref["source"] or "DESIGN.md" in ref["source"])
        assert ref["why"] and ref["key"] and ref["label"]


def test_decode_prompts_share_a_prefix_and_differ_in_their_last_block() -> None:
    o = RackOptions(context=600, output_len=10)
    jobs = decode_jobs(1200, o, 256)
    assert all(len(j.prompt) == 600 for j in jobs)
    assert len({tuple(j.prompt[:344]) for j in jobs}) == 1
    assert len({tuple(j.prompt[344:]) for j in jobs}) == 1200
    assert {j.max_tokens for j in jobs} <= set(range(5, 16)) and len(
        {j.max_tokens for j in jobs}
    ) > 5


def test_the_steady_window_runs_from_a_full_batch_to_the_last_send() -> None:
    def result(start: float, times: list[float]) -> Result:
        return Result(0, start, ok=True, token_times=times, output_tokens=len(times))

    # 2 ranks x batch 1: the second first token (t=2) opens the window, the last send (t=6) ends it
    results = [
        result(0.0, [1.0, 2.0, 3.0, 4.0]),
        result(0.0, [2.0, 3.0, 4.0, 5.0]),
        result(6.0, [7.0, 8.0]),
    ]
    window = steady(results, 2, RackOptions(batch=1))
    assert window["window_s"] == [2.0, 6.0]
    assert window["output_tokens_per_s_per_gpu"] == pytest.approx(7 / 4 / 2)  # 2,3,4 + 2,3,4,5
    assert window["itl_ms_p50"] == pytest.approx(1000.0)


def test_eplb_balances_a_skewed_load_better_than_the_identity_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    skew = rng.pareto(1.2, size=(4, 64)) + 0.05
    skew[0] = 0.0  # a dense layer
    path = tmp_path / "loads.json"
    path.write_text(json.dumps({"logical_count": (skew * 1000).tolist()}))
    got = measure_balancedness(BalanceOptions(deps=(2, 4, 8), redundant=8, files=[str(path)]))
    for dep in ("2", "4", "8"):
        assert 0 < got["none"][dep] < got["eplb"][dep] <= 1
    assert got["none"]["8"] < got["none"]["2"]  # more ranks, a hotter hottest rank


@pytest.mark.skipif(not LOADS.is_dir(), reason="the shared expert-load data is not here")
def test_the_example_balancedness_is_what_the_planner_measures_on_the_v3_loads() -> None:
    files = sorted(str(p) for p in LOADS.glob("decode_*.json"))
    got = measure_balancedness(BalanceOptions(files=files))
    written = json.loads(EXAMPLE.read_text())["moe"]["balancedness"]
    for kind in ("eplb", "none"):  # a planner change that moves these: regenerate the file
        assert got[kind] == pytest.approx(written[kind], abs=0.01)


def test_a_quick_projection_keeps_the_published_directions(tmp_path: Path) -> None:
    out, png = tmp_path / "rack.json", tmp_path / "rack.png"
    assert main(["--costs", str(EXAMPLE), "--quick", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    prefill = {p["dep"]: p for p in report["prefill"]}
    for dep in (2, 4):
        assert prefill[dep]["num_errors"] == 0
        assert (
            prefill[dep]["lag_tokens_per_s_per_gpu"] <= prefill[dep]["mirror_tokens_per_s_per_gpu"]
        )
    assert prefill[4]["imbalance_cost"] > prefill[2]["imbalance_cost"] > 0
    decode = {(d["dep"], d["eplb"]): d for d in report["decode"]}
    for dep in (4, 8, 16, 32):
        on, off = decode[dep, True], decode[dep, False]
        assert on["num_errors"] == off["num_errors"] == 0
        assert on["output_tokens_per_s_per_gpu"] >= off["output_tokens_per_s_per_gpu"] > 0
    keys = {row["key"] for row in report["rows"]}
    assert {"prefill_lag.2", "prefill_lag.4", "imbalance.2", "imbalance.4"} <= keys
    assert all(row["ratio"] == pytest.approx(row["sim"] / row["value"]) for row in report["rows"])
    assert png.stat().st_size > 10_000
