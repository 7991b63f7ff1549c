"""`pdmesh bench chaos --model DIR --kill decode,prefill,kvstore,redis`: SIGKILL processes of a
live local mesh under steady load and check that nothing is lost.

Flow: start a mesh in this process (`pdmesh.launcher.Mesh`: embedded Redis, loopback, 2 prefill +
2 decode by default, the launcher's supervisor restarting what dies) → references: every case of
a fixed seeded workload (--num-prompts greedy prompts built with the model's tokenizer, plus
--num-seeded of them sampled at temperature 0.8 with a fixed seed; max_tokens drawn in
[--min-tokens, --max-tokens], ignore_eos) is completed once, streaming, before any fault → chaos:
a closed loop of --concurrency streaming /v1/completions for --duration seconds (and at most
--max-requests), each on a case drawn by a seeded RNG (--abort-fraction of them disconnect after a
random number of token chunks), while every --every seconds a role drawn from --kill loses a
random live process to SIGKILL (`redis`: the embedded Redis) → leak check → report.

KV corruption (`--corrupt-kv P`, alone or with kills): the prefill ranks run their fault hook
(`--fault-corrupt-kv P`: each hand-off's WRITE flips one byte in flight with probability P, seeded
by --seed and the rank) and, unless --worker-args sets --kv-digest, `--kv-digest all`, so decode
checks every hand-off and fails the corrupted ones closed (the gateway retries them). The report's
`kv_corruption` compares the corruptions injected with the digest mismatches counted (from the leak
check's statuses, over the whole run, references included); they must be equal and non-zero unless
a worker restarted (its counts went with it). Any corruption that got through shows up as
completed_wrong.

A request is (`classify`): aborted (the client closed early on purpose), hung (no end within
--timeout-s), errored (an HTTP status other than 200, an error event, a stream broken or ended
without [DONE]), completed_correct (text, usage.completion_tokens and usage.prompt_tokens equal to
its reference's, and completion_tokens == max_tokens), else completed_wrong. migrated / retried:
the change of the gateway's counters `pdmesh_gateway_migrations_total` /
`pdmesh_gateway_retries_total` over the chaos phase (null where the gateway has none). Latency: e2e
of completed requests, split by whether a fault fell inside [start, end].
Leak check: after the load, wait (at most --idle-timeout-s) until every worker rank runs, queues
and holds nothing, then read each rank's `Status` (kv_blocks_used counts blocks held by requests;
cached free blocks count as free) → leaked_blocks per rank.

A multi-instance role (prefill, decode) loses a process only while another instance of it is
SERVING, so every kill leaves a healthy peer; SERVING victims go first (a still-starting one only
when no other is left); a fault that finds no victim is recorded as skipped. The supervisor
restarts with a short backoff (0.5 s doubling to 2 s) and up to --max-restarts per service.
Exit status 1 when a request was wrong, hung or errored, a block leaked, a rank stayed busy or
unreachable, or the supervisor gave up.

Modules: this one (options, the load, output) → `chaos_core` (pure: workload, schedule, stream
parsing, classification, report) and `chaos_mesh` (victims, SIGKILL, leak check).
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
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_bench.chaos_core import (
    CATEGORIES,
    KILLABLE,
    MIGRATIONS,
    RETRIES,
    Case,
    ChaosRun,
    Draws,
    Outcome,
    Reference,
    build_cases,
    corruption_failures,
    corruption_report,
    counter_total,
    fault_schedule,
    http_error,
    reference_of,
    summarize,
)
from pdmesh_bench.chaos_mesh import MeshControl, inject_faults, leak_check
from pdmesh_bench.serve import check_host, fetch_model
from pdmesh_service.redis_server import free_port
from pdmesh_service.supervision import RestartPolicy


@dataclass(frozen=True)
class ChaosOptions:
    model: str
    kill: tuple[str, ...] = ("decode",)
    every: float = 10.0  # seconds between faults
    duration: float = 60.0  # seconds of load; no new request (nor fault) after it
    concurrency: int = 8
    num_prefill: int = 2
    num_decode: int = 2
    mode: str = "disagg"
    abort_fraction: float = 0.0
    max_requests: int | None = None
    num_prompts: int = 32
    num_seeded: int = 4
    min_tokens: int = 24
    max_tokens: int = 48
    timeout_s: float = 120.0  # per request, whole stream: past it the request is hung
    idle_timeout_s: float = 30.0  # leak check: how long to wait for every rank to go idle
    start_timeout_s: float = 300.0
    max_restarts: int = 1000  # per service within 10 minutes, then the supervisor gives up
    seed: int = 0
    host: str = "127.0.0.1"
    worker_args: str = ""  # engine options of the prefill and decode ranks (one shell string)
    corrupt_kv: float = 0.0  # probability a hand-off's KV WRITE flips one byte (fault hook)
    log_dir: str = "pdmesh-logs/chaos"
    progress_s: float = 5.0
    out: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChaosOptions:
        values: dict[str, Any] = {
            f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)
        }
        kill = str(values["kill"])  # "none": load (and --abort-fraction) without faults
        values["kill"] = tuple(r.strip() for r in kill.split(",") if r.strip() not in ("", "none"))
        if values.get("out") is not None:
            values["out"] = str(values["out"])
        return cls(**values)

    def validate(self) -> None:
        check_host(f"http://{self.host}:1")
        unknown = [r for r in self.kill if r not in KILLABLE]
        if unknown:
            raise ValueError(
                f"--kill takes roles of {', '.join(KILLABLE)} (or none), got {self.kill}"
            )
        if self.mode == "agg" and "prefill" in self.kill:
            raise ValueError("--kill prefill needs --mode disagg (an agg mesh has no prefill)")
        if min(self.every, self.duration, self.timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("--every, --duration, --timeout-s and --idle-timeout-s must be > 0")
        if self.concurrency < 1 or self.num_prompts < 1 or self.num_seeded < 0:
            raise ValueError("--concurrency and --num-prompts must be >= 1, --num-seeded >= 0")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 1 <= --min-tokens <= --max-tokens")
        if not 0.0 <= self.abort_fraction <= 1.0:
            raise ValueError(f"--abort-fraction must be in [0, 1], got {self.abort_fraction}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError("--max-requests must be >= 1")
        if not 0.0 <= self.corrupt_kv <= 1.0:
            raise ValueError(f"--corrupt-kv must be in [0, 1], got {self.corrupt_kv}")
        if self.corrupt_kv and self.mode == "agg":
            raise ValueError("--corrupt-kv needs --mode disagg (an agg mesh hands nothing off)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="kill mesh processes under load; check nothing is lost")
    d = ChaosOptions
    p.add_argument("--model", required=True, help="model directory (the mesh serves it)")
    p.add_argument(
        "--kill",
        default="decode",
        help=f"roles to kill, comma-separated: {KILLABLE}; none: no faults (client aborts only)",
    )
    p.add_argument("--every", type=float, default=d.every, help="seconds between faults")
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--num-prefill", type=int, default=d.num_prefill)
    p.add_argument("--num-decode", type=int, default=d.num_decode)
    p.add_argument("--mode", choices=("disagg", "agg"), default=d.mode)
    p.add_argument("--abort-fraction", type=float, default=d.abort_fraction)
    p.add_argument("--max-requests", type=int, help="at most this many requests under chaos")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--num-seeded", type=int, default=d.num_seeded, help="seeded-sampling cases")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per request: hung past")
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s)
    p.add_argument("--start-timeout-s", type=float, default=d.start_timeout_s)
    p.add_argument("--max-restarts", type=int, default=d.max_restarts, help="per service")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--host", default=d.host, help="loopback address of the mesh")
    p.add_argument(
        "--worker-args",
        default=d.worker_args,
        help='engine options, one string: --worker-args="--num-blocks 160"',
    )
    p.add_argument(
        "--corrupt-kv",
        type=float,
        default=d.corrupt_kv,
        metavar="P",
        help="flip one byte of a KV hand-off's WRITE in flight with probability P (prefill's fault "
        "hook; decode runs --kv-digest all unless --worker-args sets it); every corruption must be "
        "counted and no output wrong",
    )
    p.add_argument("--log-dir", default=d.log_dir, help="the mesh's logs")
    p.add_argument("--progress-s", type=float, default=d.progress_s)
    p.add_argument("--out", type=Path, help="write the report to this JSON file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = ChaosOptions.from_args(args)
    report = run_chaos(options)
    print_report(report)
    if options.out:
        path = Path(options.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["failures"] else 0


def run_chaos(o: ChaosOptions) -> dict[str, Any]:
    """Start a mesh, take the references, run the chaos phase, check for leaks, stop the mesh;
    returns the report (`chaos_core.summarize` plus `config`)."""
    from pdmesh_engine.tokenizer import Tokenizer

    o.validate()
    encode = Tokenizer.from_dir(o.model).encode
    cases = build_cases(encode, o.num_prompts, o.num_seeded, o.min_tokens, o.max_tokens, o.seed)
    mesh = Mesh(mesh_options(o))
    mesh.start(timeout_s=o.start_timeout_s, progress=lambda line: _say(line))
    try:
        mesh.start_supervisor()
        report = asyncio.run(_chaos(o, MeshControl(mesh), cases))
    finally:
        mesh.stop()
    report["config"] = {**asdict(o), "num_cases": len(cases)}
    return report


def mesh_options(o: ChaosOptions) -> MeshOptions:
    return MeshOptions(
        model_dir=Path(o.model),
        num_prefill=o.num_prefill,
        num_decode=o.num_decode,
        mode=o.mode,
        host=o.host,
        http_port=free_port(o.host),
        grpc_port=free_port(o.host),
        deployment=f"chaos-{os.getpid()}",
        log_dir=Path(o.log_dir),
        worker_args=worker_argv(o),
        restart_policy=RestartPolicy(
            max_restarts=o.max_restarts, backoff_s=0.5, max_backoff_s=2.0, healthy_s=5.0
        ),
    )


def worker_argv(o: ChaosOptions) -> tuple[str, ...]:
    """--worker-args, plus the fault hook and the digest with --corrupt-kv."""
    argv = shlex.split(o.worker_args)
    if o.corrupt_kv > 0:
        argv += ["--fault-corrupt-kv", str(o.corrupt_kv), "--fault-seed", str(o.seed)]
        if not any(a == "--kv-digest" or a.startswith("--kv-digest=") for a in argv):
            argv += ["--kv-digest", "all"]
    return tuple(argv)


def _say(line: str) -> None:
    print(f"bench chaos: {line}", file=sys.stderr, flush=True)


async def _chaos(o: ChaosOptions, control: MeshControl, cases: list[Case]) -> dict[str, Any]:
    url = f"http://{o.host}:{control.mesh.options.http_port}"
    limits = httpx.Limits(
        max_connections=o.concurrency + 4, max_keepalive_connections=o.concurrency
    )
    async with httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(None, connect=10.0)
    ) as client:
        model, _ = await fetch_model(client, url)
        sender = Sender(client, f"{url}/v1/completions", model, o.timeout_s)
        references = await take_references(sender, cases, o.concurrency)
        _say(f"{len(references)} references taken; chaos for {o.duration} s, kill {o.kill}")
        run = ChaosRun({c.index: c for c in cases}, references)
        run.counters_before = await read_counters(client, url)
        sender.t0 = time.perf_counter()
        schedule = fault_schedule(o.kill, o.every, o.duration, o.seed + 1)
        rng = random.Random(o.seed + 2)
        tasks = [
            asyncio.create_task(
                inject_faults(control, schedule, sender.now, rng, run.faults, _say)
            ),
            asyncio.create_task(show_progress(run, sender, o.progress_s)),
        ]
        draws = Draws(random.Random(o.seed + 3), cases, o.abort_fraction)
        await closed_loop(sender, draws, o, run.outcomes)
        run.duration_s = sender.now()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        _say(f"load done after {run.duration_s:.1f} s; waiting for the ranks to go idle")
        run.leak = await leak_check(control, o.idle_timeout_s)
        run.counters_after = await read_counters(client, url)
        run.restarts = dict(control.mesh.restarts)
    report = summarize(run)
    if o.corrupt_kv > 0:
        restarted = any(run.restarts.values()) if run.restarts else False
        report["kv_corruption"] = corruption_report(run.leak, restarted)
        report["failures"] += corruption_failures(report["kv_corruption"])
    report["supervisor_gave_up"] = control.gave_up()
    if report["supervisor_gave_up"]:
        report["failures"].append(f"the supervisor gave up on {report['supervisor_gave_up']}")
    return report


# ----- the load --------------------------------------------------------------------------------


@dataclass
class Sender:
    client: httpx.AsyncClient
    url: str  # .../v1/completions
    model: str
    timeout_s: float
    t0: float = field(default_factory=time.perf_counter)  # the clock's zero

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, case: Case, abort_after: int | None = None) -> Outcome:
        """One streaming completion; disconnects after abort_after text chunks when given."""
        outcome = Outcome(case.index, self.now())
        try:
            await asyncio.wait_for(self._stream(case, abort_after, outcome), self.timeout_s)
        except TimeoutError:
            outcome.hung = True
        except (httpx.HTTPError, ValueError) as e:
            outcome.error = f"{type(e).__name__}: {e}"[:500]
        outcome.end = self.now()
        return outcome

    async def _stream(self, case: Case, abort_after: int | None, outcome: Outcome) -> None:
        async with self.client.stream("POST", self.url, json=case.body(self.model)) as response:
            if response.status_code != 200:
                outcome.error = http_error(response.status_code, await response.aread())
                return
            async for line in response.aiter_lines():
                if not outcome.apply(line):
                    return
                if abort_after is not None and outcome.num_chunks >= abort_after:
                    outcome.aborted = True  # leaving the block closes the connection
                    return


async def take_references(
    sender: Sender, cases: list[Case], concurrency: int
) -> dict[int, Reference]:
    """Every case once, before any fault; RuntimeError if one does not complete in full."""
    gate = asyncio.Semaphore(concurrency)

    async def one(case: Case) -> Outcome:
        async with gate:
            return await sender.send(case)

    outcomes = await asyncio.gather(*(one(case) for case in cases))
    try:
        return {c.index: reference_of(o, c) for c, o in zip(cases, outcomes, strict=True)}
    except ValueError as e:
        raise RuntimeError(f"a reference request failed before any fault: {e}") from None


async def closed_loop(
    sender: Sender, draws: Draws, o: ChaosOptions, outcomes: list[Outcome]
) -> None:
    """o.concurrency clients, each sending its next request when the last ended, until
    o.duration (and o.max_requests sent); outcomes are appended as they end."""
    sent = 0

    async def client() -> None:
        nonlocal sent
        while sender.now() < o.duration and (o.max_requests is None or sent < o.max_requests):
            sent += 1
            case, abort_after = draws.next()
            outcomes.append(await sender.send(case, abort_after))

    await asyncio.gather(*(client() for _ in range(o.concurrency)))


async def read_counters(client: httpx.AsyncClient, url: str) -> dict[str, float | None]:
    """The gateway's migration and retry counters (None: absent or /metrics unreadable)."""
    try:
        response = await client.get(f"{url}/metrics", timeout=10.0)
        text = response.text if response.status_code == 200 else ""
    except httpx.HTTPError:
        text = ""
    return {name: counter_total(text, name) for name in (MIGRATIONS, RETRIES)}


async def show_progress(run: ChaosRun, sender: Sender, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        counts = run.counts()
        injected = sum(1 for f in run.faults if f.name)
        _say(
            f"{sender.now():6.1f} s  {len(run.outcomes)} ended: "
            + ", ".join(f"{counts.get(c, 0)} {c}" for c in CATEGORIES)
            + f"; {injected} faults"
        )


# ----- output ----------------------------------------------------------------------------------


def print_report(r: dict[str, Any]) -> None:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f}"

    faults = r["faults"]
    print(
        f"bench chaos: {r['sent']} requests in {r['duration_s']:.1f} s; "
        f"{faults['injected']} faults {faults['per_role']} ({faults['skipped']} skipped)"
    )
    for name in (*CATEGORIES, "migrated", "retried"):
        value = r[name]
        print(f"  {name:<18} {'n/a' if value is None else f'{value:g}'}")
    for message, count in r["errors_by_message"].items():
        print(f"  {'':<18} {count} x {message}")
    corruption = r.get("kv_corruption")
    if corruption is not None:
        exact = "" if corruption["exact"] else " (a worker restarted: not compared)"
        print(
            f"  {'kv corruption':<18} {corruption['injected']} injected, "
            f"{corruption['caught']} caught by the digest{exact}"
        )
    leaked = ", ".join(f"{k} {v}" for k, v in r["leaked_blocks"].items()) or "n/a"
    print(f"  {'leaked blocks':<18} {leaked}")
    restarts = r["restarts"]
    shown = "n/a" if restarts is None else ", ".join(f"{k} {v}" for k, v in restarts.items())
    print(f"  {'restarts':<18} {shown or 'none'}")
    for name, lat in r["latency_ms"].items():
        print(
            f"  e2e {name:<14} {lat['count']:5d} requests, p50 {ms(lat['p50'])} ms, "
            f"p99 {ms(lat['p99'])} ms"
        )
    print("  result: " + ("PASS" if not r["failures"] else "FAIL: " + "; ".join(r["failures"])))
