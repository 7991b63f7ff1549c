"""`pdmesh bench autoscale`'s figures (pure: no sockets, no processes): the phases of the load,
what each request did, the replica counts sampled over time, and the summary of one topology.

Chain: `Phase`s → arrivals (`schedule`: seeded Poisson offsets per phase) → `Record` per request
(sent by `pdmesh_bench.autoscale`) + `Sample`s of the pools every second → `summarize` → the report
(`print_report`, and the JSON `pdmesh_bench.autoscale` writes).

A request is `completed` when its stream ended with a finish_reason; `shed` when refused with 429
(the gateway's bounded queue: a refusal, told to the client, not a loss); `lost` otherwise (an error
status, an error event, a stream that broke or ended early, a client timeout). TTFT counts from the
request's scheduled arrival (an open loop: the client's own delays count against the mesh).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdmesh_bench.overload_report import poisson_offsets

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Phase:
    name: str  # quiet | burst | after
    rate: float  # requests per second
    duration_s: float


@dataclass(frozen=True)
class Record:
    phase: str
    arrival_s: float  # scheduled, since the load's start
    first_token_s: float | None
    end_s: float
    status: int  # HTTP status (0: no answer)
    finish_reason: str | None
    error: str = ""

    @property
    def is_completed(self) -> bool:
        return self.status == 200 and self.finish_reason is not None and not self.error

    @property
    def is_shed(self) -> bool:
        return self.status == 429

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class Sample:
    """The pools at `at_s` (since the load's start): desired and ready replicas per pool."""

    at_s: float
    phase: str
    desired: dict[str, int]
    ready: dict[str, int]
    queue_time_s: float | None = None


def phases(
    rate: float, multiple: float, quiet_s: float, burst_s: float, after_s: float
) -> list[Phase]:
    """Quiet at `rate`, a burst at `multiple` x `rate`, quiet again."""
    if not rate > 0 or not multiple > 0:
        raise ValueError(f"--rate and --multiple must be positive, got {rate}, {multiple}")
    return [
        Phase("quiet", rate, quiet_s),
        Phase("burst", rate * multiple, burst_s),
        Phase("after", rate, after_s),
    ]


def schedule(load: Sequence[Phase], seed: int) -> list[tuple[str, float]]:
    """(phase, arrival offset since the start) of every request, in time order."""
    rng, start, arrivals = random.Random(seed), 0.0, []
    for phase in load:
        arrivals += [
            (phase.name, start + t) for t in poisson_offsets(phase.rate, phase.duration_s, rng)
        ]
        start += phase.duration_s
    return arrivals


def quantile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank quantile (None without values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _changes(series: Sequence[int]) -> int:
    return sum(a != b for a, b in zip(series, series[1:], strict=False))


def summarize(
    name: str,
    records: Sequence[Record],
    samples: Sequence[Sample],
    events: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """One topology's figures: requests by outcome, TTFT per phase, and per pool the replica
    counts over time, the most ready at once and how often the desired count changed."""
    ttft: dict[str, dict[str, float | None]] = {}
    for phase in dict.fromkeys(r.phase for r in records):
        values = [
            t
            for r in records
            if r.phase == phase and r.is_completed and (t := r.ttft_s) is not None
        ]
        ttft[phase] = {"p50": quantile(values, 0.5), "p90": quantile(values, 0.9), "n": len(values)}
    pools = {}
    for pool in POOLS:
        desired = [s.desired[pool] for s in samples if pool in s.desired]
        ready = [s.ready[pool] for s in samples if pool in s.ready]
        pools[pool] = {
            "max_ready": max(ready, default=None),
            "max_desired": max(desired, default=None),
            "num_changes": _changes(desired),
            "final_ready": ready[-1] if ready else None,
        }
    lost = [r for r in records if not r.is_completed and not r.is_shed]
    return {
        "topology": name,
        "num_requests": len(records),
        "num_completed": sum(r.is_completed for r in records),
        "num_shed": sum(r.is_shed for r in records),
        "num_lost": len(lost),
        "lost_errors": sorted({r.error or f"HTTP {r.status}" for r in lost})[:5],
        "ttft_s": ttft,
        "pools": pools,
        "events": list(events),
        "timeline": [
            {
                "t": round(s.at_s, 1),
                "phase": s.phase,
                "desired": s.desired,
                "ready": s.ready,
                "queue_time_s": s.queue_time_s,
            }
            for s in samples
        ],
    }


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def print_report(results: Sequence[dict[str, Any]]) -> None:
    print("bench autoscale: quiet -> burst -> quiet")
    print(
        f"  {'topology':<12}{'sent':>6}{'done':>6}{'lost':>6}{'shed':>6}"
        f"{'ttft p90 quiet':>16}{'ttft p90 burst':>16}{'ttft p90 after':>16}"
        f"{'prefill max/chg':>17}{'decode max/chg':>16}"
    )
    for r in results:
        t, pools = r["ttft_s"], r["pools"]
        row = [_s(t.get(p, {}).get("p90")) for p in ("quiet", "burst", "after")]
        counts = [f"{pools[p]['max_ready']}/{pools[p]['num_changes']}" for p in POOLS]
        print(
            f"  {r['topology']:<12}{r['num_requests']:>6}{r['num_completed']:>6}{r['num_lost']:>6}"
            f"{r['num_shed']:>6}{row[0]:>16}{row[1]:>16}{row[2]:>16}{counts[0]:>17}{counts[1]:>16}"
        )
    for r in results:
        print(
            f"  {r['topology']}: replicas over time "
            "(t s: prefill ready/desired, decode ready/desired)"
        )
        steps, last = [], None
        for row in r["timeline"]:
            now = tuple(row["ready"].get(p) for p in POOLS) + tuple(
                row["desired"].get(p) for p in POOLS
            )
            if now != last:
                steps.append(f"{row['t']:g}: {now[0]}/{now[2]}, {now[1]}/{now[3]} ({row['phase']})")
                last = now
        print("    " + "; ".join(steps))
