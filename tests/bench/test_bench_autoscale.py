"""`pdmesh bench autoscale`: its load (seeded phases), the meshes it compares, and its summary
(outcomes, TTFT per phase, replica counts and changes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdmesh_bench.autoscale import register, topologies
from pdmesh_bench.autoscale_report import (
    Record,
    Sample,
    phases,
    print_report,
    quantile,
    schedule,
    summarize,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="bench_command", required=True))
    return parser.parse_args(["autoscale", *argv])


def test_the_load_is_quiet_then_a_burst_then_quiet_and_seeded() -> None:
    load = phases(2.0, 5.0, 20.0, 40.0, 60.0)
    assert [(p.name, p.rate, p.duration_s) for p in load] == [
        ("quiet", 2.0, 20.0),
        ("burst", 10.0, 40.0),
        ("after", 2.0, 60.0),
    ]
    arrivals = schedule(load, seed=1)
    assert arrivals == schedule(load, seed=1) != schedule(load, seed=2)
    counts = {
        name: sum(1 for n, _ in arrivals if n == name) for name in ("quiet", "burst", "after")
    }
    assert 20 < counts["quiet"] < 60 and 300 < counts["burst"] < 500 and 80 < counts["after"] < 160
    burst = [t for n, t in arrivals if n == "burst"]
    assert 20 <= min(burst) and max(burst) < 60
    assert [t for _, t in arrivals] == sorted(t for _, t in arrivals)
    with pytest.raises(ValueError, match="positive"):
        phases(0.0, 5.0, 1, 1, 1)


def test_the_autoscaled_mesh_and_the_fixed_one() -> None:
    args = _args("--autoscale", "prefill=1..3,decode=1..2", "--drain-s", "7")
    (scaled_name, scaled), (fixed_name, fixed) = topologies(args, Path("m"), Path("logs"))
    assert (scaled_name, fixed_name) == ("autoscaled", "fixed")
    assert (
        (scaled.num_prefill, scaled.num_decode) == (1, 1) == (fixed.num_prefill, fixed.num_decode)
    )
    assert scaled.autoscale is not None and scaled.autoscale["prefill"].max_replicas == 3
    assert fixed.autoscale is None and "--drain-s" not in fixed.worker_args
    assert scaled.worker_args[-2:] == ("--drain-s", "7")
    assert "--autoscale-cooldown-s" in scaled.gateway_args
    assert scaled.gateway_args[:2] == fixed.gateway_args[:2] == ("--max-queued", "100000")
    only = topologies(_args("--only", "fixed"), Path("m"), Path("logs"))
    assert [name for name, _ in only] == ["fixed"]


def _record(phase: str, ttft: float | None, status: int = 200, error: str = "") -> Record:
    first = None if ttft is None else 1.0 + ttft
    return Record(phase, 1.0, first, 3.0, status, "length" if status == 200 else None, error)


def test_the_summary_counts_outcomes_ttft_per_phase_and_replica_changes(capsys) -> None:
    records = [
        *(_record("quiet", 0.1) for _ in range(9)),
        _record("quiet", 0.9),
        *(_record("burst", t) for t in (1.0, 2.0, 3.0, 4.0)),
        _record("burst", None, status=429),
        _record("burst", None, status=0, error="LeanError: reset"),
        _record("after", 0.2),
    ]
    samples = [
        Sample(float(t), "x", {"prefill": p, "decode": 1}, {"prefill": r, "decode": 1})
        for t, (p, r) in enumerate([(1, 1), (2, 1), (2, 2), (3, 2), (3, 3), (2, 3), (2, 2)])
    ]
    result = summarize("autoscaled", records, samples, [])
    assert (result["num_requests"], result["num_completed"]) == (17, 15)
    assert (result["num_shed"], result["num_lost"]) == (1, 1)
    assert result["lost_errors"] == ["LeanError: reset"]
    assert result["ttft_s"]["quiet"]["p90"] == pytest.approx(0.1)
    assert result["ttft_s"]["burst"] == {"p50": 2.0, "p90": 4.0, "n": 4}
    prefill = result["pools"]["prefill"]
    assert (prefill["max_ready"], prefill["num_changes"], prefill["final_ready"]) == (3, 3, 2)
    assert result["pools"]["decode"]["num_changes"] == 0
    print_report([result])
    out = capsys.readouterr().out
    assert "autoscaled" in out and "3/3" in out and "4.00s" in out


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.9) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([float(i) for i in range(1, 11)], 0.9) == 9.0
