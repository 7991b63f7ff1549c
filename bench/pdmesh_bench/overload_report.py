"""The pure half of `pdmesh bench overload` (definitions in `pdmesh_bench.overload`): its options
and their checks, request records, gateway scrapes, one phase's figures and the printed table. No
socket and no clock here: callers pass the times."""

from __future__ import annotations

import argparse
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdmesh_bench.serve import check_host
from pdmesh_bench.traces import percentile_of

COMPLETED, SHED, TIMED_OUT, ERROR = "completed", "shed", "timed_out", "error"
OUTCOMES = (COMPLETED, SHED, TIMED_OUT, ERROR)

CPU_SERIES = "process_cpu_seconds_total"
LAG_SERIES = "pdmesh_gateway_event_loop_lag_max_seconds"  # max loop lag over the last second
WAITING_SERIES = "pdmesh_gateway_requests_waiting"
SHED_SERIES = "pdmesh_gateway_requests_shed_total"  # label `reason`
SHED_FAMILIES = (SHED_SERIES, SHED_SERIES.removesuffix("_total"))  # the parser drops `_total`
MAX_ERROR_MESSAGES = 5


@dataclass(frozen=True)
class OverloadOptions:
    url: str = "http://127.0.0.1:8000"
    loads: tuple[float, ...] = (1.0, 1.5, 3.0, 10.0)  # multiples of the capacity
    capacity_concurrency: int = 32
    capacity_s: float = 60.0
    capacity_rps: float | None = None  # given: no capacity phase
    phase_s: float = 60.0
    warmup_s: float = 10.0  # goodput counts from phase start + warmup_s
    input_len: int = 512
    output_len: int = 64
    timeout_s: float = 300.0  # per request, the whole stream
    max_inflight: int = 4000  # connections
    short_at: float = 3.0  # the short client runs in the phase at this multiple (0: never)
    short_rate: float = 1.0
    short_input_len: int = 32
    short_output_len: int = 8
    scrape_s: float = 1.0
    progress_s: float = 10.0
    client_cpus: str | None = None  # "1", "2-3", "0,4-5": pin this process to these CPUs
    client_nice: int | None = None  # this process's nice value (negative: ahead of the mesh)
    vocab_size: int = 1024  # prompt token ids are drawn from [16, vocab_size)
    seed: int = 0
    model: str | None = None  # default: the first of GET /v1/models
    allow_remote: bool = False
    json: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OverloadOptions:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["loads"] = parse_loads(str(values.get("loads", "1,1.5,3,10")))
        if values.get("json") is not None:
            values["json"] = str(values["json"])
        return cls(**values)


def parse_loads(text: str) -> tuple[float, ...]:
    """`1,1.5,3` -> (1.0, 1.5, 3.0); each a finite multiple > 0."""
    try:
        loads = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--loads must be comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(m) and m > 0 for m in loads):
        raise ValueError(f"--loads must all be > 0, got {text!r}")
    return loads


def parse_cpus(text: str) -> set[int]:
    """`0,2-3` -> {0, 2, 3}; every CPU must be present on this machine (below os.cpu_count())."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"--client-cpus must look like 1 or 2-3 or 0,4-5, got {text!r}") from None
    missing = sorted(cpus - set(range(os.cpu_count() or 1)))
    if missing:
        raise ValueError(f"--client-cpus: CPUs {missing} are not present ({os.cpu_count()} CPUs)")
    return cpus


def validate(o: OverloadOptions) -> None:
    """Every option's range (ValueError naming the option); the URL must be loopback unless
    `allow_remote`."""
    check_host(o.url, o.allow_remote)
    if not o.loads or not all(math.isfinite(m) and m > 0 for m in o.loads):
        raise ValueError(f"--loads must be multiples > 0, got {o.loads}")
    if not (math.isfinite(o.phase_s) and o.phase_s > o.warmup_s >= 0):
        raise ValueError(f"need --phase-s > --warmup-s >= 0, got {o.phase_s} and {o.warmup_s}")
    positive = {
        "--capacity-s": o.capacity_s,
        "--timeout-s": o.timeout_s,
        "--short-rate": o.short_rate,
        "--scrape-s": o.scrape_s,
        "--progress-s": o.progress_s,
        "--capacity-rps": 1.0 if o.capacity_rps is None else o.capacity_rps,
    }
    for name, value in positive.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be > 0, got {value}")
    counts = {
        "--capacity-concurrency": o.capacity_concurrency,
        "--input-len": o.input_len,
        "--output-len": o.output_len,
        "--max-inflight": o.max_inflight,
        "--short-input-len": o.short_input_len,
        "--short-output-len": o.short_output_len,
    }
    for name, count in counts.items():
        if count < 1:
            raise ValueError(f"{name} must be >= 1, got {count}")
    if not (math.isfinite(o.short_at) and o.short_at >= 0):
        raise ValueError(f"--short-at must be >= 0 (0: no short client), got {o.short_at}")
    if o.vocab_size < 2:
        raise ValueError(f"--vocab-size must be >= 2, got {o.vocab_size}")
    if o.client_cpus is not None:
        parse_cpus(o.client_cpus)
    if o.client_nice is not None and not -20 <= o.client_nice <= 19:
        raise ValueError(f"--client-nice must be in [-20, 19], got {o.client_nice}")


def retry_after_s(value: str | None) -> int | None:
    """`Retry-After` as integer seconds; None if absent or not an integer (an HTTP date)."""
    if value is None or not value.strip().isdigit():
        return None
    return int(value.strip())


def poisson_offsets(rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival offsets in [0, duration_s) of a Poisson process of `rate` per second."""
    offsets: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


@dataclass(frozen=True)
class Shed:
    """A 429 answer: how long it took from the send, and its `Retry-After` (None: absent)."""

    latency_s: float
    retry_after_s: int | None


@dataclass(slots=True)
class Record:
    """One open-loop request of a phase (times: `time.perf_counter` seconds)."""

    arrival: float  # its scheduled send
    outcome: str = ERROR  # one of OUTCOMES
    token_times: list[float] = field(default_factory=list)  # one per chunk carrying a token
    output_tokens: int = 0  # usage.completion_tokens, else the number of token chunks
    shed_latency_s: float | None = None  # 429 only: from the send to the response
    has_retry_after: bool = False  # 429 only: it carried `Retry-After` as integer seconds
    error: str | None = None


@dataclass(slots=True)
class ShortRecord:
    """One request of the short-request client; its 429s were retried (not part of the flood)."""

    first_send: float  # perf_counter of its first attempt
    outcome: str = ERROR
    ttft_s: float | None = None  # first token - first_send (retries included)
    num_429: int = 0


@dataclass(frozen=True)
class GatewaySample:
    """One scrape of the gateway's /metrics; None: the series was missing or the scrape failed."""

    at: float  # perf_counter when the answer arrived
    cpu_s: float | None = None
    loop_lag_s: float | None = None
    num_waiting: float | None = None
    shed_by_reason: dict[str, float] | None = None  # {}: the counter exists, nothing shed yet


@dataclass
class PhaseRun:
    """What one open-loop phase produced; its window is [start, start + phase_s]."""

    multiple: float
    rate_rps: float
    start: float
    phase_s: float
    warmup_s: float
    duration_s: float  # from start until every request of the phase finished
    records: list[Record]
    samples: list[GatewaySample]  # every scrape, in time order
    first: GatewaySample  # at the start
    window_end: GatewaySample  # when the arrivals ended (start + phase_s)
    last: GatewaySample  # once the phase drained
    lease_expiries: tuple[int | None, int | None]  # decode ranks' sum at the start and the end
    short: list[ShortRecord] | None = None  # None: the short client did not run in this phase
    short_rate: float = 0.0
    client_lags: list[float] = field(default_factory=list)  # this client's own loop lag, s


def parse_metrics(text: str, at: float) -> GatewaySample:
    """The series the benchmark reads from Prometheus exposition `text` (ValueError if
    malformed)."""
    values: dict[str, float] = {}
    shed: dict[str, float] | None = None
    for family in text_string_to_metric_families(text):
        if family.name in SHED_FAMILIES:
            found = {} if shed is None else shed
            for sample in family.samples:
                if sample.name == SHED_SERIES:
                    reason = sample.labels.get("reason", "")
                    found[reason] = found.get(reason, 0.0) + sample.value
            shed = found
            continue
        for sample in family.samples:
            if sample.name in (CPU_SERIES, LAG_SERIES, WAITING_SERIES) and not sample.labels:
                values[sample.name] = sample.value
    return GatewaySample(
        at, values.get(CPU_SERIES), values.get(LAG_SERIES), values.get(WAITING_SERIES), shed
    )


def decode_lease_expiries(mesh: Any) -> int | None:
    """The sum of `stats.num_lease_expiries` over the decode ranks of a GET /mesh answer; None if
    it is not shaped as expected."""
    try:
        return sum(
            int(i["stats"]["num_lease_expiries"])
            for i in mesh["instances"]
            if i.get("role") == "decode"
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def goodput_tokens_per_s(
    records: Sequence[Record], window_start: float, window_end: float
) -> float:
    """Output tokens whose timestamps lie in [window_start, window_end], of completed requests
    only, per second of the window. A chunk counts output_tokens / chunks tokens (1 when the
    server streams one token per chunk)."""
    if window_end <= window_start:
        raise ValueError(f"empty goodput window [{window_start}, {window_end}]")
    tokens = 0.0
    for r in records:
        if r.outcome != COMPLETED or not r.token_times:
            continue
        per_chunk = max(r.output_tokens, len(r.token_times)) / len(r.token_times)
        tokens += per_chunk * sum(window_start <= t <= window_end for t in r.token_times)
    return tokens / (window_end - window_start)


def cpu_per_s(first: GatewaySample, last: GatewaySample) -> float | None:
    """Gateway CPU seconds per wall second between two scrapes (None if either lacks the CPU)."""
    if first.cpu_s is None or last.cpu_s is None or last.at <= first.at:
        return None
    return (last.cpu_s - first.cpu_s) / (last.at - first.at)


def shed_delta(first: GatewaySample, last: GatewaySample) -> dict[str, float] | None:
    """Requests shed per reason between two scrapes (a reason absent at first counts from 0)."""
    if first.shed_by_reason is None or last.shed_by_reason is None:
        return None
    return {r: n - first.shed_by_reason.get(r, 0.0) for r, n in last.shed_by_reason.items()}


def stats_ms(values_s: Sequence[float], keys: Sequence[str]) -> dict[str, float | None]:
    """The `keys` among p50/p90/p99/max of values given in seconds, in ms; None when empty."""
    out: dict[str, float | None] = {}
    for key in keys:
        if not values_s:
            out[key] = None
        elif key == "max":
            out[key] = max(values_s) * 1e3
        else:
            out[key] = percentile_of(values_s, float(key[1:])) * 1e3
    return out


def lag_while_queued_ms(samples: Sequence[GatewaySample]) -> float | None:
    """The largest loop lag (ms) among the scrapes that saw at least half the phase's largest
    queue: the lag that queue costs, apart from what the phase's start and drain cost."""
    seen = [s for s in samples if s.loop_lag_s is not None and s.num_waiting is not None]
    peak = max((s.num_waiting or 0.0 for s in seen), default=0.0)
    lags = [s.loop_lag_s or 0.0 for s in seen if peak > 0 and (s.num_waiting or 0.0) >= peak / 2]
    return max(lags) * 1e3 if lags else None


def summarize_phase(run: PhaseRun) -> dict[str, Any]:
    """One phase's row of the report (JSON keys as in `pdmesh_bench.overload`'s docstring)."""
    counts = {o: sum(r.outcome == o for r in run.records) for o in OUTCOMES}
    completed = [r for r in run.records if r.outcome == COMPLETED and r.token_times]
    sheds = [r for r in run.records if r.outcome == SHED]
    shed_latencies = [r.shed_latency_s for r in sheds if r.shed_latency_s is not None]
    lags = [s.loop_lag_s for s in run.samples if s.loop_lag_s is not None]
    waiting = [s.num_waiting for s in run.samples if s.num_waiting is not None]
    lease_first, lease_last = run.lease_expiries
    window = (run.start + run.warmup_s, run.start + run.phase_s)
    return {
        "multiple": run.multiple,
        "rate_rps": run.rate_rps,
        "duration_s": run.duration_s,
        "num_sent": len(run.records),
        "num_completed": counts[COMPLETED],
        "num_shed": counts[SHED],
        "num_timed_out": counts[TIMED_OUT],
        "num_errors": counts[ERROR],
        "goodput_tokens_per_s": goodput_tokens_per_s(run.records, *window),
        "goodput_of_1x": None,  # filled in by `add_relative_goodput`
        "ttft_ms": stats_ms(
            [r.token_times[0] - r.arrival for r in completed], ("p50", "p90", "p99")
        ),
        "shed_latency_ms": stats_ms(shed_latencies, ("p50", "p99", "max")),
        "retry_after_share": sum(r.has_retry_after for r in sheds) / len(sheds) if sheds else None,
        "gateway_cpu_s_per_s": cpu_per_s(run.first, run.window_end),
        "loop_lag_ms": {
            **stats_ms(lags, ("max", "p99")),
            "max_queued": lag_while_queued_ms(run.samples),
        },
        "waiting_max": max(waiting) if waiting else None,
        "client_lag_ms": stats_ms(run.client_lags, ("max", "p99")),
        "num_scrapes": len(run.samples),
        "gateway_shed_by_reason": shed_delta(run.first, run.last),
        "lease_expiries": None
        if lease_first is None or lease_last is None
        else lease_last - lease_first,
        "short": None if run.short is None else summarize_short(run.short, run.short_rate),
        "error_messages": [r.error for r in run.records if r.error][:MAX_ERROR_MESSAGES],
    }


def summarize_short(records: Sequence[ShortRecord], rate: float) -> dict[str, Any]:
    ttft = [r.ttft_s for r in records if r.outcome == COMPLETED and r.ttft_s is not None]
    return {
        "rate_rps": rate,
        "num_sent": len(records),
        "num_completed": sum(r.outcome == COMPLETED for r in records),
        "num_timed_out": sum(r.outcome == TIMED_OUT for r in records),
        "num_errors": sum(r.outcome == ERROR for r in records),
        "num_429": sum(r.num_429 for r in records),
        "ttft_ms": stats_ms(ttft, ("p50", "p90")),
    }


def add_relative_goodput(phases: list[dict[str, Any]]) -> None:
    """Set each phase's `goodput_of_1x`: its goodput / that of the phase at multiple 1 (if none,
    the first phase); None when that goodput is 0."""
    if not phases:
        return
    ones = [p for p in phases if math.isclose(p["multiple"], 1.0)]
    base = (ones or phases)[0]["goodput_tokens_per_s"]
    for p in phases:
        p["goodput_of_1x"] = p["goodput_tokens_per_s"] / base if base > 0 else None


def capacity_figures(
    num_completed: int, num_errors: int, output_tokens: int, duration_s: float
) -> dict[str, Any]:
    """The closed-loop capacity: completed requests and their output tokens per elapsed second."""
    duration_s = max(duration_s, 1e-9)
    return {
        "measured": True,
        "rps": num_completed / duration_s,
        "output_tokens_per_s": output_tokens / duration_s,
        "num_completed": num_completed,
        "num_errors": num_errors,
        "duration_s": duration_s,
    }


def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(result: dict[str, Any]) -> None:
    c, cap = result["config"], result["capacity"]
    how = "measured" if cap["measured"] else "given"
    print(
        f"bench overload: {c['model']} at {c['url']}; capacity ({how}) {cap['rps']:.2f} req/s, "
        f"{_f(cap.get('output_tokens_per_s'))} output tok/s; client pid {result['client']['pid']}, "
        f"cpus {result['client']['cpu_affinity']}, nice {result['client'].get('nice')}"
    )
    print(
        f"{'load':>5} {'req/s':>7} {'sent':>6} {'done':>6} {'shed':>6} {'t/o':>5} {'err':>5} "
        f"{'goodput':>8} {'%1x':>5} {'ttft p50/p90/p99 ms':>21} {'shed p50/p99/max ms':>20} "
        f"{'RA%':>4} {'cpu':>5} {'lag max/p99/queued':>18} {'wait':>5} {'lease':>5} {'clag':>5}"
    )
    for p in result["phases"]:
        t, s, lag = p["ttft_ms"], p["shed_latency_ms"], p["loop_lag_ms"]
        share = p["retry_after_share"]
        of_1x = p["goodput_of_1x"]
        print(
            f"{p['multiple']:>4g}x {p['rate_rps']:>7.2f} {p['num_sent']:>6} "
            f"{p['num_completed']:>6} {p['num_shed']:>6} {p['num_timed_out']:>5} "
            f"{p['num_errors']:>5} {p['goodput_tokens_per_s']:>8.1f} "
            f"{_f(None if of_1x is None else 100 * of_1x, '.0f'):>5} "
            f"{_f(t['p50'], '.0f') + '/' + _f(t['p90'], '.0f') + '/' + _f(t['p99'], '.0f'):>21} "
            f"{_f(s['p50']) + '/' + _f(s['p99']) + '/' + _f(s['max']):>20} "
            f"{_f(None if share is None else 100 * share, '.0f'):>4} "
            f"{_f(p['gateway_cpu_s_per_s'], '.2f'):>5} "
            f"{_f(lag['max']) + '/' + _f(lag['p99']) + '/' + _f(lag['max_queued']):>18} "
            f"{_f(p['waiting_max'], '.0f'):>5} "
            f"{_f(p['lease_expiries'], 'd'):>5} {_f(p['client_lag_ms']['max'], '.0f'):>5}"
        )
        if p["short"] is not None:
            print_short(p["short"])
        for message in p["error_messages"]:
            print(f"      error: {message}")


def print_short(s: dict[str, Any]) -> None:
    t = s["ttft_ms"]
    print(
        f"      short client {s['rate_rps']:g} req/s: {s['num_completed']}/{s['num_sent']} "
        f"completed, {s['num_429']} 429s, {s['num_timed_out']} timed out, {s['num_errors']} "
        f"errors; ttft p50 {_f(t['p50'], '.0f')} p90 {_f(t['p90'], '.0f')} ms (from first send)"
    )
