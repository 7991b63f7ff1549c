"""`pdmesh bench overload`: what a running mesh does with more load than it can serve.

Every request is a streaming `POST /v1/completions` as `pdmesh bench serve` sends it (its `Sender`
body: a prompt of random token ids, `max_tokens`, `ignore_eos`, temperature 0, usage included).
Traffic goes only to a loopback `--url` unless `--allow-remote`. The run:

1. Capacity: a closed loop of `--capacity-concurrency` requests in flight (`--input-len` prompt
   tokens, `--output-len` max tokens) for `--capacity-s` (no new request after it; those in flight
   finish). capacity_rps = completed / elapsed, capacity output tokens/s likewise (elapsed: until
   the last one finished). `--capacity-rps R` skips it and uses R.
2. Phases, one per multiple m of `--loads`, one after the other and never overlapping: Poisson
   arrivals (seeded) at m * capacity_rps for `--phase-s`, then every request of the phase is waited
   for. Open loop: a 429 is not retried. Each request's outcome: completed, shed (HTTP 429),
   timed_out (`--timeout-s`, the whole request, or an httpx timeout) or error (any other status, a
   stream error event, a stream without a token). At most `--max-inflight` connections.
3. Goodput of a phase: output tokens whose token timestamps lie in the window
   [start + `--warmup-s`, start + `--phase-s`], of requests that completed within their timeout,
   divided by (phase_s - warmup_s). A chunk counts usage.completion_tokens / chunks tokens.
   `goodput_of_1x`: that / the goodput of the phase at multiple 1 (if none, of the first phase).
4. Short client: during the phase at multiple `--short-at`, one request every 1 / `--short-rate` s
   of `--short-input-len` / `--short-output-len` tokens, for the whole phase; on a 429 it retries
   after `Retry-After` seconds (1 s if absent) until its own `--timeout-s`. Its TTFT counts from the
   first send, retries included.
5. Gateway, scraped from `GET /metrics`: `process_cpu_seconds_total` at the phase start and when
   its arrivals end -> CPU seconds per second of the arrival window; every `--scrape-s` until the
   phase drained, the gauges `pdmesh_gateway_event_loop_lag_max_seconds` and
   `pdmesh_gateway_requests_waiting`; `pdmesh_gateway_requests_shed_total` by `reason` and, from
   `GET /mesh`, the decode ranks' sum of `num_lease_expiries`, each as the change from the phase
   start until it drained. A missing series (or failed scrape) is null, never an error.

TTFT (completed flood requests) counts from the scheduled arrival; shed latency from the send to the
429 answer; `retry_after_share`: the 429s carrying `Retry-After` as integer seconds. `--client-cpus`
pins this process (`os.sched_setaffinity`) before anything is sent; `--client-nice` sets its nice
value, and that of its session's scheduling group where Linux groups by session (autogroup; set
back on exit). On a machine too small to pin the client away from the mesh, a negative one keeps
the client's own scheduling delays out of what it measures; `client_lag_ms` says what was left.

JSON (`--json`): {"config", "client": {"pid", "cpu_affinity", "cpu_count", "nice",
"autogroup_nice"}, "capacity": {"measured", "rps", "output_tokens_per_s", "num_completed",
"num_errors", "duration_s"}, "phases":
[{"multiple", "rate_rps", "duration_s", "num_sent", "num_completed", "num_shed", "num_timed_out",
"num_errors", "goodput_tokens_per_s", "goodput_of_1x", "ttft_ms": {p50, p90, p99},
"shed_latency_ms": {p50, p99, max}, "retry_after_share", "gateway_cpu_s_per_s", "loop_lag_ms": {max,
p99, max_queued: the max among the scrapes that saw at least half of waiting_max}, "waiting_max",
"num_scrapes", "client_lag_ms": {max, p99} (this process's own loop), "gateway_shed_by_reason",
"lease_expiries", "short": null | {"rate_rps", "num_sent", "num_completed", "num_timed_out",
"num_errors", "num_429", "ttft_ms": {p50, p90}}, "error_messages"}]}. Times in ms unless named _s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from pdmesh_bench import overload_report as report
from pdmesh_bench.lean_http import LeanClient
from pdmesh_bench.overload_report import (
    GatewaySample,
    OverloadOptions,
    PhaseRun,
    Record,
    Shed,
    ShortRecord,
    parse_cpus,
    poisson_offsets,
    retry_after_s,
    validate,
)
from pdmesh_bench.serve import (
    Result,
    Sender,
    ServeOptions,
    StreamError,
    base_url,
    fetch_model,
    http_client,
    read_stream,
)
from pdmesh_bench.traces import Job, PromptBuilder

SCRAPE_TIMEOUT_S = 5.0  # one GET /metrics or /mesh; a slower answer counts as a failed scrape
DEFAULT_RETRY_AFTER_S = 1.0  # the short client's wait after a 429 without Retry-After
CLIENT_LAG_TICK_S = 0.05  # the period of the client's own loop-lag probe

ClientFactory = Callable[[int], httpx.AsyncClient]  # connections -> a client
LoadClientFactory = Callable[[int], httpx.AsyncClient | LeanClient]  # what sends the load


def register(sub: argparse._SubParsersAction) -> None:
    d = OverloadOptions
    p = sub.add_parser("overload", help="capacity, then open-loop phases beyond it")
    p.add_argument("--url", default=d.url, help="gateway base URL (default %(default)s)")
    p.add_argument("--loads", default="1,1.5,3,10", help="multiples of capacity (%(default)s)")
    p.add_argument("--capacity-concurrency", type=int, default=d.capacity_concurrency)
    p.add_argument("--capacity-s", type=float, default=d.capacity_s)
    p.add_argument("--capacity-rps", type=float, help="skip the capacity phase, use R req/s")
    p.add_argument("--phase-s", type=float, default=d.phase_s)
    p.add_argument("--warmup-s", type=float, default=d.warmup_s, help="goodput skips these")
    p.add_argument("--input-len", type=int, default=d.input_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per request")
    p.add_argument("--max-inflight", type=int, default=d.max_inflight, help="connections")
    p.add_argument("--short-at", type=float, default=d.short_at, help="0: no short client")
    p.add_argument("--short-rate", type=float, default=d.short_rate, help="req/s")
    p.add_argument("--short-input-len", type=int, default=d.short_input_len)
    p.add_argument("--short-output-len", type=int, default=d.short_output_len)
    p.add_argument("--scrape-s", type=float, default=d.scrape_s, help="gateway /metrics period")
    p.add_argument("--progress-s", type=float, default=d.progress_s, help="stderr period")
    p.add_argument("--client-cpus", help='pin this process to these CPUs, e.g. "1" or "2-3"')
    p.add_argument(
        "--client-nice", type=int, help="this process's nice value (negative needs root)"
    )
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = OverloadOptions.from_args(args)
    result = run_benchmark(options)
    report.print_report(result)
    if options.json:
        path = Path(options.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def run_benchmark(o: OverloadOptions, make_client: ClientFactory | None = None) -> dict[str, Any]:
    """Validate, pin (`--client-cpus`), run; the results dict is what `--json` writes.
    `make_client`: connections -> client for every request (default: the load goes through the
    `lean_http` client, the scrapes and `/v1/models` through `serve.http_client`)."""
    validate(o)
    if o.client_cpus is not None:
        pin_cpus(parse_cpus(o.client_cpus))
    settings = ServeOptions(url=o.url, timeout_s=o.timeout_s)

    def default_client(connections: int) -> httpx.AsyncClient:
        return http_client(settings, connections)

    with client_priority(o.client_nice):
        if make_client is not None:
            return asyncio.run(_run(o, make_client, make_client))
        return asyncio.run(_run(o, partial(LeanClient, base_url(o.url)), default_client))


# ----- the client process ----------------------------------------------------------------------


def pin_cpus(cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise ValueError(f"--client-cpus: cannot pin to {sorted(cpus)}: {e}") from None


AUTOGROUP = Path("/proc/self/autogroup")  # Linux: this session's scheduling group, and its nice


@contextlib.contextmanager
def client_priority(nice: int | None) -> Iterator[None]:
    """This process at `nice` (None: as it is). Where the kernel schedules by session groups
    (autogroup), a nice value weighs only inside the process's own group, and a mesh started in
    another session shares the CPUs with this client's whole session group evenly whatever its
    nice: so the group gets `nice` too, and its old value back on exit."""
    if nice is None:
        yield
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as e:
        raise ValueError(f"--client-nice {nice}: {e}") from None
    before = autogroup_nice()
    try:
        if before is not None:
            AUTOGROUP.write_text(str(nice))
    except OSError as e:
        print(
            f"bench overload: the session's scheduling group keeps its nice: {e}", file=sys.stderr
        )
        before = None
    try:
        yield
    finally:
        if before is not None:
            with contextlib.suppress(OSError):
                AUTOGROUP.write_text(str(before))


def autogroup_nice() -> int | None:
    """The nice value of this session's scheduling group; None where there is none."""
    try:
        return int(AUTOGROUP.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def client_info() -> dict[str, Any]:
    """How this client process runs: its pid, the CPUs it may run on now, the machine's CPUs."""
    return {
        "pid": os.getpid(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "autogroup_nice": autogroup_nice(),
    }


# ----- sending ---------------------------------------------------------------------------------


@dataclass
class Context:
    """What every phase sends with: the flood client, a small client for scrapes, the body maker
    (`Sender.body`, which drops `ignore_eos` once the server rejects it) and unique prompts."""

    options: OverloadOptions
    url: str  # base URL, no /v1
    client: httpx.AsyncClient | LeanClient  # the load
    scrape_client: httpx.AsyncClient
    sender: Sender
    builder: PromptBuilder
    num_jobs: int = 0

    def job(self, input_len: int, output_len: int) -> Job:
        """A new prompt of random token ids, unique to this job (no prefix cache hit)."""
        self.num_jobs += 1
        return Job(self.num_jobs, self.builder.unique(self.num_jobs, input_len), output_len, None)


async def attempt(ctx: Context, job: Job, result: Result) -> Shed | None:
    """One POST of `job`: None when it streamed to `[DONE]` (tokens timed into `result`), a Shed
    on 429; any other status raises StreamError."""
    sent = time.perf_counter()
    async with ctx.client.stream(
        "POST", f"{ctx.url}/v1/completions", json=ctx.sender.body(job)
    ) as resp:
        if resp.status_code == 429:
            latency = time.perf_counter() - sent
            await resp.aread()
            return Shed(latency, retry_after_s(resp.headers.get("retry-after")))
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            if resp.status_code == 400 and "ignore_eos" in text:
                ctx.sender.ignore_eos = False  # rejected: later bodies go without it (as serve)
            raise StreamError(f"HTTP {resp.status_code}: {text[:300]}")
        await read_stream(resp.aiter_lines(), result)
    if not result.token_times:
        raise StreamError("the stream ended without any token")
    return None


async def send_flood(ctx: Context, job: Job, record: Record) -> None:
    """Send one open-loop request (never retried); its outcome lands in `record`, nothing raises."""
    result = Result(job.index, record.arrival, token_times=record.token_times)
    try:
        shed = await asyncio.wait_for(attempt(ctx, job, result), ctx.options.timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        record.outcome = report.TIMED_OUT
        return
    except (httpx.HTTPError, StreamError, ValueError) as e:
        record.outcome, record.error = report.ERROR, f"{type(e).__name__}: {e}"[:300]
        return
    if shed is not None:
        record.outcome, record.shed_latency_s = report.SHED, shed.latency_s
        record.has_retry_after = shed.retry_after_s is not None
        return
    record.outcome, record.output_tokens = report.COMPLETED, result.output_tokens


async def send_polite(ctx: Context, job: Job, first_send: float) -> tuple[str, Result, int]:
    """One request as a polite client sends it: after a 429 it waits the Retry-After and tries
    again, until `--timeout-s` from its first send (so a full queue is not hammered). Returns the
    outcome, the last try's result (its times count from `first_send`, retries included; `error`
    set unless completed) and the number of 429s."""
    deadline, num_429 = first_send + ctx.options.timeout_s, 0
    result = Result(job.index, first_send)
    while (remaining := deadline - time.perf_counter()) > 0:
        result = Result(job.index, first_send)
        try:
            shed = await asyncio.wait_for(attempt(ctx, job, result), remaining)
        except (TimeoutError, httpx.TimeoutException):
            break
        except (httpx.HTTPError, StreamError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"[:300]
            return report.ERROR, result, num_429
        if shed is None:
            result.ok = True
            return report.COMPLETED, result, num_429
        num_429 += 1
        wait = DEFAULT_RETRY_AFTER_S if shed.retry_after_s is None else shed.retry_after_s
        await asyncio.sleep(min(wait, max(deadline - time.perf_counter(), 0.0)))
    result.error = f"timed out after {ctx.options.timeout_s:g}s"
    return report.TIMED_OUT, result, num_429


async def send_short(ctx: Context, first_send: float) -> ShortRecord:
    """One request of the short client (`send_polite`)."""
    job = ctx.job(ctx.options.short_input_len, ctx.options.short_output_len)
    outcome, result, num_429 = await send_polite(ctx, job, first_send)
    ttft_s = result.ttft_s if outcome == report.COMPLETED else None
    return ShortRecord(first_send, outcome, ttft_s, num_429)


# ----- the run ---------------------------------------------------------------------------------


async def _run(
    o: OverloadOptions, make_load_client: LoadClientFactory, make_client: ClientFactory
) -> dict[str, Any]:
    url = base_url(o.url)
    async with make_load_client(o.max_inflight) as client, make_client(2) as scrape_client:
        model, max_model_len = await fetch_model(scrape_client, url)
        model = o.model or model
        if max_model_len and o.input_len + o.output_len > max_model_len:
            raise ValueError(f"--input-len + --output-len exceed max_model_len {max_model_len}")
        # the request body (`Sender.body`) and its ignore_eos switch; the load goes through `client`
        sender = Sender(
            scrape_client, f"{url}/v1/completions", model, o.timeout_s, 0, progress_every=0
        )
        vocab = (min(16, o.vocab_size - 1), o.vocab_size)
        ctx = Context(o, url, client, scrape_client, sender, PromptBuilder(1, o.seed, *vocab))
        if o.capacity_rps is None:
            capacity = await measure_capacity(ctx)
        else:
            capacity = {"measured": False, "rps": o.capacity_rps, "output_tokens_per_s": None}
        phases = []
        for k, m in enumerate(o.loads):
            with without_collector_pauses():
                run = await run_phase(ctx, m, m * capacity["rps"], k)
            phases.append(report.summarize_phase(run))
    report.add_relative_goodput(phases)
    config = {**asdict(o), "url": url, "model": model, "ignore_eos_sent": sender.ignore_eos}
    return {"config": config, "client": client_info(), "capacity": capacity, "phases": phases}


@contextlib.contextmanager
def without_collector_pauses() -> Iterator[None]:
    """No automatic garbage collection in this client while a phase is timed, one collection
    after it: a full collection walks every record the phase has kept so far, and would pause the
    loop that timestamps the sends and answers (the client's lag stays measured: `clag`)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


async def measure_capacity(ctx: Context) -> dict[str, Any]:
    """The closed loop of `--capacity-concurrency` requests for `--capacity-s` (step 1)."""
    o = ctx.options
    print(
        f"bench overload: capacity, {o.capacity_concurrency} in flight for {o.capacity_s:g} s",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    deadline = t0 + o.capacity_s
    results: list[Result] = []

    async def worker() -> None:
        while time.perf_counter() < deadline:
            job = ctx.job(o.input_len, o.output_len)
            _, result, _ = await send_polite(ctx, job, time.perf_counter())
            if result.error is not None:
                ctx.sender.errors.append(result.error)
            results.append(result)

    def progress() -> str:
        return f"capacity: {len(results)} done, {sum(r.ok for r in results)} completed"

    stop = asyncio.Event()
    reporter = asyncio.create_task(report_progress(progress, o.progress_s, stop))
    await asyncio.gather(*(worker() for _ in range(o.capacity_concurrency)))
    stop.set()
    await reporter
    ok = [r for r in results if r.ok]
    if not ok:
        first = ctx.sender.errors[0] if ctx.sender.errors else "none sent"
        raise ValueError(f"the capacity phase completed no request ({first})")
    return report.capacity_figures(
        len(ok), len(results) - len(ok), sum(r.output_tokens for r in ok), time.perf_counter() - t0
    )


async def run_phase(ctx: Context, multiple: float, rate: float, index: int) -> PhaseRun:
    """One open-loop phase (step 2), its short client (step 4) and its scrapes (step 5); returns
    once every request of the phase finished."""
    o = ctx.options
    first, lease_first = await sample_gateway(ctx), await sample_lease_expiries(ctx)
    t0 = time.perf_counter()
    print(
        f"bench overload: phase {multiple:g}x, {rate:.2f} req/s for {o.phase_s:g} s",
        file=sys.stderr,
    )
    records: list[Record] = []
    samples = [first]
    client_lags: list[float] = []
    stop = asyncio.Event()
    background = [
        asyncio.create_task(sample_every(ctx, samples, stop)),
        asyncio.create_task(watch_own_lag(client_lags, stop)),
        asyncio.create_task(
            report_progress(partial(phase_progress, multiple, records), o.progress_s, stop)
        ),
    ]
    is_short = o.short_at > 0 and math.isclose(multiple, o.short_at)
    short = asyncio.create_task(short_client(ctx, t0)) if is_short else None
    offsets = poisson_offsets(rate, o.phase_s, random.Random(f"{o.seed}:{index}"))
    flood = await open_loop(ctx, offsets, t0, records)
    window_end = await sample_gateway(ctx)
    samples.append(window_end)
    await asyncio.gather(*flood)
    short_records = None if short is None else await short
    stop.set()
    await asyncio.gather(*background)
    last, lease_last = await sample_gateway(ctx), await sample_lease_expiries(ctx)
    samples.append(last)
    return PhaseRun(
        multiple,
        rate,
        t0,
        o.phase_s,
        o.warmup_s,
        time.perf_counter() - t0,
        records,
        sorted(samples, key=lambda s: s.at),
        first,
        window_end,
        last,
        (lease_first, lease_last),
        short_records,
        o.short_rate,
        client_lags,
    )


async def sleep_until(at: float) -> None:
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def open_loop(
    ctx: Context, offsets: list[float], t0: float, records: list[Record]
) -> list[asyncio.Task[None]]:
    """Start one flood request at each t0 + offset; returns (at t0 + phase_s) their tasks."""
    o = ctx.options
    tasks = []
    for offset in offsets:
        await sleep_until(t0 + offset)
        record = Record(t0 + offset)
        records.append(record)
        job = ctx.job(o.input_len, o.output_len)
        tasks.append(asyncio.create_task(send_flood(ctx, job, record)))
    await sleep_until(t0 + o.phase_s)
    return tasks


async def short_client(ctx: Context, t0: float) -> list[ShortRecord]:
    """Step 4: a short request every 1 / `--short-rate` s from t0 until t0 + `--phase-s`."""
    interval, tasks = 1.0 / ctx.options.short_rate, []
    k = 0
    while (at := t0 + k * interval) < t0 + ctx.options.phase_s:
        await sleep_until(at)
        tasks.append(asyncio.create_task(send_short(ctx, time.perf_counter())))
        k += 1
    return list(await asyncio.gather(*tasks))


async def sample_gateway(ctx: Context) -> GatewaySample:
    """One GET /metrics; a failed or malformed scrape gives a sample of Nones."""
    try:
        resp = await ctx.scrape_client.get(f"{ctx.url}/metrics", timeout=SCRAPE_TIMEOUT_S)
        resp.raise_for_status()
        return report.parse_metrics(resp.text, time.perf_counter())
    except (httpx.HTTPError, ValueError):
        return GatewaySample(time.perf_counter())


async def sample_lease_expiries(ctx: Context) -> int | None:
    """The decode ranks' lease expiries from GET /mesh; None if it cannot be read."""
    try:
        resp = await ctx.scrape_client.get(f"{ctx.url}/mesh", timeout=SCRAPE_TIMEOUT_S)
        resp.raise_for_status()
        return report.decode_lease_expiries(resp.json())
    except (httpx.HTTPError, ValueError):
        return None


async def sample_every(ctx: Context, samples: list[GatewaySample], stop: asyncio.Event) -> None:
    """Append a scrape every `--scrape-s` until `stop` is set."""
    while not await wait_or_stop(stop, ctx.options.scrape_s):
        samples.append(await sample_gateway(ctx))


async def watch_own_lag(lags: list[float], stop: asyncio.Event) -> None:
    """How late this client's own `CLIENT_LAG_TICK_S` timer fires, until `stop` is set: a late
    loop here delays the sends and the answers the phase times, whatever the gateway does."""
    while True:
        start = time.perf_counter()
        if await wait_or_stop(stop, CLIENT_LAG_TICK_S):
            return
        lags.append(max(time.perf_counter() - start - CLIENT_LAG_TICK_S, 0.0))


def phase_progress(multiple: float, records: list[Record]) -> str:
    done = sum(r.outcome == report.COMPLETED for r in records)
    shed = sum(r.outcome == report.SHED for r in records)
    return f"{multiple:g}x: {len(records)} sent, {done} completed, {shed} shed"


async def report_progress(describe: Callable[[], str], every_s: float, stop: asyncio.Event) -> None:
    """A stderr line (what `describe` says) every `every_s` until `stop` is set."""
    while not await wait_or_stop(stop, every_s):
        print(f"bench overload: {describe()}", file=sys.stderr)


async def wait_or_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Whether `stop` was set within `timeout_s`."""
    try:
        await asyncio.wait_for(stop.wait(), timeout_s)
    except TimeoutError:
        return False
    return True
