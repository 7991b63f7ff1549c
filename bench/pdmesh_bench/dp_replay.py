"""`pdmesh bench serve --dp-replay mirror|lag|both`: what DP imbalance costs a DEP instance.

The ranks of a DEP instance step in lockstep (the MoE layers exchange tokens every step; a rank
without work runs a dummy step), so a step takes as long as its busiest rank: when ranks hold
unequal work, the others wait. Every job of the workload is sent once per DP rank r, pinned to r
with the `X-Data-Parallel-Rank` header (prefill rank r; in agg mode decode rank r):
- mirror: every copy at the job's arrival time, so every rank holds the same work at every moment
  and no rank waits for another;
- lag: rank r's copy at arrival + r * lag_s, the same work per rank in total, but at any moment the
  ranks hold different requests (short next to long prompts), so they are unbalanced.
The difference is the cost of imbalance (the system this follows saw DEP2 5.9%, DEP4 13.6%).
With one rank, lag is the mirror: the cost is ~0 by construction (only noise).

What keeps the comparison fair:
- the same work: every replay sends the same requests (lengths, arrival times, prefix sharing) to
  every rank; only the lag differs;
- no prefix-cache hits across copies or replays: each (replay, rank) copy gets its own token ids
  (`copy_seed`), so neither a later replay nor rank r's copy finds another copy's blocks in any
  cache (the decode ranks', too), while prefix sharing inside one rank's copies (a trace's hash
  ids) is the same in every replay. A second invocation with the same `--seed` against the same
  mesh finds the first one's prompts cached: give it another seed (the report warns when a replay
  got more cached tokens than its reusable prefix);
- prefill-dominated load: short outputs (`--output-len`, or `--keep-output-len` with a trace's short
  outputs) so that decode is not the bottleneck, and prompts of mixed lengths (a trace, or
  `--synthetic --long-input-len L --long-fraction F`), so that at any moment lagged ranks hold
  more different work (with equal prompts only the bursts of the arrivals differ);
- enough load that the prefill instance is busy (`--rate`, `--time-scale`): at light load most
  requests meet no other and imbalance has little to cost;
- the lag offset and idle gaps are not a cost: TTFT is timed from each copy's own send, and a
  rank's busy time is the time during which it had a copy outstanding (the union of its copies'
  [send, first token] intervals), so neither the (N-1) * lag_s of the lag replay nor gaps between
  arrivals count; throughput = all ranks' prompt tokens / their mean busy time. lag_s should be a
  few inter-arrival times (so lagged ranks hold different requests) and small against the replay
  (edges where only some ranks have work favour lag);
- the client is not the bottleneck: copies in flight share `--max-inflight` connections (raise it
  when N ranks' backlogs together exceed it, or TTFT includes waiting for a connection);
- drift: `both` runs mirror, lag, mirror against the same mesh (`--dp-rounds K`: K lags, each
  between two mirrors) and compares the mean lag with the mean mirror; `mirror_spread` (the
  mirrors' relative difference) shows the noise, which on a shared machine can exceed the cost.

Reported per replay: the usual summary (with its per-request rows), per rank its busy time,
prompt tokens/s and TTFT; and the cost: 1 - throughput_lag / throughput_mirror and lag / mirror of
TTFT p50, p90 and mean.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import httpx

from pdmesh_bench.serve import (
    Issuer,
    Result,
    Sender,
    ServeOptions,
    Workload,
    print_tokens,
    summarize,
)
from pdmesh_bench.traces import Job, distribution

MODES = ("mirror", "lag", "both")
MAX_COPIES = 1000  # ranks and replays per copy_seed stride
COPY_SEED_BASE = 1 << 40  # copy seeds start here; plain runs' seeds stay below
SETTLE_S = 1.0  # pause between replays (heartbeats and load reports catch up)
THROUGHPUT_DEFINITION = (
    "prompt tokens of the completed copies / mean over ranks of the rank's busy time (the union "
    "of its copies' [send, first token] intervals), so neither a lag offset nor idle gaps count"
)


@dataclass(frozen=True)
class Copy:
    """Rank `rank`'s copy of job `index`, sent `send_s` after the replay's start."""

    index: int
    rank: int
    send_s: float


def schedule_copies(arrivals: Sequence[float], dp_size: int, lag_s: float) -> list[Copy]:
    """Every job once per rank r in [0, dp_size), at its arrival + r * lag_s (lag_s 0: mirror);
    in send order (ties: by rank, then job)."""
    if dp_size < 1 or lag_s < 0:
        raise ValueError(f"need dp_size >= 1 and lag_s >= 0, got {dp_size}, {lag_s}")
    copies = [
        Copy(index, rank, at + rank * lag_s)
        for rank in range(dp_size)
        for index, at in enumerate(arrivals)
    ]
    return sorted(copies, key=lambda c: (c.send_s, c.rank, c.index))


def replays_of(mode: str, lag_s: float, rounds: int = 1) -> list[tuple[str, str, float]]:
    """(name, kind, lag) of each replay a mode runs; `both`: mirror, then `rounds` times lag and
    mirror again (mirror, lag, mirror-2, lag-2, mirror-3, ...): every lag between two mirrors."""
    if mode not in MODES or rounds < 1:
        raise ValueError(f"--dp-replay must be one of {MODES} and rounds >= 1, got {mode!r}")
    if mode != "both":
        return [(mode, mode, lag_s if mode == "lag" else 0.0)]
    plan = [("mirror", "mirror", 0.0)]
    for k in range(1, rounds + 1):
        suffix = "" if k == 1 else f"-{k}"
        plan += [(f"lag{suffix}", "lag", lag_s), (f"mirror-{k + 1}", "mirror", 0.0)]
    return plan


def copy_seed(seed: int, replay: int, rank: int) -> int:
    """The prompt seed of one rank's copies in one replay: distinct for every (replay, rank), so no
    copy shares a block with another copy or replay, and above COPY_SEED_BASE, so none equals the
    `--seed` of a plain run (whose prompts an earlier run may have left in the caches)."""
    if not 0 <= replay < MAX_COPIES or not 0 <= rank < MAX_COPIES or seed < 0:
        raise ValueError(f"replay and rank must be in [0, {MAX_COPIES}), seed >= 0")
    return COPY_SEED_BASE + (seed * MAX_COPIES + replay) * MAX_COPIES + rank


# ----- figures (pure) --------------------------------------------------------------------------


def rank_figures(results: Sequence[Result], dp_size: int) -> list[dict[str, Any]]:
    """Per rank: its copies; busy time (s, `busy_time` of its completed copies); span (first send
    to last first token, s); prompt tokens/s over the busy time; TTFT (ms) of its completed
    copies."""
    rows = []
    for rank in range(dp_size):
        mine = [r for r in results if r.rank == rank]
        ok = [r for r in mine if r.ok]
        busy = busy_time([(r.start, r.token_times[0]) for r in ok]) if ok else None
        prompt = sum(r.prompt_tokens for r in ok)
        rows.append(
            {
                "rank": rank,
                "num_requests": len(mine),
                "num_completed": len(ok),
                "prompt_tokens": prompt,
                "busy_s": busy,
                "span_s": max(r.token_times[0] for r in ok) - min(r.start for r in ok)
                if ok
                else None,
                "prompt_tokens_per_s": prompt / busy if busy else None,
                "ttft_ms": distribution([r.ttft_s * 1e3 for r in ok]),
            }
        )
    return rows


def busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of [start, end] intervals (overlaps counted once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def prefill_throughput(ranks: Sequence[dict[str, Any]]) -> tuple[float | None, float | None]:
    """(prompt tokens/s, mean busy s) of a replay: all ranks' prompt tokens / their mean busy
    time (THROUGHPUT_DEFINITION); None when a rank completed nothing."""
    busy = [r["busy_s"] for r in ranks]
    if not busy or any(b is None or b <= 0 for b in busy):
        return None, None
    mean_busy = fmean(busy)
    return sum(r["prompt_tokens"] for r in ranks) / mean_busy, mean_busy


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def _mean(values: Sequence[float | None]) -> float | None:
    """The mean, or None when a value is missing."""
    known = [v for v in values if v is not None]
    return fmean(known) if known and len(known) == len(values) else None


def imbalance_cost(replays: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Lag against mirror (the mean of the mirror replays): `throughput` = 1 - tp_lag /
    tp_mirror, `ttft_<stat>_ratio` = lag / mirror; `mirror_spread` = (max - min) / mean of the
    mirrors' throughputs (the noise). None unless both kinds ran."""
    mirrors = [r for r in replays if r["kind"] == "mirror"]
    lags = [r for r in replays if r["kind"] == "lag"]
    if not mirrors or not lags:
        return None
    tp_mirror = _mean([r["prefill_tokens_per_s"] for r in mirrors])
    tp_lag = _mean([r["prefill_tokens_per_s"] for r in lags])
    ratio = _ratio(tp_lag, tp_mirror)
    cost: dict[str, Any] = {
        "throughput": None if ratio is None else 1.0 - ratio,
        "prefill_tokens_per_s_mirror": tp_mirror,
        "prefill_tokens_per_s_lag": tp_lag,
    }
    for stat in ("p50", "p90", "mean"):
        cost[f"ttft_{stat}_ratio"] = _ratio(
            _mean([r["ttft_ms"][stat] for r in lags]), _mean([r["ttft_ms"][stat] for r in mirrors])
        )
    throughputs = [r["prefill_tokens_per_s"] for r in mirrors]
    cost["mirror_spread"] = (
        (max(throughputs) - min(throughputs)) / fmean(throughputs)
        if len(throughputs) > 1 and None not in throughputs
        else None
    )
    cost["per_round"] = per_round_costs(replays)
    cost["definition"] = "1 - lag / mirror of " + THROUGHPUT_DEFINITION
    return cost


def per_round_costs(replays: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each lag replay against the mirror replays next to it (before and after, in run order):
    the cost as drift would leave it round by round; their spread shows the noise."""
    rounds = []
    for i, lag in enumerate(replays):
        if lag["kind"] != "lag":
            continue
        near = [r for r in replays[max(0, i - 1) : i + 2] if r["kind"] == "mirror"]
        ratio = _ratio(
            lag["prefill_tokens_per_s"], _mean([r["prefill_tokens_per_s"] for r in near])
        )
        rounds.append(
            {
                "lag": lag["name"],
                "mirrors": [r.get("name") for r in near],
                "throughput": None if ratio is None else 1.0 - ratio,
                "ttft_mean_ratio": _ratio(
                    lag["ttft_ms"]["mean"], _mean([r["ttft_ms"]["mean"] for r in near])
                ),
            }
        )
    return rounds


# ----- running ---------------------------------------------------------------------------------


async def fetch_dp_size(client: httpx.AsyncClient, url: str) -> int:
    """The DP size of the mesh's prefill instance (the largest, if several), else of its decode
    instance (agg), from GET /mesh."""
    try:
        resp = await client.get(f"{url}/mesh")
        resp.raise_for_status()
        rows = resp.json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise ValueError(
            f"GET {url}/mesh failed ({type(e).__name__}: {e}): pass --dp-size"
        ) from None
    for role in ("prefill", "decode"):
        sizes = [int(r.get("dp_size", 1)) for r in rows if r.get("role") == role]
        if sizes:
            return max(sizes)
    raise ValueError(f"GET {url}/mesh lists no prefill or decode rank: pass --dp-size")


async def send_copies(
    sender: Issuer, copies: Sequence[Copy], jobs: Sequence[Sequence[Job]]
) -> tuple[list[Result], float]:
    """Send each copy at its time (`jobs[rank][index]` pinned to its rank); (results, seconds)."""
    t0 = sender.clock()
    tasks = []
    for c in copies:
        at = t0 + c.send_s
        delay = at - sender.clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(sender.issue(jobs[c.rank][c.index], at, c.rank)))
    results = list(await asyncio.gather(*tasks))
    return results, sender.clock() - t0


async def run_replay(
    sender: Issuer,
    workload: Workload,
    arrivals: list[float],
    replay: tuple[int, str, str, float],
    dp_size: int,
    seed: int,
) -> dict[str, Any]:
    """One replay: the jobs that arrive in `arrivals`, once per rank with `copy_seed` prompts."""
    number, name, kind, lag = replay
    jobs = [
        workload.jobs(copy_seed(seed, number, rank))[: len(arrivals)] for rank in range(dp_size)
    ]
    copies = schedule_copies(arrivals, dp_size, lag)
    print(f"bench serve: replay {name}: {len(copies)} copies on {dp_size} ranks", file=sys.stderr)
    results, duration = await send_copies(sender, copies, jobs)
    ranks = rank_figures(results, dp_size)
    throughput, busy = prefill_throughput(ranks)
    return {
        "name": name,
        "kind": kind,
        "lag_s": lag,
        **summarize(results, duration, sender.errors, workload.reusable()),
        "ranks": ranks,
        "prefill_tokens_per_s": throughput,
        "busy_s": busy,
    }


async def run_replays(
    o: ServeOptions, client: httpx.AsyncClient, workload: Workload, config: dict[str, Any]
) -> dict[str, Any]:
    """Every replay of `o.dp_replay`, one after the other against the same mesh; the result dict
    that `--json` writes."""
    url, model = config["url"], config["model"]
    dp_size = o.dp_size or await fetch_dp_size(client, url)
    senders: list[Sender] = []

    def new_sender(total: int) -> Sender:
        ignore_eos = senders[-1].ignore_eos if senders else True  # dropped once if refused
        senders.append(
            Sender(client, f"{url}/v1/completions", model, o.timeout_s, total, o.progress_every)
        )
        senders[-1].ignore_eos = ignore_eos
        return senders[-1]

    result = await replay_all(o, workload, config, dp_size, new_sender)
    result["config"]["ignore_eos_sent"] = senders[-1].ignore_eos if senders else True
    return result


async def replay_all(
    o: ServeOptions,
    workload: Workload,
    config: dict[str, Any],
    dp_size: int,
    new_sender: Callable[[int], Issuer],
) -> dict[str, Any]:
    """The replays of `o.dp_replay` through senders from `new_sender(total requests)` (HTTP, or
    the simulator's mesh)."""
    arrivals = list(workload.arrivals or [])
    if o.duration_s is not None:
        arrivals = [a for a in arrivals if a <= o.duration_s]
    replays: list[dict[str, Any]] = []
    for number, (name, kind, lag) in enumerate(replays_of(o.dp_replay or "", o.lag_s, o.dp_rounds)):
        if replays:
            await asyncio.sleep(SETTLE_S)
        sender = new_sender(len(arrivals) * dp_size)
        replays.append(
            await run_replay(sender, workload, arrivals, (number, name, kind, lag), dp_size, o.seed)
        )
    return {
        "num_requests": sum(r["num_requests"] for r in replays),
        "num_completed": sum(r["num_completed"] for r in replays),
        "num_errors": sum(r["num_errors"] for r in replays),
        "dp_replay": {
            "mode": o.dp_replay,
            "dp_size": dp_size,
            "lag_s": o.lag_s,
            "replays": replays,
            "imbalance_cost": imbalance_cost(replays),
            "prefill_tokens_per_s_definition": THROUGHPUT_DEFINITION,
        },
        "config": {**config, "dp_size": dp_size},
        "scaling": workload.info,
    }


# ----- printing --------------------------------------------------------------------------------


def _ms(d: dict[str, float | None]) -> str:
    return "  ".join(
        f"{k} {'n/a' if d[k] is None else f'{d[k]:.1f}'}" for k in ("p50", "p90", "mean")
    )


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "n/a" if value is None else format(value, fmt)


def print_report(result: dict[str, Any]) -> None:
    """The replays, their ranks and the imbalance cost."""
    c, dp = result["config"], result["dp_replay"]
    print(
        f"bench serve --dp-replay {dp['mode']}: {c['model']} at {c['url']}, DP {dp['dp_size']}, "
        f"lag {dp['lag_s']} s per rank, {result['num_completed']}/{result['num_requests']} copies "
        f"completed"
    )
    for r in dp["replays"]:
        done = f"{r['num_completed']}/{r['num_requests']}"
        print(
            f"  {r['name']:<9} {done} in {r['duration_s']:.1f} s; "
            f"prefill {_num(r['prefill_tokens_per_s'])} prompt tokens/s over "
            f"{_num(r['busy_s'], '.2f')} s busy; TTFT ms {_ms(r['ttft_ms'])}"
        )
        for k in r["ranks"]:
            print(
                f"    rank {k['rank']}: {k['num_completed']}/{k['num_requests']}, busy "
                f"{_num(k['busy_s'], '.2f')} s, {_num(k['prompt_tokens_per_s'])} tokens/s, TTFT ms "
                f"{_ms(k['ttft_ms'])}"
            )
        print_tokens(r)
        if r["cached_input_tokens"] > (r["reusable_input_tokens"] or 0):
            print(
                "    warning: more tokens cached than the replay's own reusable prefix: prompts of "
                "an earlier run on this mesh? (use another --seed)"
            )
        for message in r["error_messages"]:
            print(f"    error: {message}")
    cost = dp["imbalance_cost"]
    if cost is not None:
        print(
            f"  imbalance cost: {_percent(cost['throughput'])} of prefill throughput; TTFT "
            f"lag/mirror p50 {_num(cost['ttft_p50_ratio'], '.3f')}, "
            f"p90 {_num(cost['ttft_p90_ratio'], '.3f')}, "
            f"mean {_num(cost['ttft_mean_ratio'], '.3f')}; "
            f"mirror spread {_percent(cost['mirror_spread'])}"
        )
        if len(cost["per_round"]) > 1:
            rounds = ", ".join(f"{k['lag']} {_percent(k['throughput'])}" for k in cost["per_round"])
            print(f"  per round (each lag against the mirrors next to it): {rounds}")


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"
