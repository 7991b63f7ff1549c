"""`pdmesh bench soak --duration 30m`: a long run of mixed traffic on a mesh of its own, watching
for anything that grows: every process's memory and open files, KV blocks held, Redis keys.

Flow: start a mesh in this process (`pdmesh.launcher.Mesh`: embedded Redis, loopback, the
launcher's supervisor on) → references: every case of a seeded mixed workload (completions and
chat; greedy, and seeded sampling at temperature 0.8; short prompts, and long ones sharing one
prefix; ignore_eos, max_tokens drawn in [--min-tokens, --max-tokens]) completed once, streamed →
the soak: --concurrency closed-loop clients for --duration, each request on a case drawn by a seeded
RNG, --stream-fraction of them streamed, --abort-fraction of those hung up on after a random number
of chunks (the client closes the connection); with --chaos-rate R, R SIGKILLs a minute of a role
drawn from --chaos-kill (`chaos_mesh`) → idle: wait until every rank is idle (the leak check), then
up to --drain-s for finished hand-off records to expire. Every --sample-s, throughout: RSS
(VmRSS) and open fds of every process the mesh runs (gateway, workers, kvstore, eplb, Redis; a
service counts its whole process tree), KV blocks held per worker rank (`Status`), Redis DBSIZE
and keys per kind, the gateway's requests in flight.

Verdict (`soak_core`): warm-up is the first --warmup-fraction of the load (at least a minute once
it lasts 5); after it, each RSS and fd series, and the Redis keys but hand-off records, is flat when
both the growth of its last window's median over its first (a window: a tenth of the samples) and a
linear fit's slope x the span stay within --tolerance of its level (with a MB of RSS, a few fds or
keys of slack); a service restarted after warm-up is not judged. Hand-off records follow the request
rate (one per request, kept for the kvstore's retention once finished), so they are bounded instead
by the requests that ended within the retention. At the end: no rank holds a block, the gateway
counts nothing in flight, every Redis key kind is back to its count before the load (finished
hand-off records may stay for the kvstore's retention, then expire), 0 lost (errored or hung: every
request answered or deliberately aborted), 0 wrong (completions equal their case's reference: text
and token counts). Exit status 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import httpx

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_bench import soak_core as core
from pdmesh_bench import soak_probe as probe
from pdmesh_bench.chaos_core import KILLABLE, fault_schedule, http_error
from pdmesh_bench.chaos_mesh import MeshControl, inject_faults, leak_check
from pdmesh_bench.serve import check_host, fetch_model
from pdmesh_service.redis_server import free_port
from pdmesh_service.supervision import RestartPolicy


@dataclass(frozen=True)
class SoakOptions:
    model: str | None = None  # None: the embedded default model
    duration: float = 1800.0  # seconds of load
    chaos_rate: float = 0.0  # SIGKILLs a minute (0: none)
    chaos_kill: tuple[str, ...] = ("decode", "prefill")
    mode: str = "disagg"
    num_prefill: int = 1
    num_decode: int = 1
    concurrency: int = 4
    stream_fraction: float = 0.6
    abort_fraction: float = 0.2  # of the streamed requests
    num_prompts: int = 24
    num_long: int = 6
    num_seeded: int = 6
    long_tokens: int = 384  # the long prompts' shared prefix (capped by the model's length)
    min_tokens: int = 8
    max_tokens: int = 48
    sample_s: float | None = None  # None: duration / 100, within [2, 10] s
    warmup_fraction: float = 0.2
    tolerance: float = 0.05
    timeout_s: float = 180.0  # per request: hung past it
    idle_timeout_s: float = 60.0
    drain_s: float = 75.0  # at most this long for finished hand-off records to expire
    start_timeout_s: float = 300.0
    seed: int = 0
    host: str = "127.0.0.1"
    worker_args: str = ""
    log_dir: str = "pdmesh-logs/soak"
    progress_s: float = 30.0
    json_out: str | None = None
    plot: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SoakOptions:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["duration"] = core.parse_duration(values["duration"])
        kill = str(values["chaos_kill"])
        values["chaos_kill"] = tuple(r.strip() for r in kill.split(",") if r.strip())
        for name in ("model", "json_out", "plot"):
            values[name] = None if values.get(name) is None else str(values[name])
        return cls(**values)

    @property
    def interval_s(self) -> float:
        return self.sample_s or min(10.0, max(2.0, self.duration / 100))

    def validate(self) -> None:
        check_host(f"http://{self.host}:1")
        if [r for r in self.chaos_kill if r not in KILLABLE]:
            raise ValueError(f"--chaos-kill takes roles of {', '.join(KILLABLE)}")
        if self.mode == "agg" and self.chaos_rate and "prefill" in self.chaos_kill:
            raise ValueError("--chaos-kill prefill needs --mode disagg")
        if min(self.duration, self.timeout_s, self.idle_timeout_s, self.interval_s) <= 0:
            raise ValueError("--duration, --timeout-s, --idle-timeout-s, --sample-s must be > 0")
        if self.chaos_rate < 0 or self.drain_s < 0:
            raise ValueError("--chaos-rate and --drain-s must be >= 0")
        if self.concurrency < 1 or self.num_prompts < 1 or min(self.num_long, self.num_seeded) < 0:
            raise ValueError("--concurrency, --num-prompts >= 1; --num-long, --num-seeded >= 0")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 1 <= --min-tokens <= --max-tokens")
        for name in ("stream_fraction", "abort_fraction", "warmup_fraction", "tolerance"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "soak", help="long mixed load on an own mesh: nothing grows, leaks or is lost"
    )
    d = SoakOptions
    p.add_argument("--model", help="model directory (default: the embedded model)")
    p.add_argument("--duration", default="30m", help="load time: 30m, 90s, 1h (default 30m)")
    p.add_argument("--chaos-rate", type=float, default=d.chaos_rate, help="SIGKILLs a minute")
    p.add_argument("--chaos-kill", default="decode,prefill", help=f"roles of {KILLABLE}")
    p.add_argument("--mode", choices=("disagg", "agg"), default=d.mode)
    p.add_argument("--num-prefill", type=int, default=d.num_prefill)
    p.add_argument("--num-decode", type=int, default=d.num_decode)
    for name in ("concurrency", "num_prompts", "num_long", "num_seeded", "long_tokens", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    for name in ("stream_fraction", "abort_fraction", "warmup_fraction", "tolerance"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--sample-s", type=float, help="seconds between samples (default: auto)")
    for name in ("timeout_s", "idle_timeout_s", "drain_s", "start_timeout_s", "progress_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--host", default=d.host, help="loopback address of the mesh")
    p.add_argument("--worker-args", default=d.worker_args, help='one string: "--num-blocks 160"')
    p.add_argument("--log-dir", default=d.log_dir, help="the mesh's logs")
    p.add_argument("--json", dest="json_out", type=Path, help="write the report here")
    p.add_argument("--plot", type=Path, help="draw the series into this PNG")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = SoakOptions.from_args(args)
    report = run_soak(options)
    probe.print_report(report)
    if options.json_out:
        path = Path(options.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
    if options.plot:
        _say(f"plot written to {probe.write_plot(options.plot, report)}")
    return 1 if report["failures"] else 0


def run_soak(o: SoakOptions) -> dict[str, Any]:
    """Start a mesh, take the references, soak, wait for idle, stop the mesh; the report."""
    from pdmesh.cli.options import resolve_model

    o.validate()
    model_dir = resolve_model(Path(o.model) if o.model else None)
    mesh = Mesh(mesh_options(o, model_dir))
    mesh.start(timeout_s=o.start_timeout_s, progress=_say)
    try:
        mesh.start_supervisor()
        report = asyncio.run(_soak(o, MeshControl(mesh), model_dir))
    finally:
        mesh.stop()
    report["config"] = {**asdict(o), "model_dir": str(model_dir), "sample_s": o.interval_s}
    return report


def mesh_options(o: SoakOptions, model_dir: Path) -> MeshOptions:
    return MeshOptions(
        model_dir=model_dir,
        num_prefill=o.num_prefill if o.mode == "disagg" else 0,
        num_decode=o.num_decode,
        mode=o.mode,
        host=o.host,
        http_port=free_port(o.host),
        grpc_port=free_port(o.host),
        deployment=f"soak-{os.getpid()}",
        log_dir=Path(o.log_dir),
        worker_args=tuple(shlex.split(o.worker_args)),
        restart_policy=RestartPolicy(
            max_restarts=1000, backoff_s=0.5, max_backoff_s=2.0, healthy_s=5.0
        ),
    )


def _say(line: str) -> None:
    print(f"bench soak: {line}", file=sys.stderr, flush=True)


async def _soak(o: SoakOptions, control: MeshControl, model_dir: Path) -> dict[str, Any]:
    from pdmesh_engine.tokenizer import Tokenizer

    url = f"http://{o.host}:{control.mesh.options.http_port}"
    limits = httpx.Limits(
        max_connections=o.concurrency + 8, max_keepalive_connections=o.concurrency
    )
    timeout = httpx.Timeout(None, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model, max_len = await fetch_model(client, url)
        long_tokens = min(o.long_tokens, (max_len or 2048) // 2 - o.max_tokens)
        cases = core.build_cases(
            Tokenizer.from_dir(model_dir).encode,
            *(o.num_prompts, o.num_long, o.num_seeded),
            (o.min_tokens, o.max_tokens),
            long_tokens,
            o.seed,
        )
        sender = Sender(client, url, model, o.timeout_s)
        references = await take_references(sender, cases, o.concurrency)
        watch = probe.Watch(control, url, client)
        try:
            baseline = await watch.redis_prefixes()
            baseline.pop(core.HANDOFF_PREFIX, None)  # the references' hand-offs
            _say(f"{len(references)} references taken; soaking for {o.duration:.0f} s")
            return await _load_and_idle(o, control, watch, sender, cases, references, baseline)
        finally:
            await watch.close()


async def _load_and_idle(
    o: SoakOptions,
    control: MeshControl,
    watch: probe.Watch,
    sender: Sender,
    cases: list[core.SoakCase],
    references: dict[int, core.Reference],
    baseline: dict[str, int],
) -> dict[str, Any]:
    answers: list[core.Answer] = []
    samples: list[core.Sample] = []
    sender.t0 = time.perf_counter()
    phase = ["load"]
    sampler = asyncio.create_task(
        watch.sample_every(o.interval_s, sender.now, phase, answers, samples)
    )
    faults: list[Any] = []
    every = 60.0 / o.chaos_rate if o.chaos_rate else o.duration * 2
    schedule = fault_schedule(o.chaos_kill if o.chaos_rate else (), every, o.duration, o.seed + 1)
    background = [
        sampler,
        asyncio.create_task(
            inject_faults(control, schedule, sender.now, random.Random(o.seed + 2), faults, _say)
        ),
        asyncio.create_task(show_progress(answers, samples, sender, o.progress_s)),
    ]
    draws = core.Draws(random.Random(o.seed + 3), cases, o.stream_fraction, o.abort_fraction)
    await closed_loop(sender, draws, o, answers)
    load_s, phase[0] = sender.now(), "idle"
    _say(f"load done after {load_s:.0f} s; waiting for the ranks to go idle")
    leak = await leak_check(control, o.idle_timeout_s)
    redis_end = await watch.drain_handoffs(o.drain_s, baseline)
    samples.append(await watch.sample(sender.now(), "idle", len(answers)))
    for task in background:
        task.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    report = summarize(o, samples, answers, cases, references, load_s)
    report.update(
        leak_check=leak,
        redis_end=redis_end,
        in_flight_end=samples[-1].in_flight,
        faults=[asdict(f) for f in faults],
        restarts=dict(control.mesh.restarts),
        supervisor_gave_up=control.gave_up(),
    )
    report["failures"] = core.failures(report)
    return report


def summarize(
    o: SoakOptions,
    samples: list[core.Sample],
    answers: list[core.Answer],
    cases: list[core.SoakCase],
    references: dict[int, core.Reference],
    load_s: float,
) -> dict[str, Any]:
    warmup_s = core.warmup_of(load_s, o.warmup_fraction)
    series = core.series_of(samples)
    judged = [
        core.flatness(
            name,
            points,
            (warmup_s, load_s),
            o.tolerance,
            not name.startswith("redis")
            and core.restarted_after(samples, name.split(":")[1], warmup_s),
        )
        for name, points in sorted(series.items())
        if name.split(":")[0] in ("rss_mb", "fds", "redis_other")
    ]
    retention_s = probe.RETENTION_MS / 1000
    judged.append(core.handoff_bound(samples, (warmup_s, load_s), retention_s, o.concurrency))
    tally = core.tally(answers, {c.index: c for c in cases}, references)
    return {
        **tally,
        "duration_s": load_s,
        "warmup_s": warmup_s,
        "requests_per_s": tally["sent"] / load_s if load_s else None,
        "flatness": [{**asdict(f), "growth_pct": f.growth_pct} for f in judged],
        "samples": [asdict(s) for s in samples],
    }


# ----- the load --------------------------------------------------------------------------------


@dataclass
class Sender:
    client: httpx.AsyncClient
    url: str  # the gateway's base URL
    model: str
    timeout_s: float
    t0: float = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(
        self, case: core.SoakCase, is_stream: bool, abort_after: int | None = None
    ) -> core.Answer:
        answer = core.Answer(case.index, is_stream, self.now())
        path = "/v1/chat/completions" if case.is_chat else "/v1/completions"
        body = case.body(self.model, is_stream)
        try:
            call = self._stream(path, body, abort_after, answer) if is_stream else None
            await asyncio.wait_for(call or self._whole(path, body, answer), self.timeout_s)
        except TimeoutError:
            answer.hung = True
        except (httpx.HTTPError, ValueError) as e:
            answer.error = f"{type(e).__name__}: {e}"[:500]
        answer.end = self.now()
        return answer

    async def _whole(self, path: str, body: dict[str, Any], answer: core.Answer) -> None:
        response = await self.client.post(self.url + path, json=body)
        if response.status_code != 200:
            answer.error = http_error(response.status_code, response.content)
            return
        answer.apply_body(response.json())

    async def _stream(
        self, path: str, body: dict[str, Any], abort_after: int | None, answer: core.Answer
    ) -> None:
        async with self.client.stream("POST", self.url + path, json=body) as response:
            if response.status_code != 200:
                answer.error = http_error(response.status_code, await response.aread())
                return
            async for line in response.aiter_lines():
                if not answer.apply_line(line):
                    return
                if abort_after is not None and answer.num_chunks >= abort_after:
                    answer.aborted = True  # leaving the block closes the connection
                    return


async def take_references(
    sender: Sender, cases: list[core.SoakCase], concurrency: int
) -> dict[int, core.Reference]:
    """Every case once, streamed; RuntimeError if one does not complete in full."""
    gate = asyncio.Semaphore(concurrency)

    async def one(case: core.SoakCase) -> core.Answer:
        async with gate:
            return await sender.send(case, True)

    answers = await asyncio.gather(*(one(case) for case in cases))
    try:
        return {c.index: core.reference_of(a, c) for c, a in zip(cases, answers, strict=True)}
    except ValueError as e:
        raise RuntimeError(f"a reference request failed: {e}") from None


async def closed_loop(
    sender: Sender, draws: core.Draws, o: SoakOptions, answers: list[core.Answer]
) -> None:
    """o.concurrency clients, each sending its next request when its last one ended."""

    async def client() -> None:
        while sender.now() < o.duration:
            case, is_stream, abort_after = draws.next()
            answers.append(await sender.send(case, is_stream, abort_after))

    await asyncio.gather(*(client() for _ in range(o.concurrency)))


async def show_progress(
    answers: list[core.Answer], samples: list[core.Sample], sender: Sender, every_s: float
) -> None:
    while True:
        await asyncio.sleep(every_s)
        lost = sum(1 for a in answers if a.error or a.hung)
        last = samples[-1] if samples else None
        rss = sum(last.rss_mb.values()) if last else 0.0
        _say(
            f"{sender.now():7.0f} s  {len(answers)} ended ({lost} lost); mesh RSS {rss:.0f} MB, "
            f"redis keys {last.redis_keys if last else 'n/a'}"
        )
