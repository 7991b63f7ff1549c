"""The simulator's pieces against figures worked out by hand from the cost file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from sim_costs import COSTS

from pdmesh_bench.serve import ServeOptions
from pdmesh_bench.sim.clock import Deadlock, run_virtual
from pdmesh_bench.sim.costs import StepCurve, load_costs, parse_costs
from pdmesh_bench.sim.mesh import GatewayOptions, SimMesh, Topology
from pdmesh_bench.sim.ranks import Cpu
from pdmesh_bench.sim.simulate import simulate
from pdmesh_bench.traces import Job
from pdmesh_gateway.routing import LocalPrefill


def costs(**changes: object) -> object:
    return parse_costs({**COSTS, **changes})


def test_the_virtual_clock_jumps_to_each_timer_and_refuses_a_wait_on_nothing() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(5.0), asyncio.sleep(100.0))
        return loop.time()

    assert run_virtual(main()) == pytest.approx(100.0)

    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(Deadlock):
        run_virtual(stuck())


def test_a_step_curve_interpolates_and_extrapolates_linearly() -> None:
    curve = StepCurve(1, None, (1, 11, 101), (1.0, 2.0, 11.0))
    assert curve.base(6) == pytest.approx(1.5)
    assert curve.base(56) == pytest.approx(6.5)
    assert curve.base(201) == pytest.approx(21.0)  # past the end, along the last segment
    with pytest.raises(ValueError, match="ascending"):
        StepCurve(1, None, (10, 1), (1.0, 2.0))


def test_a_dep_step_waits_for_its_busiest_rank_and_the_moe_imbalance() -> None:
    c = costs(allreduce_s={"2": 0.004})
    # base(t) = 0.009 + 0.001 t; rank 0 computes 401 tokens, rank 1 one token
    dense = 0.5 * (0.009 + 0.401)
    moe = 0.5 * (0.009 + 0.001 * 201)  # the tokens of both, spread over 2 ranks
    assert c.step_s([(401, 0), (1, 0)], eplb=True) == pytest.approx(dense + moe + 0.004)
    assert c.step_s([(401, 0), (1, 0)], eplb=False) == pytest.approx(dense + moe / 0.5 + 0.004)
    assert c.step_s([(401, 0)]) == pytest.approx(0.410)  # one rank: the curve itself


def test_a_cost_file_of_another_version_or_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**COSTS, "version": 7}))
    with pytest.raises(ValueError, match="version 7"):
        load_costs(path)
    path.write_text(json.dumps({k: v for k, v in COSTS.items() if k != "steps"}))
    with pytest.raises(ValueError, match="steps"):
        load_costs(path)


def one_request(topology: Topology, prompt_len: int, max_tokens: int) -> list[float]:
    """Token times (as the client sees them) of one request sent at t = 0 to an idle mesh."""

    async def main() -> list[float]:
        mesh = SimMesh(costs(), topology, GatewayOptions(local_prefill=LocalPrefill.parse("off")))
        result = await mesh.issue(Job(0, list(range(16, 16 + prompt_len)), max_tokens, 0.0), 0.0)
        mesh.close()
        assert result.ok and result.output_tokens == max_tokens
        return result.token_times

    return run_virtual(main())


def test_agg_one_request_costs_its_prefill_step_then_one_step_per_token() -> None:
    times = one_request(Topology(0, 1, mode="agg"), 401, 3)
    step = 0.001  # token_s on every decode-rank step
    assert times[0] == pytest.approx(0.010 + 0.410 + step + 0.010)
    assert [b - a for a, b in zip(times, times[1:], strict=False)] == pytest.approx(
        [0.011, 0.011]  # base(1) + token_s
    )


def test_disagg_one_request_adds_the_transfer_and_the_handoff() -> None:
    times = one_request(Topology(1, 1), 401, 2)
    transfer = 0.002 + 401 * 1000 / 1e6 + 0.030
    assert times[0] == pytest.approx(0.010 + 0.410 + transfer + 0.010)
    assert times[1] - times[0] == pytest.approx(0.011)


def test_a_queue_at_the_gateway_forms_past_the_prefill_slots() -> None:
    workload = ServeOptions(synthetic=True, rate=1000.0, num_requests=6, input_len=401,
                            output_len=2)  # fmt: skip
    gateway = GatewayOptions(max_prefill_inflight=1, local_prefill=LocalPrefill.parse("off"))
    result = simulate(costs(), Topology(1, 1), gateway, workload)
    assert result["num_completed"] == 6
    queue = result["sim"]["queue_s"]
    assert queue["p90"] > 4 * 0.4  # the 6th waits for ~5 prefills one at a time
    ttfts = sorted(r["ttft_ms"] for r in result["requests"])
    assert ttfts[-1] - ttfts[0] > 5 * 400  # and its TTFT shows it


def test_dp_lag_costs_prefill_throughput_only_when_ranks_step_together() -> None:
    workload = ServeOptions(
        synthetic=True, rate=2.0, num_requests=30, input_len=64, output_len=2, long_input_len=1500,
        long_fraction=0.3, dp_replay="both", lag_s=0.5, seed=3,
    )  # fmt: skip
    dep2 = simulate(costs(), Topology(1, 1, prefill_dep=2), GatewayOptions(), workload)
    assert dep2["num_errors"] == 0
    assert dep2["dp_replay"]["imbalance_cost"]["throughput"] > 0.01
    mirror = dep2["dp_replay"]["replays"][0]["ranks"]
    assert mirror[0]["busy_s"] == pytest.approx(mirror[1]["busy_s"])  # the ranks stay identical
    # two DEP1 instances do not step together: lagging one costs nothing
    apart = simulate(costs(), Topology(2, 1), GatewayOptions(), workload)
    assert abs(apart["dp_replay"]["imbalance_cost"]["throughput"]) < 1e-6


def test_prefill_tokens_attend_at_their_own_slope() -> None:
    steps = [
        {**COSTS["steps"][0], "attn_s_per_token_ctx": 1e-6, "prefill_attn_s_per_token_ctx": 4e-6}
    ]
    c = parse_costs({**COSTS, "steps": steps})
    # 100 tokens: one decode at context 999 (attends 1,000) and a 99-token chunk from 0
    assert c.step_s([(100, 1000, 4950)]) == pytest.approx(0.109 + 1e-3 + 4950 * 4e-6)
    assert parse_costs(COSTS).curve(1, None).prefill_attn == 0.0  # absent: the decode slope


def test_ranks_on_shared_cores_slow_each_other() -> None:
    cpu = Cpu(2, corun_slowdown=1.5)
    assert cpu.slowdown(2) == 1.0  # alone, however many threads fit
    cpu.busy_threads, cpu.busy_ranks = 1, 1
    assert cpu.slowdown(1) == pytest.approx(1.5)  # a neighbour computes
    cpu.busy_threads, cpu.busy_ranks = 2, 2
    assert cpu.slowdown(1) == pytest.approx(1.5 * 3 / 2)  # and 3 threads share 2 cores
    assert Cpu(None).slowdown(8) == 1.0  # a device per rank


def test_a_decode_step_pays_per_sequence_it_streams() -> None:
    overheads = {**COSTS["overheads"], "token_s": {"1": 0.001}, "sequence_s": {"1": 0.0005}}
    c = parse_costs({**COSTS, "overheads": overheads})
    assert c.overheads.sequence(1) == 0.0005 and c.overheads.token(2) == 0.001  # the nearest

    async def main() -> list[float]:
        mesh = SimMesh(c, Topology(0, 1, mode="agg"), GatewayOptions(threads=1))
        jobs = [Job(i, list(range(16 + i, 116 + i)), 4, 0.0) for i in range(3)]
        results = await asyncio.gather(*(mesh.issue(job, 0.0) for job in jobs))
        mesh.close()
        return results[0].token_times

    times = run_virtual(main())
    # three streams decode together: base(3) + token_s + 3 * sequence_s per step
    assert times[-1] - times[-2] == pytest.approx(0.012 + 0.001 + 3 * 0.0005)
