"""Recursive-doubling all-reduce: the pure schedule (p up to 64), real gloo processes (every world
size 1..9), and a smoke run of `pdmesh bench allreduce --quick`.

The multi-process check spawns 9 ranks once (each spawn imports torch: ~2 CPU-s) and runs world
sizes 1..8 on subgroups of the top ranks (group rank != global rank, so the peer mapping is
exercised) and 9 on the default group; every rank returns what it computed and the asserts run here.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pdmesh.cli.main import main
from pdmesh_bench.allreduce import run_ranks
from pdmesh_engine.parallel import (
    DP_SYNC_IMPLS,
    AllToAllReduce,
    GlooAllReduce,
    RecursiveDoublingAllReduce,
    make_dp_sync,
    num_rounds,
    recursive_doubling_all_reduce,
    recursive_doubling_schedule,
)

MAX_WORLD = 9
BIG = 2**53 + 1  # sums of it are not exact in float64: integer sums must not pass through floats
CALLS = 5  # back-to-back calls per DPSync: no message of one call may land in another


def expected_rounds(p: int) -> int:
    k = p.bit_length() - 1
    return k if p == 1 << k else k + 2


# ----------------------------------------------------------------------------- pure schedule


@pytest.mark.parametrize("p", range(1, 65))
def test_num_rounds_closed_form_and_schedule_length(p: int) -> None:
    assert num_rounds(p) == expected_rounds(p)
    for rank in range(p):
        steps = recursive_doubling_schedule(rank, p)
        assert [s.round for s in steps] == list(range(num_rounds(p)))
    if p > 1:  # rank 0 works in every round: the depth is real
        assert all(s.peer is not None for s in recursive_doubling_schedule(0, p))


def test_num_rounds_known_values() -> None:
    assert [num_rounds(p) for p in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17)] == [
        0,
        1,
        3,
        2,
        4,
        4,
        4,
        3,
        5,
        4,
        6,
    ]


@pytest.mark.parametrize("p", range(1, 65))
def test_every_send_matches_a_receive_in_the_same_round(p: int) -> None:
    schedules = [recursive_doubling_schedule(rank, p) for rank in range(p)]
    for rank, steps in enumerate(schedules):
        for step in steps:
            if step.peer is None:
                assert not (step.send or step.recv or step.combine)
                continue
            assert step.peer != rank and 0 <= step.peer < p
            other = schedules[step.peer][step.round]
            assert other.peer == rank
            # a send meets a recv, both ways
            assert other.recv == step.send and other.send == step.recv


def simulate(p: int, values: list[Any], combine: Any) -> list[Any]:
    """Run every rank's schedule on Python values: all sends of a round read the state before the
    round."""
    state = list(values)
    for n in range(num_rounds(p)):
        steps = [recursive_doubling_schedule(rank, p)[n] for rank in range(p)]
        outgoing = {rank: state[rank] for rank, s in enumerate(steps) if s.send}
        for rank, s in enumerate(steps):
            if s.recv:
                incoming = outgoing[s.peer]
                state[rank] = combine(state[rank], incoming) if s.combine else incoming
    return state


@pytest.mark.parametrize("p", range(1, 65))
def test_simulation_counts_every_contribution_exactly_once(p: int) -> None:
    final = simulate(p, [Counter({rank: 1}) for rank in range(p)], lambda a, b: a + b)
    assert all(c == Counter({rank: 1 for rank in range(p)}) for c in final)
    sums = simulate(
        p,
        [[rank + 1, 10 * rank, 7] for rank in range(p)],
        lambda a, b: [x + y for x, y in zip(a, b, strict=True)],
    )
    assert sums == [[p * (p + 1) // 2, 5 * p * (p - 1), 7 * p]] * p
    assert (
        simulate(p, [(rank * 37) % 11 for rank in range(p)], max)
        == [max((r * 37) % 11 for r in range(p))] * p
    )


def test_schedule_rejects_bad_arguments() -> None:
    for rank, world in ((0, 0), (-1, 4), (4, 4)):
        with pytest.raises(ValueError):
            recursive_doubling_schedule(rank, world)
    with pytest.raises(ValueError):
        num_rounds(0)


def test_bad_op_and_unknown_sync_are_rejected_before_any_communication() -> None:
    with pytest.raises(ValueError, match="op must be"):
        recursive_doubling_all_reduce(torch.zeros(2, dtype=torch.int64), op="prod")
    with pytest.raises(ValueError, match="unknown DP sync"):
        make_dp_sync("ring")
    assert DP_SYNC_IMPLS == {
        "gloo": GlooAllReduce,
        "recursive_doubling": RecursiveDoublingAllReduce,
        "all_to_all": AllToAllReduce,
    }


# ----------------------------------------------------------------------------- real processes


def _member_checks(group: dist.ProcessGroup | None) -> dict[str, Any]:
    g, p = dist.get_rank(group), dist.get_world_size(group)
    base = torch.tensor([g + 1, 10 * g, 7, BIG + g, -g], dtype=torch.int64)
    out: dict[str, Any] = {"p": p, "g": g}
    for op in ("sum", "max", "min"):
        t = base.clone()
        out[f"rounds_{op}"] = recursive_doubling_all_reduce(t, group, op=op)
        out[op] = t.tolist()
    f = torch.tensor([0.1 * (g + 1), 1.0 / (g + 3)], dtype=torch.float64)
    recursive_doubling_all_reduce(f, group)
    out["float"] = f.tolist()
    strided = torch.arange(6, dtype=torch.int64).reshape(2, 3).t() + g
    recursive_doubling_all_reduce(strided, group)
    out["strided"] = strided.tolist()
    for name in ("gloo", "recursive_doubling", "all_to_all"):
        sync = make_dp_sync(name, group)
        results = []
        for call in range(CALLS):
            t = torch.tensor([int(g == call % p), g * call, call], dtype=torch.int64)
            sync.all_reduce(t)
            results.append(t.tolist())
        out[name] = results
    return out


def all_sizes_rank(rank: int, world: int) -> list[dict[str, Any]]:
    """Child: world sizes 1..world-1 on subgroups of the top ranks, then `world` on the default
    group."""
    groups = {p: dist.new_group(list(range(world - p, world))) for p in range(1, world)}
    reports = []
    for p in range(1, world + 1):
        if rank >= world - p:
            reports.append(_member_checks(groups.get(p)))
    return reports


@pytest.fixture(scope="module")
def reports() -> dict[int, list[dict[str, Any]]]:
    by_rank = run_ranks(MAX_WORLD, all_sizes_rank, timeout_s=180.0)
    by_size: dict[int, list[dict[str, Any]]] = {}
    for per_rank in by_rank:
        for report in per_rank:
            by_size.setdefault(report["p"], []).append(report)
    return {p: sorted(rs, key=lambda r: r["g"]) for p, rs in by_size.items()}


@pytest.mark.parametrize("p", range(1, MAX_WORLD + 1))
def test_exact_integer_reductions_on_every_world_size(
    reports: dict[int, list[dict[str, Any]]], p: int
) -> None:
    ranks = reports[p]
    assert [r["g"] for r in ranks] == list(range(p))
    tri = p * (p - 1) // 2
    for r in ranks:
        assert r["sum"] == [p * (p + 1) // 2, 10 * tri, 7 * p, p * BIG + tri, -tri]
        assert r["max"] == [p, 10 * (p - 1), 7, BIG + p - 1, 0]
        assert r["min"] == [1, 0, 7, BIG, -(p - 1)]
        assert r["strided"] == [[p * (3 * j + i) + tri for j in range(2)] for i in range(3)]


@pytest.mark.parametrize("p", range(1, MAX_WORLD + 1))
def test_rounds_returned_match_the_closed_form(
    reports: dict[int, list[dict[str, Any]]], p: int
) -> None:
    for r in reports[p]:
        assert (
            r["rounds_sum"]
            == r["rounds_max"]
            == r["rounds_min"]
            == expected_rounds(p)
            == num_rounds(p)
        )


@pytest.mark.parametrize("p", range(1, MAX_WORLD + 1))
def test_float_sums_are_bitwise_identical_on_every_rank(
    reports: dict[int, list[dict[str, Any]]], p: int
) -> None:
    floats = [r["float"] for r in reports[p]]
    assert all(f == floats[0] for f in floats)
    expected = [
        math.fsum(0.1 * (g + 1) for g in range(p)),
        math.fsum(1.0 / (g + 3) for g in range(p)),
    ]
    assert floats[0] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("p", range(1, MAX_WORLD + 1))
def test_every_dp_sync_agrees_over_back_to_back_calls(
    reports: dict[int, list[dict[str, Any]]], p: int
) -> None:
    expected = [[1, c * p * (p - 1) // 2, c * p] for c in range(CALLS)]
    for r in reports[p]:
        assert r["recursive_doubling"] == expected
        assert r["gloo"] == expected
        assert r["all_to_all"] == expected


# ----------------------------------------------------------------------------- bench smoke


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_allreduce_quick(
    tmp_path: Path, capsys: pytest.CaptureFixture, restore_threads: None
) -> None:
    out = tmp_path / "allreduce.json"
    assert (
        main(
            [
                "bench",
                "allreduce",
                "--quick",
                "--ranks",
                "2,3",
                "--repeats",
                "10",
                "--warmup",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["ranks"] for r in report["results"]] == [2, 3]
    assert [r["ours_rounds"] for r in report["results"]] == [1, 3]
    for r in report["results"]:
        for key in ("gloo_us_p50", "gloo_us_p90", "ours_us_p50", "ours_us_p90", "ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["gloo_us_p90"] >= r["gloo_us_p50"] and r["ours_us_p90"] >= r["ours_us_p50"]
        assert r["ratio"] == pytest.approx(r["gloo_us_p50"] / r["ours_us_p50"])
    assert "oversubscribed" in " ".join(report["notes"])
    assert report["config"]["repeats"] == 10
    assert "gloo/ours" in capsys.readouterr().out
