"""`pdmesh bench autoscale`: a quiet -> burst -> quiet load against an autoscaled mesh and against
the fixed smallest topology, side by side in one run.

Topologies, one after the other on this machine (loopback only), each started as `pdmesh up` starts
it (`pdmesh.launcher.Mesh`, supervisor and autoscaler included) and stopped after its run:
- autoscaled: `pdmesh up --autoscale prefill=1..3,decode=1..2` (`--autoscale`), starting at the
  lower bounds, with the gateway's autoscale settings given here (short cooldowns, so a run stays
  minutes long);
- fixed: 1 prefill + 1 decode, what the autoscaled mesh starts as.
The same seeded Poisson arrivals go to both (`autoscale_report.schedule`): `--rate` requests/s for
`--quiet-s`, `--multiple` x that for `--burst-s`, `--rate` again for `--after-s`; each a streaming
completion of `--output-len` tokens (ignore_eos) of the same prompt. The gateway's queue bound is
raised (`--max-queued`) so the burst queues rather than sheds: the TTFT shows the queueing.

Reported per topology (`autoscale_report.summarize`): requests completed, shed (429) and lost (any
other failure), TTFT p50/p90 per phase (from the scheduled arrival), and per pool the desired and
ready replicas sampled every second from the gateway's /metrics (`pdmesh_autoscale_*`; the fixed
mesh's counts are its plan's), the most ready at once, how often the desired count changed, and the
launcher's scale events. `--json` keeps everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_bench.autoscale_report import (
    POOLS,
    Phase,
    Record,
    Sample,
    phases,
    print_report,
    schedule,
    summarize,
)
from pdmesh_bench.lean_http import LeanClient
from pdmesh_service.redis_server import free_port
from pdmesh_service.scaling import parse_bounds

PROMPT = "def fibonacci(n):\n    "
GAUGE = re.compile(r'^(pdmesh_autoscale_(?:desired|ready)_replicas)\{pool="(\w+)"\} (\S+)$')
QUEUE_GAUGE = "pdmesh_autoscale_queue_time_seconds "
SAMPLE_S = 1.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("autoscale", help="quiet -> burst -> quiet: autoscaled mesh vs fixed 1P1D")
    p.add_argument("--model", help="model directory (default: the embedded model)")
    p.add_argument("--rate", type=float, default=3.5, help="quiet requests/s (default %(default)s)")
    p.add_argument("--multiple", type=float, default=5.0, help="the burst's rate / --rate")
    p.add_argument("--quiet-s", type=float, default=20.0)
    p.add_argument("--burst-s", type=float, default=45.0)
    p.add_argument("--after-s", type=float, default=90.0)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prompt-repeat", type=int, default=12, help="copies of the prompt's line")
    p.add_argument("--autoscale", default="prefill=1..3,decode=1..2", help="the pools' bounds")
    p.add_argument(
        "--gateway-autoscale-args",
        default="--autoscale-interval-s 1 --autoscale-window-s 5 --autoscale-cooldown-s 15 "
        "--autoscale-up-cooldown-s 5 --autoscale-up-stable-s 3",
        help="the autoscaled gateway's settings (quoted; `pdmesh serve gateway --help`)",
    )
    p.add_argument("--drain-s", type=float, default=20.0, help="a stopped worker's drain bound")
    p.add_argument("--max-queued", type=int, default=100_000, help="the gateway's queue bound")
    p.add_argument("--worker-args", default="--torch-threads 1", help="engine options (quoted)")
    p.add_argument("--only", choices=["autoscaled", "fixed"], help="run one topology")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="one request's client timeout")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--log-dir", type=Path, help="the meshes' logs (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.set_defaults(run=run)


def topologies(
    args: argparse.Namespace, model: Path, log_dir: Path
) -> list[tuple[str, MeshOptions]]:
    """(name, options) of the meshes to run, autoscaled first."""
    bounds = parse_bounds(args.autoscale)
    worker_args = tuple(shlex.split(args.worker_args))
    base = MeshOptions(
        model_dir=model,
        log_dir=log_dir,
        worker_args=worker_args,
        gateway_args=("--max-queued", str(args.max_queued)),
    )
    scaled = replace(
        base,
        num_prefill=bounds["prefill"].min_replicas if "prefill" in bounds else 1,
        num_decode=bounds["decode"].min_replicas if "decode" in bounds else 1,
        autoscale=bounds,
        worker_args=(*worker_args, "--drain-s", f"{args.drain_s:g}"),
        gateway_args=(*base.gateway_args, *shlex.split(args.gateway_autoscale_args)),
    )
    chosen = [("autoscaled", scaled), ("fixed", replace(base, num_prefill=1, num_decode=1))]
    return [(name, o) for name, o in chosen if args.only in (None, name)]


def run(args: argparse.Namespace) -> int:
    from pdmesh.cli.options import resolve_model

    model = resolve_model(Path(args.model) if args.model else None)
    load = phases(args.rate, args.multiple, args.quiet_s, args.burst_s, args.after_s)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-bench-autoscale-"))
    results = []
    for name, options in topologies(args, model, log_dir):
        options = replace(
            options,
            http_port=free_port(),
            grpc_port=free_port(),
            deployment=f"bench-autoscale-{os.getpid()}-{name}",
            log_dir=log_dir / name,
        )
        _say(f"{name}: starting the mesh (logs in {options.log_dir})")
        results.append(run_topology(name, options, load, args))
    print_report(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("run", "json", "log_dir")
        }
        report = {"config": {**config, "model": str(model)}, "topologies": results}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if any(r["num_lost"] for r in results) else 0


def run_topology(
    name: str, options: MeshOptions, load: list[Phase], args: argparse.Namespace
) -> dict[str, Any]:
    mesh = Mesh(options)
    mesh.start(timeout_s=args.start_timeout_s, progress=_say)
    mesh.start_supervisor()
    try:
        records, samples, t0 = asyncio.run(drive(mesh, load, args))
        events = [
            {**asdict(e), "at": round(e.at - t0, 1)}
            for e in (mesh.scaler.events if mesh.scaler else [])
        ]
    finally:
        mesh.stop()
    return summarize(name, records, samples, events)


async def drive(
    mesh: Mesh, load: list[Phase], args: argparse.Namespace
) -> tuple[list[Record], list[Sample], float]:
    """Send the load's requests at their arrival times while sampling the pools; every request's
    record, the samples, and the start (time.monotonic)."""
    url = f"http://{mesh.options.host}:{mesh.options.http_port}"
    arrivals = schedule(load, args.seed)
    body = {
        "prompt": PROMPT * args.prompt_repeat,
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    loop = asyncio.get_running_loop()
    samples: list[Sample] = []
    async with LeanClient(url, max_connections=1024) as client:
        await _settle(client, url, mesh)
        t0 = loop.time()
        sampler = asyncio.ensure_future(_sample_forever(client, url, mesh, load, t0, samples))
        tasks = []
        for phase, offset in arrivals:
            await asyncio.sleep(max(0.0, t0 + offset - loop.time()))
            tasks.append(
                asyncio.ensure_future(_send(client, url, body, phase, offset, t0, args.timeout_s))
            )
        records = await asyncio.gather(*tasks)
        await asyncio.sleep(SAMPLE_S)
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return list(records), samples, t0


async def _send(
    client: LeanClient,
    url: str,
    body: dict[str, Any],
    phase: str,
    arrival: float,
    t0: float,
    timeout_s: float,
) -> Record:
    loop = asyncio.get_running_loop()
    first, status, finish, error = None, 0, None, ""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                status = response.status_code
                if status != 200:
                    await response.aread()
                    return Record(phase, arrival, None, loop.time() - t0, status, None)
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = str(event["error"].get("message", event["error"]))
                        break
                    choice = event["choices"][0]
                    if first is None and choice.get("text"):
                        first = loop.time() - t0
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, OSError, TimeoutError, ValueError, LookupError) as e:
        error = f"{type(e).__name__}: {e}"  # LeanError: an httpx.TransportError
    if not error and finish is None:
        error = "the stream ended without a finish_reason"
    return Record(phase, arrival, first, loop.time() - t0, status, finish, error)


async def _settle(client: LeanClient, url: str, mesh: Mesh, timeout_s: float = 30.0) -> None:
    """Until the gateway's gauges (if it has them) show every planned worker ready."""
    planned = {pool: len(mesh.names(pool)) for pool in POOLS}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        _, ready, _ = await _scrape(client, url, planned)
        if ready == planned:
            return
        await asyncio.sleep(0.2)


async def _scrape(
    client: LeanClient, url: str, planned: dict[str, int]
) -> tuple[dict[str, int], dict[str, int], float | None]:
    """(desired, ready, queue time) from the gateway's /metrics; `planned` where it has none."""
    desired, ready, queue = dict(planned), dict(planned), None
    try:
        async with client.stream("GET", f"{url}/metrics") as response:
            text = (await response.aread()).decode()
    except (httpx.HTTPError, OSError):
        return desired, ready, queue  # a missed sample: the caller tries again
    for line in text.splitlines():
        if (m := GAUGE.match(line)) is not None:
            (desired if "desired" in m.group(1) else ready)[m.group(2)] = int(float(m.group(3)))
        elif line.startswith(QUEUE_GAUGE):
            queue = float(line.split()[-1])
    return desired, ready, queue


def _phase_at(load: list[Phase], t: float) -> str:
    start = 0.0
    for phase in load:
        if t < start + phase.duration_s:
            return phase.name
        start += phase.duration_s
    return "drain"


async def _sample_forever(
    client: LeanClient, url: str, mesh: Mesh, load: list[Phase], t0: float, samples: list[Sample]
) -> None:
    """Every SAMPLE_S: the gateway's autoscale gauges (a fixed mesh has none: its plan's counts)."""
    loop = asyncio.get_running_loop()
    planned = {pool: len(mesh.names(pool)) for pool in POOLS}
    while True:
        desired, ready, queue = await _scrape(client, url, planned)
        at = loop.time() - t0
        samples.append(Sample(at, _phase_at(load, at), desired, ready, queue))
        await asyncio.sleep(SAMPLE_S)


def _say(line: str) -> None:
    print(f"bench autoscale: {line}", file=sys.stderr, flush=True)
