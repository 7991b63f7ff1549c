"""`pdmesh bench soak`, the short version: a mesh of its own on the tiny model, ~45 s of mixed
traffic (completions and chat, streamed and not, greedy and seeded, long prompts sharing a prefix, a
share hung up on mid-stream), no chaos. Nothing is lost or wrong, no rank holds a block once idle,
the gateway counts nothing in flight, no process's open fds grow, and Redis is back to its keys
before the load (finished hand-off records may stay for the kvstore's retention, with an expiry
within it).

The pure verdict (`soak_core`) is checked on made-up series first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from meshlib import WORKER_ARGS

from pdmesh_bench import soak_core


def test_parse_duration_and_warmup() -> None:
    assert soak_core.parse_duration("30m") == 1800.0
    assert soak_core.parse_duration("90s") == soak_core.parse_duration("90") == 90.0
    assert soak_core.parse_duration("1.5h") == 5400.0
    with pytest.raises(ValueError):
        soak_core.parse_duration("soon")
    assert soak_core.warmup_of(1800.0) == 360.0
    assert soak_core.warmup_of(300.0) == 60.0  # at least a minute once the run lasts 5
    assert soak_core.warmup_of(60.0) == 12.0


def test_flatness_tells_a_leak_from_noise() -> None:
    span = (20.0, 100.0)
    noisy = [(float(t), 500.0 + (3.0 if t % 2 else -3.0)) for t in range(0, 101, 2)]
    leaking = [(float(t), 500.0 + 0.5 * t) for t in range(0, 101, 2)]  # +40 MB (8%) after warm-up
    assert soak_core.flatness("rss_mb:decode-0", noisy, span, 0.05).status == "flat"
    judged = soak_core.flatness("rss_mb:decode-0", leaking, span, 0.05)
    assert judged.status == "growing" and judged.growth_pct is not None and judged.growth_pct > 5
    fds = [(float(t), 30.0 + (t > 60)) for t in range(0, 101, 2)]  # one more fd: within the slack
    assert soak_core.flatness("fds:gateway-0", fds, span, 0.05).status == "flat"
    assert soak_core.flatness("fds:x", fds, span, 0.05, is_restarted=True).status == "restarted"
    assert soak_core.flatness("fds:x", fds[:3], span, 0.05).status == "too short"


def test_redis_leftovers() -> None:
    baseline = {"instance": 5, "agent": 2}
    assert (
        soak_core.redis_leftovers(baseline, {**baseline, "handoff": 9}, 0, [59_000], 60_000) == []
    )
    problems = soak_core.redis_leftovers(baseline, {"instance": 6, "agent": 2}, 2, [-1], 60_000)
    assert len(problems) == 3  # one more instance key, 2 live hand-offs, one without expiry


def test_handoff_records_are_bounded_by_the_recent_requests() -> None:
    def sample(t: float, ended: int, handoffs: int) -> soak_core.Sample:
        return soak_core.Sample(
            t,
            "load",
            redis_keys=handoffs + 7,
            num_ended=ended,
            redis_prefixes={"handoff": handoffs, "instance": 7},
        )

    steady = [sample(t, 2 * t, min(2 * t, 140)) for t in range(0, 300, 10)]  # 2/s, 70 s kept
    assert soak_core.handoff_bound(steady, (60, 290), 60.0, 4).status == "flat"
    leaking = [sample(t, 2 * t, 2 * t) for t in range(0, 300, 10)]  # none expires
    assert soak_core.handoff_bound(leaking, (60, 290), 60.0, 4).status == "growing"


def test_short_soak_loses_and_leaks_nothing(tiny_model: Path, tmp_path: Path) -> None:
    from pdmesh_bench.soak import SoakOptions, run_soak

    options = SoakOptions(
        model=str(tiny_model),
        duration=45.0,
        concurrency=3,
        num_prompts=12,
        num_long=4,
        num_seeded=4,
        long_tokens=96,  # 12 blocks of 8 tokens: three at once fit decode's 160 beside the rest
        min_tokens=8,
        max_tokens=24,
        sample_s=1.5,
        timeout_s=60.0,
        idle_timeout_s=30.0,
        drain_s=0.0,  # finished hand-off records: checked for their expiry, not waited for
        worker_args=" ".join(WORKER_ARGS),
        log_dir=str(tmp_path / "logs"),
        progress_s=1e6,
    )
    report = run_soak(options)
    summary = {k: report[k] for k in ("sent", "completed_correct", "aborted", "lost", "kinds")}
    assert report["lost"] == 0, (summary, report["errors_by_message"])
    assert report["completed_wrong"] == 0, report["wrong_examples"]
    assert report["completed_correct"] > 20 and report["aborted"] > 0, summary
    assert all(report["kinds"][k] for k in ("chat", "streamed", "seeded", "long")), summary
    assert report["sent"] > report["kinds"]["streamed"], "some requests are not streamed"

    leak = report["leak_check"]
    assert set(leak["leaked_blocks"].values()) == {0}, leak
    assert not leak["busy"] and not leak["unreachable"] and not leak["integrity_errors"], leak
    assert report["in_flight_end"] == 0
    fds = [f for f in report["flatness"] if f["name"].startswith("fds:")]
    assert len(fds) == 6 and all(f["status"] == "flat" for f in fds), fds  # 5 services + Redis
    redis_end = report["redis_end"]
    assert redis_end["problems"] == [] and redis_end["live_handoffs"] == 0, redis_end
    assert not report["restarts"] and not report["supervisor_gave_up"]
