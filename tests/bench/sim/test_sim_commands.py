"""`pdmesh sim`, `pdmesh plan`, `pdmesh bench simcheck --sim-only` and the simulated admission
burst, through their command lines and entry points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_costs import COSTS

from pdmesh.cli.main import main
from pdmesh_bench.serve import Result, ServeOptions, summarize
from pdmesh_bench.sim.burst import simulate_burst
from pdmesh_bench.sim.costs import parse_costs
from pdmesh_bench.sim.mesh import GatewayOptions, Topology
from pdmesh_bench.sim.plan import plan, topologies
from pdmesh_bench.sim.slo import Slo
from pdmesh_bench.simcheck import parse_topology


@pytest.fixture
def cost_file(tmp_path: Path) -> Path:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(COSTS))
    return path


def test_sim_writes_the_keys_of_bench_serve_and_its_plot(cost_file: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = main(
        ["sim", "--costs", str(cost_file), "--synthetic", "--rate", "4", "--num-requests", "20",
         "--input-len", "200", "--output-len", "8", "--slo-ttft-ms", "2000", "--json", str(out),
         "--plot", str(png)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    real_keys = set(summarize([Result(0, 0.0)], 1.0, [], [0]))
    assert real_keys <= set(result)
    assert result["num_completed"] == 20 and result["output_tokens"] == 160
    assert 0 < result["goodput"]["attainment"] <= 1
    assert png.stat().st_size > 10_000


def test_plan_picks_the_fewest_ranks_that_meet_the_slos() -> None:
    costs = parse_costs(COSTS)
    workload = ServeOptions(synthetic=True, rate=1.0, num_requests=30, input_len=600, output_len=8)
    slo = Slo(ttft_ms=1500, tpot_ms=50)
    candidates = list(topologies(4, ["agg", "disagg"], [1]))
    assert Topology(1, 1) in candidates and Topology(0, 4, mode="agg") in candidates
    assert all(t.num_ranks <= 4 for t in candidates)
    result = plan(costs, workload, slo, GatewayOptions(), 0.9, candidates, progress=False)
    best = result["best"]
    assert best is not None and best["attainment"] >= 0.9
    smaller = [c for c in result["candidates"] if c["num_ranks"] < best["num_ranks"]]
    assert smaller and all(c["attainment"] < 0.9 for c in smaller)
    assert result["why"] and [f["num_ranks"] for f in result["frontier"]] == [1, 2, 3, 4]


def test_plan_command_says_when_nothing_meets_the_slos(cost_file: Path, capsys) -> None:
    code = main(
        ["plan", "--costs", str(cost_file), "--synthetic", "--rate", "50", "--num-requests", "30",
         "--input-len", "1000", "--output-len", "4", "--slo-ttft-ms", "10", "--slo-tpot-ms", "5",
         "--max-ranks", "2"]
    )  # fmt: skip
    assert code == 1
    assert "no topology tried meets the SLOs" in capsys.readouterr().out


def test_a_kv_load_cap_spreads_a_burst_over_more_steps() -> None:
    costs = parse_costs(COSTS)
    off = simulate_burst(costs, 32, 64, 16, None)
    capped = simulate_burst(costs, 32, 64, 16, 4)
    assert off["steps"] == 15 and off["max_batch"] == 32
    assert capped["steps"] > off["steps"]
    assert capped["wait_ms_p99"] > 4 * off["wait_ms_p99"]  # the last admitted wait 8 steps
    assert capped["tokens_per_s"] < off["tokens_per_s"]


def test_simcheck_reads_topologies_and_simulates_without_a_mesh(
    cost_file: Path, tmp_path: Path
) -> None:
    assert parse_topology("2P1D") == Topology(2, 1)
    assert parse_topology("agg") == Topology(0, 1, mode="agg")
    with pytest.raises(ValueError, match="1P1D"):
        parse_topology("1x1")
    trace = tmp_path / "trace.jsonl"  # Mooncake format: two sessions sharing a first block
    rows = [
        {"timestamp": 250 * i, "input_length": 700, "output_length": 20, "hash_ids": [1, 10 + i]}
        for i in range(20)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "check.json"
    code = main(
        ["bench", "simcheck", "--costs", str(cost_file), "--sim-only", "--topologies", "1P1D,agg",
         "--serve", f"conv=--trace {trace} --max-model-len 2048", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    cells = json.loads(out.read_text())["cells"]
    assert [(c["topology"], c["workload"]) for c in cells] == [("1P1D", "conv"), ("agg 1D", "conv")]
    assert all(c["simulated"]["num_completed"] == 20 for c in cells)
