"""`pdmesh bench overload` against a fake gateway on an in-process httpx.MockTransport (no sockets):
it streams completions while fewer than K are in flight and sheds (429, Retry-After: 1) beyond;
/metrics and /mesh change as the run goes. Plus the pure figures on hand-made records."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pdmesh.cli.main import main
from pdmesh_bench import overload
from pdmesh_bench import overload_report as report
from pdmesh_bench.overload_report import GatewaySample, OverloadOptions, Record

SHORT_LEN = 3  # the short client's prompt length: the fake tells its requests apart by it
CPU_PER_S = 0.25  # the fake gateway's process_cpu_seconds_total grows this fast


@dataclass
class FakeGateway:
    """Completions of `num_chunks` token chunks, `chunk_s` apart, while fewer than `max_in_flight`
    stream; beyond, 429 with Retry-After: 1. The first attempt of every short request is shed too
    (so the short client must retry). `has_metrics` False: /metrics and /mesh answer 404."""

    max_in_flight: int = 6
    num_chunks: int = 4
    chunk_s: float = 0.01
    has_metrics: bool = True
    num_in_flight: int = 0
    num_shed: int = 0
    num_scrapes: int = 0
    num_mesh_reads: int = 0
    short_seen: set[tuple[int, ...]] = field(default_factory=set)
    waiting_served: list[int] = field(default_factory=list)  # the gauge's value at each scrape
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.shed_counter = Counter(
            "pdmesh_gateway_requests_shed", "shed", ["reason"], registry=self.registry
        )
        lag = Gauge("pdmesh_gateway_event_loop_lag_max_seconds", "lag", registry=self.registry)
        lag.set_function(lambda: 0.001 * (self.num_scrapes % 5))
        waiting = Gauge("pdmesh_gateway_requests_waiting", "waiting", registry=self.registry)
        waiting.set_function(self._waiting)

    def _waiting(self) -> int:
        self.waiting_served.append(self.num_in_flight)
        return self.num_in_flight

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        if path in ("/metrics", "/mesh") and not self.has_metrics:
            return httpx.Response(404)
        if path == "/metrics":
            self.num_scrapes += 1
            cpu = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total "
            text = (
                generate_latest(self.registry).decode()
                + cpu
                + f"{CPU_PER_S * time.perf_counter()}\n"
            )
            return httpx.Response(200, text=text)
        if path == "/mesh":
            self.num_mesh_reads += 1
            return httpx.Response(200, json={"instances": self._instances()})
        return self._complete(json.loads(request.content))

    def _instances(self) -> list[dict[str, Any]]:
        n = self.num_mesh_reads
        rows = (("decode", n), ("decode", 2 * n), ("prefill", 100 * n))
        return [{"role": role, "stats": {"num_lease_expiries": k}} for role, k in rows]

    def _complete(self, body: dict[str, Any]) -> httpx.Response:
        assert body["stream"] and body["ignore_eos"]
        prompt = tuple(body["prompt"])
        first_short = len(prompt) == SHORT_LEN and prompt not in self.short_seen
        self.short_seen.add(prompt)
        if first_short or self.num_in_flight >= self.max_in_flight:
            self.num_shed += 1
            self.shed_counter.labels(reason="full").inc()
            error = {"error": {"message": "queue full", "type": "overloaded_error"}}
            return httpx.Response(429, json=error, headers={"Retry-After": "1"})
        self.num_in_flight += 1
        return httpx.Response(
            200, content=self._stream(), headers={"content-type": "text/event-stream"}
        )

    async def _stream(self) -> AsyncIterator[bytes]:
        """Token chunks, then usage and [DONE]; it leaves the in-flight count before the last
        yield (the client stops reading at [DONE], so nothing after that yield runs)."""
        for _ in range(self.num_chunks):
            await asyncio.sleep(self.chunk_s)
            chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        self.num_in_flight -= 1
        usage = {"prompt_tokens": 1, "completion_tokens": self.num_chunks}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()

    def client_factory(self) -> overload.ClientFactory:
        def make(_connections: int) -> httpx.AsyncClient:
            return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

        return make


FAST = OverloadOptions(
    url="http://127.0.0.1:1",
    loads=(1.0, 4.0),
    capacity_concurrency=4,
    capacity_s=0.5,
    phase_s=1.5,
    warmup_s=0.5,
    input_len=16,
    output_len=4,
    timeout_s=5.0,
    short_at=4.0,
    short_rate=2.0,
    short_input_len=SHORT_LEN,
    short_output_len=2,
    scrape_s=0.1,
    progress_s=0.4,
    vocab_size=64,
)


def test_overload_run_against_a_fake_gateway(capsys: pytest.CaptureFixture) -> None:
    fake = FakeGateway()
    result = overload.run_benchmark(FAST, fake.client_factory())
    json.dumps(result)  # the --json file
    cap = result["capacity"]
    assert cap["measured"] and cap["num_errors"] == 0
    assert cap["rps"] == pytest.approx(cap["num_completed"] / cap["duration_s"])
    # 4 in flight, each >= 4 chunks * 10 ms: at most 100 req/s
    assert 10 < cap["rps"] < 100
    assert cap["output_tokens_per_s"] == pytest.approx(4 * cap["rps"])

    one, four = result["phases"]
    assert one["multiple"] == 1.0 and four["multiple"] == 4.0
    assert four["rate_rps"] == pytest.approx(4 * cap["rps"])
    for phase in (one, four):
        assert phase["num_sent"] == (
            phase["num_completed"]
            + phase["num_shed"]
            + phase["num_timed_out"]
            + phase["num_errors"]
        )
        assert phase["num_errors"] == 0 and phase["num_timed_out"] == 0
        assert phase["lease_expiries"] == 3  # decode ranks 1 + 2 per /mesh read; not prefill
        assert phase["gateway_cpu_s_per_s"] == pytest.approx(CPU_PER_S, abs=0.02)
        assert phase["num_scrapes"] >= 5
        assert phase["loop_lag_ms"]["max"] == pytest.approx(4.0)
        assert phase["ttft_ms"]["p50"] >= 10.0  # the first chunk comes 10 ms after the send
    assert one["goodput_of_1x"] == 1.0
    assert four["goodput_of_1x"] == pytest.approx(
        four["goodput_tokens_per_s"] / one["goodput_tokens_per_s"]
    )
    assert four["num_shed"] > 0 and four["retry_after_share"] == 1.0
    assert 0 < four["shed_latency_ms"]["p50"] <= four["shed_latency_ms"]["max"]
    # the largest of the values the scrapes read (not a count of the bench's own)
    assert four["waiting_max"] in fake.waiting_served and four["waiting_max"] >= 1
    short = four["short"]
    assert one["short"] is None
    assert short["num_sent"] == 3 and short["num_completed"] == 3  # at 0, 0.5 and 1 s
    assert short["num_429"] >= 3  # each shed at least once, retried after Retry-After: 1
    assert short["ttft_ms"]["p50"] >= 1000.0  # from the first send: the retry wait included
    # the gateway's shed counter over the phase: the flood's 429s and the short client's
    assert four["gateway_shed_by_reason"] == {"full": four["num_shed"] + short["num_429"]}
    assert one["gateway_shed_by_reason"] in ({}, {"full": one["num_shed"]})
    assert result["client"]["pid"] == os.getpid()
    assert result["client"]["cpu_affinity"] == sorted(os.sched_getaffinity(0))
    report.print_report(result)
    out, err = capsys.readouterr()
    assert "short client 2 req/s: 3/3 completed" in out
    assert "phase 4x" in err and "capacity: " in err and " shed" in err


def test_missing_gateway_series_are_null() -> None:
    fake = FakeGateway(has_metrics=False)
    options = replace(FAST, loads=(1.0,), capacity_rps=20.0, phase_s=0.6, warmup_s=0.2)
    result = overload.run_benchmark(options, fake.client_factory())
    assert result["capacity"] == {"measured": False, "rps": 20.0, "output_tokens_per_s": None}
    (phase,) = result["phases"]
    assert phase["num_completed"] > 0 and phase["goodput_of_1x"] == 1.0
    for key in ("gateway_cpu_s_per_s", "waiting_max", "gateway_shed_by_reason", "lease_expiries"):
        assert phase[key] is None
    assert phase["loop_lag_ms"] == {"max": None, "p99": None, "max_queued": None}
    report.print_report(result)  # nulls print as "-"

    only_cpu = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3.5\n"
    sample = report.parse_metrics(only_cpu, 1.0)
    assert sample == GatewaySample(1.0, cpu_s=3.5)
    assert report.decode_lease_expiries({"instances": [{"role": "decode"}]}) is None


def test_goodput_counts_window_tokens_of_completed_requests_only() -> None:
    records = [
        Record(100.0, report.COMPLETED, [100.5, 101.5, 102.5, 103.5], 4),  # 2 in the window
        Record(100.0, report.TIMED_OUT, [101.1, 101.2, 101.3], 3),  # not completed: none
        Record(100.0, report.COMPLETED, [101.2, 104.0], 4),  # 2 tokens per chunk: 2
        Record(100.0, report.SHED, shed_latency_s=0.01, has_retry_after=True),
        Record(101.0, report.COMPLETED, [101.0, 103.0], 2),  # both edges count: 2
    ]
    # window [start + warmup, start + phase] = [101, 103]: 6 tokens over 2 s
    assert report.goodput_tokens_per_s(records, 101.0, 103.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="window"):
        report.goodput_tokens_per_s(records, 2.0, 2.0)
    phases = [
        {"multiple": 1.5, "goodput_tokens_per_s": 30.0},
        {"multiple": 3.0, "goodput_tokens_per_s": 15.0},
    ]
    report.add_relative_goodput(phases)  # no 1x phase: relative to the first
    assert [p["goodput_of_1x"] for p in phases] == [1.0, 0.5]


def test_gateway_figures_from_two_scrapes() -> None:
    first = GatewaySample(10.0, cpu_s=5.0, shed_by_reason={"full": 2.0})
    last = GatewaySample(12.0, cpu_s=6.5, shed_by_reason={"full": 7.0, "wait": 1.0})
    assert report.cpu_per_s(first, last) == pytest.approx(0.75)
    assert report.shed_delta(first, last) == {"full": 5.0, "wait": 1.0}
    assert report.cpu_per_s(first, GatewaySample(12.0)) is None
    assert report.shed_delta(GatewaySample(10.0), last) is None
    assert report.retry_after_s("3") == 3 and report.retry_after_s(None) is None
    assert report.retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert report.stats_ms([0.001, 0.003], ("p50", "max")) == {
        "p50": pytest.approx(2.0),
        "max": pytest.approx(3.0),
    }


@pytest.mark.skipif(
    overload.autogroup_nice() is None or os.geteuid() != 0,
    reason="needs Linux autogroup scheduling and root",
)
def test_client_nice_reaches_the_session_scheduling_group_and_is_set_back() -> None:
    before_group = overload.autogroup_nice()
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        with overload.client_priority(-3):
            assert os.getpriority(os.PRIO_PROCESS, 0) == -3
            assert overload.autogroup_nice() == -3
            assert overload.client_info()["autogroup_nice"] == -3
        assert overload.autogroup_nice() == before_group
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


def test_the_client_measures_its_own_loop_lag() -> None:
    async def run() -> list[float]:
        lags: list[float] = []
        stop = asyncio.Event()
        watch = asyncio.create_task(overload.watch_own_lag(lags, stop))
        await asyncio.sleep(0.12)
        time.sleep(0.3)  # the loop is blocked: the probe's timer fires late
        await asyncio.sleep(0.12)
        stop.set()
        await watch
        return lags

    lags = asyncio.run(run())
    assert max(lags) >= 0.2 and len(lags) >= 3


def test_lag_while_queued_leaves_out_the_phase_start_and_drain() -> None:
    samples = [  # (waiting, lag): a start, a queue that peaks at 100, a drain, a failed scrape
        GatewaySample(float(i), loop_lag_s=lag, num_waiting=waiting)
        for i, (waiting, lag) in enumerate(
            [(10, 0.2), (60, 0.01), (100, 0.02), (50, 0.03), (49, 0.4), (5, 0.3)]
        )
    ] + [GatewaySample(9.0, loop_lag_s=0.9)]
    assert report.lag_while_queued_ms(samples) == pytest.approx(30.0)
    assert report.lag_while_queued_ms(samples[-1:]) is None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"loads": (1.0, 0.0)}, "--loads"),
        ({"phase_s": 5.0, "warmup_s": 5.0}, "--phase-s > --warmup-s"),
        ({"warmup_s": -1.0}, "--warmup-s >= 0"),
        ({"capacity_rps": 0.0}, "--capacity-rps"),
        ({"capacity_concurrency": 0}, "--capacity-concurrency"),
        ({"short_rate": 0.0}, "--short-rate"),
        ({"scrape_s": float("nan")}, "--scrape-s"),
        ({"max_inflight": 0}, "--max-inflight"),
        ({"short_at": -1.0}, "--short-at"),
        ({"url": "http://10.1.2.3:8000"}, "non-loopback"),
        ({"client_cpus": "3-1"}, "--client-cpus"),
        ({"client_cpus": str(os.cpu_count() or 1)}, "not present"),
    ],
)
def test_options_are_validated(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        overload.run_benchmark(replace(FAST, **changes))


def test_cli_parses_and_rejects_bad_options(capsys: pytest.CaptureFixture) -> None:
    assert report.parse_loads("1,1.5,3") == (1.0, 1.5, 3.0)
    assert report.parse_cpus("0") == {0}
    with pytest.raises(ValueError, match="comma-separated"):
        report.parse_loads("1,x")
    assert main(["bench", "overload", "--loads", "1,-2"]) == 2
    assert main(["bench", "overload", "--phase-s", "5", "--warmup-s", "6"]) == 2
    assert "--phase-s > --warmup-s" in capsys.readouterr().err
