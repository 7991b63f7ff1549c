"""`pdmesh bench serve`: replay a request trace (or synthetic load) against an OpenAI-compatible
server.

Every request is a streaming `POST /v1/completions` whose `prompt` is a list of token ids built by
`pdmesh_bench.traces` (blocks shared exactly where the trace's hash ids are equal), with
`max_tokens` = the (scaled) output length, `ignore_eos` (dropped if the server rejects it),
`temperature` 0 and `stream_options.include_usage`. Arrivals: the trace's timestamps (times
`--time-scale`), Poisson at `--rate`, or a closed loop of `--concurrency` requests in flight.
Trace lengths are kept (only clamped to the context) unless `--scale-to-context`; the JSON's
`scaling` says what was done.

Measured per request from the SSE stream: TTFT (first token chunk), ITL (gaps between token chunks),
TPOT ((e2e - ttft) / (output_tokens - 1)), e2e and the user's speed output_tokens / e2e. Traffic
goes only to loopback hosts unless `--allow-remote`; it is bounded by `--num-requests`,
`--duration-s` (no new requests after it) and `--timeout-s` (per request, whole stream).

Also reported: the trace's reusable prefix (`traces.reusable_prefix_tokens`: the input tokens an
ideal prefix cache would serve, block chains seen in an earlier request) and how much of it the
server reported cached (`cached_of_reusable`; its own block size and evictions make it differ from
1). The JSON carries one row per request (`requests`), which `--plot` / `--plot-compare` draw
(`pdmesh_bench.plots`). `--dp-replay mirror|lag|both` replays every request once per DP rank,
pinned with the `X-Data-Parallel-Rank` header, to measure what DP imbalance costs
(`pdmesh_bench.dp_replay`).

`--constrained-share S` (0..1): round(S * N) of the N requests, drawn with a `--seed`ed RNG, carry
`response_format: {"type": "json_schema", ...}` with one of `pdmesh_bench.constrained.SCHEMAS`
(drawn too), sized so that its JSON fits in the request's `max_tokens`; they are sent without
`ignore_eos` (the grammar ends them, so they may be shorter than the rest). The report then has
`structured`: TTFT/ITL/TPOT of the constrained and the unconstrained requests apart, and how many
constrained outputs parse and validate against their schema (a JSON cut off at `max_tokens` does
not). One run has one share; for the cost of constraining, run the same workload three times and
compare the `--json` files (alternating the order over repeats on a noisy machine):

    W="--synthetic --concurrency 8 --num-requests 64 --output-len 128"
    pdmesh bench serve $W --constrained-share 0 --json s0.json
    pdmesh bench serve $W --constrained-share 0.5 --json s50.json
    pdmesh bench serve $W --constrained-share 1 --json s100.json
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx

from pdmesh_bench import plots
from pdmesh_bench.constrained import (
    BY_NAME,
    choose_constrained,
    response_format,
    serve_schema,
    validation_error,
)
from pdmesh_bench.traces import (
    P90_USER_DEFINITION,
    Job,
    Scaling,
    TraceRequest,
    choose_arrivals,
    distribution,
    load_trace,
    make_jobs,
    mix_long_prompts,
    p90_user_tokens_per_s,
    plan_scaling,
    reusable_prefix_tokens,
    scale_requests,
    session_turns,
    synthetic_requests,
)

DP_RANK_HEADER = "X-Data-Parallel-Rank"  # pins a request's prefill (agg: decode) to this DP rank


@dataclass
class ServeOptions:
    url: str = "http://127.0.0.1:8000"
    trace: str | None = None
    synthetic: bool = False
    rate: float | None = None  # Poisson arrivals (req/s); overrides the trace's timestamps
    concurrency: int | None = None  # closed loop with this many requests in flight
    num_requests: int = 100
    duration_s: float | None = None  # no new requests after this many seconds
    input_len: int = 256  # --synthetic
    output_len: int = 64  # --synthetic
    prefix_fraction: float = 0.0  # --synthetic: shared prefix of every prompt
    long_input_len: int | None = None  # --synthetic: this input length for --long-fraction of them
    long_fraction: float = 0.0
    scale_to_context: bool = False
    scale_percentile: float = 99.0
    scale_factor: float | None = None
    keep_output_len: bool = False  # scale inputs only
    time_scale: float = 1.0
    seed: int = 0
    max_model_len: int | None = None  # default: from GET /v1/models
    model: str | None = None  # default: from GET /v1/models
    vocab_size: int = 1024  # prompt token ids are drawn from [16, vocab_size)
    timeout_s: float = 300.0
    max_inflight: int = 256  # connection limit in open-loop mode
    allow_remote: bool = False
    progress_every: int = 10
    json: str | None = None
    label: str | None = None  # names this run in plots (default: the --json file's name)
    plot: str | None = None  # PNG: the TTFT distribution of this run (and of --plot-compare runs)
    plot_compare: list[str] = field(default_factory=list)  # other runs' --json files to overlay
    dp_replay: str | None = None  # mirror | lag | both (pdmesh_bench.dp_replay)
    sessions: bool = False  # a trace's sessions, each turn after the previous one (session_loop)
    max_turns: int | None = None  # --sessions: the first turns of each session only
    think_s: float = 0.0  # --sessions: pause between a turn's answer and the next turn
    lag_s: float = 0.5  # lag: rank r's copies are sent r * lag_s late
    dp_rounds: int = 1  # both: this many lag replays, each between two mirror replays
    dp_size: int | None = None  # DP ranks to replay on (default: the prefill instance's dp_size)
    constrained_share: float | None = None  # requests carrying a JSON schema (None: no report)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        for name in ("json", "plot"):
            if values.get(name) is not None:
                values[name] = str(values[name])
        values["plot_compare"] = [str(v) for v in values.get("plot_compare") or ()]
        return cls(**values)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="replay a trace or synthetic load against an OpenAI-compatible server"
    )
    p.add_argument("--url", default=ServeOptions.url, help="server base URL (default %(default)s)")
    add_workload_arguments(p)
    p.add_argument("--max-model-len", type=int, help="default: from GET /v1/models")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request, whole stream")
    p.add_argument(
        "--max-inflight", type=int, default=256, help="connection limit in open-loop mode"
    )
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    p.add_argument("--progress-every", type=int, default=10)
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    p.add_argument("--label", help="this run's name in plots (default: the --json file's name)")
    p.add_argument("--plot", type=Path, help="write the TTFT distribution (CDF) to this PNG")
    p.add_argument(
        "--plot-compare",
        nargs="+",
        type=Path,
        default=[],
        metavar="JSON",
        help="overlay these runs' --json results in --plot (alone: plot them, send nothing)",
    )
    p.add_argument(
        "--constrained-share",
        type=float,
        metavar="S",
        help="this share (0..1) of the requests, drawn with --seed, carries a response_format JSON "
        "schema; TTFT/ITL reported apart for constrained and unconstrained requests",
    )
    p.set_defaults(run=run)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What to send and when (shared with `pdmesh sim`, which replays the same workloads)."""
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--trace", help="Mooncake .jsonl, Azure .csv, agentic .json (or a directory of them)"
    )
    source.add_argument(
        "--synthetic", action="store_true", help="random prompts of --input-len/--output-len"
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="Poisson arrivals at R requests/s")
    load.add_argument("--concurrency", type=int, help="closed loop: C requests in flight")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--duration-s", type=float, help="stop issuing requests after S seconds")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--prefix-fraction", type=float, default=0.0, help="synthetic: shared-prefix fraction"
    )
    p.add_argument(
        "--long-input-len", type=int, help="synthetic: a mix; this input length for some prompts"
    )
    p.add_argument(
        "--long-fraction", type=float, default=0.0, help="synthetic: share of long prompts"
    )
    p.add_argument(
        "--sessions",
        action="store_true",
        help="trace: replay its sessions (agentic: one per file), each turn sent once the previous "
        "one was answered; --concurrency: sessions at a time (default: all)",
    )
    p.add_argument("--max-turns", type=int, help="--sessions: the first N turns of each session")
    p.add_argument(
        "--think-s", type=float, default=0.0, help="--sessions: pause before each next turn"
    )
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply trace times (0.5 = twice as fast)"
    )
    p.add_argument(
        "--scale-to-context",
        action="store_true",
        help="scale trace lengths (and hash blocks) so the --scale-percentile fits the context",
    )
    p.add_argument("--scale-percentile", type=float, default=99.0)
    p.add_argument("--scale-factor", type=float, help="explicit scale factor in (0, 1]")
    p.add_argument("--keep-output-len", action="store_true", help="scale inputs only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dp-replay",
        choices=("mirror", "lag", "both"),
        help="send every request once per DP rank (header X-Data-Parallel-Rank): all at once "
        "(mirror) or rank r late by r * --lag-s (lag); both: mirror, lag, mirror and the cost",
    )
    p.add_argument("--lag-s", type=float, default=0.5, help="lag per DP rank (default 0.5 s)")
    p.add_argument(
        "--dp-rounds",
        type=int,
        default=1,
        help="both: K lag replays, each between two mirrors (default 1: mirror, lag, mirror)",
    )
    p.add_argument(
        "--dp-size", type=int, help="DP ranks (default: from GET /mesh; sim: the DEP size)"
    )
    p.add_argument("--vocab-size", type=int, default=1024, help="token ids are drawn below this")


def run(args: argparse.Namespace) -> int:
    options = ServeOptions.from_args(args)
    if is_plot_only(options):
        if not options.plot:
            raise ValueError("--plot-compare needs --plot PNG")
        plots.write_ttft_plot(options.plot, plots.compare_curves(options.plot_compare))
        print(f"bench serve: wrote {options.plot}")
        return 0
    result = run_benchmark(options)
    if "dp_replay" in result:
        from pdmesh_bench.dp_replay import print_report  # dp_replay imports this module

        print_report(result)
    else:
        print_summary(result)
    if options.json:
        path = Path(options.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    if options.plot:
        label = plots.run_label(result, options.json)
        curves = plots.ttft_curves(result, label) + plots.compare_curves(options.plot_compare)
        plots.write_ttft_plot(options.plot, curves)
        print(f"bench serve: wrote {options.plot}")
    return 0 if result["num_requests"] > result["num_errors"] else 1


def is_plot_only(o: ServeOptions) -> bool:
    """`--plot PNG --plot-compare A.json ...` without a workload: draw saved runs only."""
    return o.trace is None and not o.synthetic and bool(o.plot_compare)


def run_benchmark(options: ServeOptions | argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark and return the results dict (also what `--json` writes)."""
    if isinstance(options, argparse.Namespace):
        options = ServeOptions.from_args(options)
    validate(options)
    return asyncio.run(_run(options))


def validate(o: ServeOptions) -> None:
    check_host(o.url, o.allow_remote)
    if (o.trace is None) == (not o.synthetic):
        raise ValueError(
            "give exactly one of --trace FILE and --synthetic (or only --plot with --plot-compare)"
        )
    if o.plot_compare and not o.plot:
        raise ValueError("--plot-compare needs --plot PNG")
    if o.dp_replay is not None:
        if o.dp_replay not in ("mirror", "lag", "both"):
            raise ValueError(f"--dp-replay must be mirror, lag or both, got {o.dp_replay!r}")
        if o.concurrency is not None:
            raise ValueError("--dp-replay replays arrival times: use the trace's or --rate")
        if o.lag_s < 0 or o.dp_rounds < 1 or (o.dp_size is not None and o.dp_size < 1):
            raise ValueError("--lag-s must be >= 0, --dp-rounds and --dp-size >= 1")
    if (
        o.num_requests < 1
        or (o.concurrency is not None and o.concurrency < 1)
        or o.max_inflight < 1
    ):
        raise ValueError("--num-requests, --concurrency and --max-inflight must be >= 1")
    if o.rate is not None and o.concurrency is not None:
        raise ValueError("give at most one of --rate and --concurrency")
    if o.sessions and (o.trace is None or o.rate is not None or o.dp_replay is not None):
        raise ValueError(
            "--sessions replays a trace's sessions: no --synthetic, --rate, --dp-replay"
        )
    if (o.max_turns is not None and o.max_turns < 1) or o.think_s < 0:
        raise ValueError("--max-turns must be >= 1 and --think-s >= 0")
    if o.synthetic and o.rate is None and o.concurrency is None:
        raise ValueError("--synthetic needs --rate R or --concurrency C")
    if o.timeout_s <= 0 or (o.duration_s is not None and o.duration_s <= 0):
        raise ValueError("--timeout-s and --duration-s must be > 0")
    if o.constrained_share is not None:
        if not 0.0 <= o.constrained_share <= 1.0:
            raise ValueError(f"--constrained-share must be in [0, 1], got {o.constrained_share}")
        if o.dp_replay is not None:
            raise ValueError("--constrained-share does not combine with --dp-replay")


def check_host(url: str, allow_remote: bool = False) -> None:
    """Refuse any host but a loopback one (localhost, 127.0.0.0/8, ::1) unless allow_remote."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--url must be an http(s) URL with a host, got {url!r}")
    if allow_remote or parts.hostname == "localhost":
        return
    try:
        if ipaddress.ip_address(parts.hostname).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(
        f"refusing to send load to non-loopback host {parts.hostname!r} (pass --allow-remote)"
    )


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# ----- the work list ---------------------------------------------------------------------------


@dataclass
class Workload:
    """The (scaled) requests of a run, their arrival offsets (None: closed loop) and how they were
    scaled; `jobs(seed)` builds their prompts (a different seed: the same lengths and sharing, other
    token ids)."""

    requests: list[TraceRequest]
    arrivals: list[float] | None
    scaling: Scaling
    info: dict[str, Any]  # the source and the scaling, as the JSON's `scaling` reports them
    vocab_size: int = 1024
    sessions: list[list[int]] | None = None  # --sessions: job indexes per session, in turn order

    def jobs(self, seed: int) -> list[Job]:
        return make_jobs(self.requests, self.scaling, self.arrivals, seed, self.vocab_size)

    def reusable(self) -> list[int]:
        """Per job index: its reusable-prefix tokens (`traces.reusable_prefix_tokens`)."""
        return reusable_prefix_tokens(self.requests, self.scaling)


def build_workload(o: ServeOptions, max_model_len: int) -> Workload:
    """The requests to send, when, and how their lengths were scaled."""
    if o.synthetic:
        requests, block = synthetic_requests(
            o.num_requests, o.input_len, o.output_len, o.prefix_fraction
        )
        if o.long_input_len is not None:
            requests = mix_long_prompts(requests, o.long_input_len, o.long_fraction, o.seed)
        scaling = plan_scaling(requests, max_model_len, block, enabled=False, factor=1.0)
        source = {"source": "synthetic", "prefix_tokens": round(o.prefix_fraction * o.input_len)}
    else:
        trace = load_trace(o.trace)
        if not trace.requests:
            raise ValueError(f"{o.trace}: the trace has no requests")
        scaling = plan_scaling(
            trace.requests,
            max_model_len,
            trace.block_tokens,
            enabled=o.scale_to_context,
            percentile=o.scale_percentile,
            factor=o.scale_factor,
            scale_output=not o.keep_output_len,
        )
        requests = trace.requests
        if o.sessions:
            kept = sorted(i for turns in session_turns(requests, o.max_turns) for i in turns)
            requests = [requests[i] for i in kept]
        requests = requests[: o.num_requests]
        source = {"source": "trace", "format": trace.format, "trace_requests": len(trace.requests)}
    requests = scale_requests(requests, scaling)
    if o.sessions:
        sessions = session_turns(requests)
        source["sessions"] = len(sessions)
        return Workload(
            requests, None, scaling, {**source, **scaling.to_dict()}, o.vocab_size, sessions
        )
    arrivals = choose_arrivals(requests, o.rate, o.concurrency, o.time_scale, o.seed)
    return Workload(requests, arrivals, scaling, {**source, **scaling.to_dict()}, o.vocab_size)


# ----- sending ---------------------------------------------------------------------------------


@dataclass
class Result:
    index: int
    start: float  # perf_counter at the scheduled send
    rank: int | None = None  # the DP rank it was pinned to (DP_RANK_HEADER), None: not pinned
    ok: bool = False
    error: str | None = None
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    schema: str | None = None  # the name of the JSON schema it carried (--constrained-share)
    text: list[str] = field(default_factory=list)  # the output's text chunks

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e_s(self) -> float:
        return self.end - self.start


class StreamError(Exception):
    """A non-200 answer, or an error event inside the stream."""


@dataclass
class Sender:
    client: httpx.AsyncClient
    url: str
    model: str
    timeout_s: float
    total: int
    progress_every: int = 10
    ignore_eos: bool = True
    done: int = 0
    errors: list[str] = field(default_factory=list)
    constrained: dict[int, str] = field(default_factory=dict)  # job index -> its schema's name

    def clock(self) -> float:
        return time.perf_counter()

    def schema(self, job: Job) -> dict[str, Any] | None:
        """The JSON schema the job carries (None: unconstrained)."""
        name = self.constrained.get(job.index)
        return None if name is None else serve_schema(BY_NAME[name], job.max_tokens)

    def body(self, job: Job) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": job.prompt,
            "max_tokens": job.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        schema = self.schema(job)
        if schema is not None:  # no ignore_eos: the grammar ends the output
            body["response_format"] = response_format(schema, self.constrained[job.index])
        elif self.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def issue(self, job: Job, scheduled: float, rank: int | None = None) -> Result:
        """Send one job (pinned to DP `rank` unless None); errors are recorded, never raised."""
        result = Result(
            job.index,
            scheduled,
            rank,
            prompt_tokens=len(job.prompt),
            schema=self.constrained.get(job.index),
        )
        try:
            await asyncio.wait_for(self._send(job, result), self.timeout_s)
        except (TimeoutError, httpx.HTTPError, StreamError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"[:500] or type(e).__name__
        result.ok = result.error is None and bool(result.token_times)
        if result.error is None and not result.ok:
            result.error = "the stream ended without any token"
        if result.error:
            self.errors.append(result.error)
        self.done += 1
        if self.progress_every and (
            self.done % self.progress_every == 0 or self.done == self.total
        ):
            print(
                f"bench serve: {self.done}/{self.total} done, {len(self.errors)} errors",
                file=sys.stderr,
            )
        return result

    async def _send(self, job: Job, result: Result) -> None:
        headers = {} if result.rank is None else {DP_RANK_HEADER: str(result.rank)}
        for attempt in range(2):
            async with self.client.stream(
                "POST", self.url, json=self.body(job), headers=headers
            ) as resp:
                if resp.status_code == 200:
                    await read_stream(resp.aiter_lines(), result)
                    return
                text = (await resp.aread()).decode(errors="replace")
                if (
                    attempt == 0
                    and self.ignore_eos
                    and resp.status_code == 400
                    and "ignore_eos" in text
                ):
                    self.ignore_eos = False  # the server rejects the extension: send without it
                    continue
                raise StreamError(f"HTTP {resp.status_code}: {text[:300]}")


async def read_stream(lines: Any, result: Result) -> None:
    """Consume `data: {...}` SSE lines up to `data: [DONE]`, timing every chunk that carries a
    token."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        now = time.perf_counter()
        if "error" in chunk:
            raise StreamError(f"error event: {json.dumps(chunk['error'])[:300]}")
        choices = chunk.get("choices") or []
        if choices and _carries_token(choices[0]):
            result.token_times.append(now)
        if choices:
            text = choices[0].get("text")
            if text is None:
                text = (choices[0].get("delta") or {}).get("content")
            if text:
                result.text.append(text)
        if chunk.get("usage"):
            usage = chunk["usage"]
            result.output_tokens = int(usage.get("completion_tokens") or 0)
            result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
            result.cached_tokens = int(
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            )
    result.end = time.perf_counter()
    if not result.output_tokens:
        result.output_tokens = len(result.token_times)


def _carries_token(choice: dict[str, Any]) -> bool:
    """Text (completions) or delta content (chat); an empty-text chunk counts unless it only
    finishes."""
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return bool(text) or choice.get("finish_reason") is None


class Issuer(Protocol):
    """What the arrival loops drive: `Sender` over HTTP, or the simulator's mesh
    (`pdmesh_bench.sim`) on its virtual clock. `rank`: pinned to that DP rank (--dp-replay)."""

    errors: list[str]

    def clock(self) -> float: ...

    async def issue(self, job: Job, scheduled: float, rank: int | None = None) -> Result: ...


async def open_loop(
    sender: Issuer, jobs: list[Job], t0: float, deadline: float | None
) -> list[Result]:
    tasks = []
    for job in jobs:
        at = t0 + (job.arrival_s or 0.0)
        if deadline is not None and at > deadline:
            break
        delay = at - sender.clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(sender.issue(job, at)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(
    sender: Issuer, jobs: list[Job], concurrency: int, deadline: float | None
) -> list[Result]:
    queue = iter(jobs)
    results: list[Result] = []

    async def worker() -> None:
        for job in queue:  # one shared iterator: each job goes to exactly one worker
            if deadline is not None and sender.clock() > deadline:
                return
            results.append(await sender.issue(job, sender.clock()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda r: r.index)


async def session_loop(
    sender: Issuer,
    jobs: list[Job],
    sessions: list[list[int]],
    think_s: float,
    concurrency: int | None,
    deadline: float | None,
) -> list[Result]:
    """Every session sends its turns in order, each once the previous one was answered (and
    `think_s` passed), as an agent drives its context; up to `concurrency` sessions at a time
    (None: all at once), a waiting session starting when one ends."""
    queue = iter(sessions)
    results: list[Result] = []

    async def driver() -> None:
        for turns in queue:  # one shared iterator: each session goes to exactly one driver
            for k, index in enumerate(turns):
                if deadline is not None and sender.clock() > deadline:
                    return
                if k and think_s:
                    await asyncio.sleep(think_s)
                results.append(await sender.issue(jobs[index], sender.clock()))

    await asyncio.gather(*(driver() for _ in range(concurrency or len(sessions))))
    return sorted(results, key=lambda r: r.index)


async def fetch_model(client: httpx.AsyncClient, url: str) -> tuple[str, int | None]:
    try:
        resp = await client.get(f"{url}/v1/models")
        resp.raise_for_status()
        first = resp.json()["data"][0]
        return first["id"], first.get("max_model_len")
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"GET {url}/v1/models failed: {type(e).__name__}: {e}") from None


def arrival_mode(o: ServeOptions) -> str:
    if o.sessions:
        return "sessions"
    if o.concurrency:
        return "closed-loop"
    return "poisson" if o.rate else "trace-timestamps"


def http_client(o: ServeOptions, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(o.timeout_s, connect=min(10.0, o.timeout_s), pool=None)
    return httpx.AsyncClient(http1=True, http2=False, limits=limits, timeout=timeout)


async def _run(o: ServeOptions) -> dict[str, Any]:
    url = base_url(o.url)
    async with http_client(o, o.concurrency or o.max_inflight) as client:
        model, served_len = await fetch_model(client, url)
        model = o.model or model
        max_model_len = o.max_model_len or served_len
        if not max_model_len:
            raise ValueError("the server does not report max_model_len: pass --max-model-len")
        workload = build_workload(o, max_model_len)
        config = {
            **asdict(o),
            "url": url,
            "model": model,
            "max_model_len": max_model_len,
            "mode": arrival_mode(o),
        }
        if o.dp_replay is not None:
            from pdmesh_bench.dp_replay import run_replays  # dp_replay imports this module

            return await run_replays(o, client, workload, config)
        jobs = workload.jobs(o.seed)
        sender = Sender(
            client, f"{url}/v1/completions", model, o.timeout_s, len(jobs), o.progress_every
        )
        if o.constrained_share is not None:
            chosen = choose_constrained(len(jobs), o.constrained_share, o.seed)
            sender.constrained = {jobs[i].index: name for i, name in chosen.items()}
        print(
            f"bench serve: {len(jobs)} requests to {url} ({model}, max_model_len {max_model_len})",
            file=sys.stderr,
        )
        t0 = time.perf_counter()
        deadline = None if o.duration_s is None else t0 + o.duration_s
        if workload.sessions is not None:
            results = await session_loop(
                sender, jobs, workload.sessions, o.think_s, o.concurrency, deadline
            )
        elif o.concurrency is not None:
            results = await closed_loop(sender, jobs, o.concurrency, deadline)
        else:
            results = await open_loop(sender, jobs, t0, deadline)
        duration = time.perf_counter() - t0
    summary = summarize(results, duration, sender.errors, workload.reusable())
    if o.constrained_share is not None:
        schemas = {job.index: sender.schema(job) for job in jobs}
        summary["structured"] = structured_summary(
            results, {i: s for i, s in schemas.items() if s is not None}, o.constrained_share
        )
    config["ignore_eos_sent"] = sender.ignore_eos
    return {**summary, "config": config, "scaling": workload.info}


def structured_summary(
    results: list[Result], schemas: dict[int, dict[str, Any]], share: float
) -> dict[str, Any]:
    """TTFT/ITL/TPOT of the constrained requests (those in `schemas`, by job index) and of the
    others apart, and how many constrained outputs validate against their schema."""

    def group(rs: list[Result]) -> dict[str, Any]:
        ok = [r for r in rs if r.ok]
        return {
            "requests": len(rs),
            "completed": len(ok),
            "ttft_ms": distribution([r.ttft_s * 1e3 for r in ok]),
            "itl_ms": distribution([(b - a) * 1e3 for r in ok for a, b in pairwise(r.token_times)]),
            "tpot_ms": distribution(
                [
                    (r.e2e_s - r.ttft_s) * 1e3 / (r.output_tokens - 1)
                    for r in ok
                    if r.output_tokens > 1
                ]
            ),
            "output_tokens": sum(r.output_tokens for r in ok),
        }

    constrained = [r for r in results if r.index in schemas]
    errors = []
    for r in constrained:
        if r.ok:
            error = validation_error("".join(r.text), schemas[r.index])
            if error is not None:
                errors.append(f"request {r.index} ({r.schema}): {error}"[:300])
    completed = sum(r.ok for r in constrained)
    return {
        "share": share,
        "constrained": {**group(constrained), "valid": completed - len(errors)},
        "unconstrained": group([r for r in results if r.index not in schemas]),
        "invalid_examples": errors[:3],
    }


def summarize(
    results: list[Result],
    duration_s: float,
    errors: list[str] | None = None,
    reusable: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The run's figures over its completed requests, and one row per request (`requests`).
    `reusable`: per job index, its reusable-prefix tokens (None: not reported)."""
    ok = [r for r in results if r.ok]
    itl = [(b - a) * 1e3 for r in ok for a, b in pairwise(r.token_times)]
    tpot = [(r.e2e_s - r.ttft_s) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    speeds = [r.output_tokens / r.e2e_s for r in ok if r.e2e_s > 0]
    out_tokens = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    inputs = sum(r.prompt_tokens for r in ok)
    errors = errors if errors is not None else [r.error for r in results if r.error]
    duration_s = max(duration_s, 1e-9)
    reusable_tokens = (
        None if reusable is None else sum(min(reusable[r.index], r.prompt_tokens) for r in ok)
    )
    return {
        "ttft_ms": distribution([r.ttft_s * 1e3 for r in ok]),
        "tpot_ms": distribution(tpot),
        "itl_ms": distribution(itl),
        "e2e_ms": distribution([r.e2e_s * 1e3 for r in ok]),
        "user_tokens_per_s": distribution(speeds),
        "output_tokens_per_s": out_tokens / duration_s,
        "request_throughput": len(ok) / duration_s,
        "p90_user_tokens_per_s": p90_user_tokens_per_s(speeds),
        "p90_user_tokens_per_s_definition": P90_USER_DEFINITION,
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(results) - len(ok),
        "error_messages": errors[:5],
        "input_tokens": inputs,
        "cached_input_tokens": cached,
        "uncached_input_tokens": inputs - cached,
        "cache_hit_ratio": cached / inputs if inputs else None,
        "reusable_input_tokens": reusable_tokens,
        "cached_of_reusable": cached / reusable_tokens if reusable_tokens else None,
        "output_tokens": out_tokens,
        "duration_s": duration_s,
        "requests": [request_row(r) for r in results],
    }


def request_row(r: Result) -> dict[str, Any]:
    """One request as the JSON lists it (times in ms; None where it never got a token)."""
    row: dict[str, Any] = {"index": r.index}
    if r.rank is not None:
        row["rank"] = r.rank
    if r.schema is not None:
        row["schema"] = r.schema
    return {
        **row,
        "ok": r.ok,
        "ttft_ms": r.ttft_s * 1e3 if r.token_times else None,
        "e2e_ms": r.e2e_s * 1e3 if r.ok else None,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
    }


def print_summary(r: dict[str, Any]) -> None:
    def ms(d: dict[str, float | None]) -> str:
        return "  ".join(
            f"{k} {v:8.1f}" if v is not None else f"{k}      n/a"
            for k, v in d.items()
            if k != "mean"
        )

    c, s = r["config"], r["scaling"]
    print(
        f"bench serve: {c['model']} at {c['url']}, {c['mode']}, "
        f"{r['num_completed']}/{r['num_requests']} "
        f"completed in {r['duration_s']:.1f} s ({r['num_errors']} errors)"
    )
    group = f" per {s['hash_ids_per_block']} hash ids" if s["hash_ids_per_block"] > 1 else ""
    print(
        f"  scaling: factor {s['factor']:.4g}, block {s['block_tokens']} tokens{group}, "
        f"{s['inputs_clamped']} inputs / {s['outputs_clamped']} outputs clamped to "
        f"{s['max_model_len']}"
    )
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        print(f"  {name:<8} {ms(r[name])}")
    user = r["p90_user_tokens_per_s"]
    print(
        f"  throughput {r['request_throughput']:.2f} req/s, {r['output_tokens_per_s']:.1f} output "
        "tokens/s; "
        f"p90 user {user if user is None else round(user, 1)} tokens/s (10th percentile of "
        "per-request speed)"
    )
    print_tokens(r)
    if "structured" in r:
        print_structured(r["structured"])
    for message in r["error_messages"]:
        print(f"  error: {message}")


def print_structured(s: dict[str, Any]) -> None:
    """TTFT/ITL p50/p90 of the constrained and the unconstrained requests."""

    def p(d: dict[str, float | None]) -> str:
        return "/".join("n/a" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p90"))

    print(f"  constrained share {s['share']:g} (response_format json_schema), p50/p90 ms:")
    for name in ("constrained", "unconstrained"):
        g = s[name]
        valid = f", {g['valid']}/{g['completed']} valid" if name == "constrained" else ""
        print(
            f"    {name:<13} {g['completed']}/{g['requests']} completed{valid}: "
            f"ttft {p(g['ttft_ms'])}  itl {p(g['itl_ms'])}  tpot {p(g['tpot_ms'])}"
        )
    for message in s["invalid_examples"]:
        print(f"    invalid: {message}")


def print_tokens(r: dict[str, Any]) -> None:
    """The input/output token line and the reusable-prefix line of a summary."""
    hit = r["cache_hit_ratio"]
    print(
        f"  input tokens {r['input_tokens']} ({r['cached_input_tokens']} cached"
        f"{'' if hit is None else f', {100 * hit:.1f}%'}, {r['uncached_input_tokens']} uncached), "
        f"output tokens {r['output_tokens']}"
    )
    reusable, share = r.get("reusable_input_tokens"), r.get("cached_of_reusable")
    if reusable is not None:
        print(
            f"  reusable prefix {reusable} input tokens (blocks seen in an earlier request); "
            f"cached of reusable {'n/a' if share is None else f'{100 * share:.1f}%'}"
        )
