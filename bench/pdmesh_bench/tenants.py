"""`pdmesh bench tenants`: tenants and priority classes on a loopback mesh.

It starts its own mesh (agg, one decode rank, the tiny seeded model unless `--model`) with an API
keys file of four tenants, then runs four phases:
1. `unloaded`: the `inter` tenant replays the conversation trace alone (`--trace`, Mooncake format,
   lengths scaled to the model's context, arrivals at `--rate` per second, Poisson) → TTFT p90.
2. `classes_on`: the same replay (header `x-pdmesh-priority: interactive`) while the `bulk` tenant
   floods (a closed loop of `--flood-concurrency` requests, header `batch`; a 429 waits its
   Retry-After, capped at 0.2 s, and counts as rejected).
3. `classes_off`: the same, neither sending a class (both `default`: the fair queue's DRR between
   the two tenants is still on; FCFS is not measured here).
4. `fairness`: tenants `fair-a` and `fair-b`, both `default`, closed loops of 10 x k and k requests
   (`--fair-concurrency` k, by default the decode batch: then even the smaller tenant offers more
   than its half of the mesh, which is saturated 11 times over) of the flood's shape for
   `--fair-duration-s`: prompt + completion tokens served per tenant.
The JSON (`--out`) has every phase's TTFT distribution, counts and the ratios; the summary prints
interactive TTFT p90 on vs off vs unloaded and the fairness ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdmesh_bench.traces import (
    distribution,
    load_trace,
    make_jobs,
    percentile_of,
    plan_scaling,
    poisson_arrivals,
    scale_requests,
)

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2] / "../shared/data/traces/conversation_trace.jsonl"
)
KEYS = {
    "sk-bench-inter-000000": {"tenant": "inter", "max_priority": "interactive"},
    "sk-bench-bulk-0000000": {"tenant": "bulk", "max_priority": "batch"},
    "sk-bench-fair-a-00000": {"tenant": "fair-a", "max_priority": "default"},
    "sk-bench-fair-b-00000": {"tenant": "fair-b", "max_priority": "default"},
}
KEY_OF = {v["tenant"]: k for k, v in KEYS.items()}


@dataclass
class Tally:
    """What one tenant got in a phase."""

    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0  # prompt + completion of the requests that finished in the window
    num_ok: int = 0
    num_rejected: int = 0
    num_failed: int = 0
    # the end of the measured window: tokens of requests finishing later are not counted (a
    # tenant with more requests queued at the end would otherwise be credited for the drain)
    until: float = float("inf")


async def _send(
    client: httpx.AsyncClient,
    tenant: str,
    prompt: list[int],
    max_tokens: int,
    tally: Tally,
    priority: str | None,
) -> float:
    """One streaming completion; the Retry-After of a 429 (else 0)."""
    headers = {"Authorization": f"Bearer {KEY_OF[tenant]}"}
    if priority:
        headers["x-pdmesh-priority"] = priority
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    start, first = time.perf_counter(), None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code == 429:
                tally.num_rejected += 1
                return float(r.headers.get("retry-after", "1"))
            if r.status_code != 200:
                tally.num_failed += 1
                return 0.0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices"):
                    first = time.perf_counter()
                usage = chunk.get("usage")
                if usage and time.perf_counter() <= tally.until:
                    tally.tokens += usage["prompt_tokens"] + usage["completion_tokens"]
    except httpx.HTTPError:
        tally.num_failed += 1
        return 0.0
    if first is not None:
        tally.ttfts.append(first - start)
        tally.num_ok += 1
    return 0.0


async def _closed_loop(client, tenant, jobs, concurrency, until, tally, priority) -> None:
    rng = random.Random(tenant)

    async def worker() -> None:
        while time.perf_counter() < until:
            prompt, max_tokens = rng.choice(jobs)
            wait = await _send(client, tenant, prompt, max_tokens, tally, priority)
            if wait:
                await asyncio.sleep(min(wait, 0.2))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _replay(client, jobs, arrivals, tally, priority) -> None:
    t0 = time.perf_counter()

    async def one(job, at) -> None:
        await asyncio.sleep(max(at - (time.perf_counter() - t0), 0))
        await _send(client, "inter", job.prompt, job.max_tokens, tally, priority)

    await asyncio.gather(*(one(j, a) for j, a in zip(jobs, arrivals, strict=True)))


async def _phase(url, o, jobs, arrivals, flood, priorities) -> dict[str, Any]:
    inter, bulk = Tally(), Tally()
    async with httpx.AsyncClient(base_url=url, timeout=o.timeout_s, limits=_limits()) as client:
        tasks = []
        if flood:
            until = time.perf_counter() + 3600
            flooding = asyncio.ensure_future(
                _closed_loop(client, "bulk", flood, o.flood_concurrency, until, bulk, priorities[1])
            )
            await asyncio.sleep(o.warmup_s)  # the flood fills the queue first
            tasks.append(flooding)
        await _replay(client, jobs, arrivals, inter, priorities[0])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "inter_ttft_s": distribution(inter.ttfts),
        "inter_ttft_p90_s": percentile_of(inter.ttfts, 90) if inter.ttfts else None,
        "inter": _counts(inter),
        "bulk": _counts(bulk),
    }


async def _fairness(url, o, jobs) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=o.timeout_s, limits=_limits()) as client:
        warm_until = time.perf_counter() + o.warmup_s
        until = warm_until + o.fair_duration_s
        a, b = Tally(until=until), Tally(until=until)
        k = o.fair_concurrency or o.max_num_seqs
        warm = [Tally(), Tally()]
        await asyncio.gather(
            _closed_loop(client, "fair-a", jobs, 10 * k, warm_until, warm[0], None),
            _closed_loop(client, "fair-b", jobs, k, warm_until, warm[1], None),
        )
        await asyncio.gather(
            _closed_loop(client, "fair-a", jobs, 10 * k, until, a, None),
            _closed_loop(client, "fair-b", jobs, k, until, b, None),
        )
    ratio = a.tokens / b.tokens if b.tokens else None
    return {"offered": "10:1", "a": _counts(a), "b": _counts(b), "tokens_a_over_b": ratio}


def _counts(t: Tally) -> dict[str, Any]:
    return {
        "ok": t.num_ok,
        "rejected_429": t.num_rejected,
        "failed": t.num_failed,
        "tokens": t.tokens,
    }


def _limits() -> httpx.Limits:
    return httpx.Limits(max_connections=1000, max_keepalive_connections=1000)


def _workload(o, max_model_len: int, vocab: int):
    trace = load_trace(o.trace)
    requests = trace.requests[: o.num_requests]
    scaling = plan_scaling(requests, max_model_len, trace.block_tokens)
    requests = scale_requests(requests, scaling)
    arrivals = poisson_arrivals(len(requests), o.rate, seed=1)
    jobs = make_jobs(requests, scaling, arrivals, seed=1, vocab_size=vocab)
    flood_rng = random.Random(2)
    flood = [
        ([flood_rng.randrange(16, vocab) for _ in range(o.flood_input_len)], o.flood_output_len)
        for _ in range(64)
    ]
    return jobs, arrivals, flood, scaling.to_dict()


def _start_mesh(o, root: Path):
    from pdmesh.launcher import Mesh, MeshOptions
    from pdmesh_service.redis_server import free_port

    model = o.model
    if model is None:
        from pdmesh.tools.model_init import init_model

        model = init_model(root / "tiny", preset="tiny", seed=0, verbose=False)
    keys = root / "keys.json"
    keys.write_text(json.dumps({"keys": KEYS}))
    worker = ("--max-num-seqs", str(o.max_num_seqs), "--torch-threads", "2")
    options = MeshOptions(
        model_dir=Path(model),
        num_prefill=0,
        num_decode=1,
        mode="agg",
        http_port=free_port(),
        grpc_port=free_port(),
        deployment="bench-tenants",
        log_dir=root / "logs",
        worker_args=worker,
        gateway_args=(
            *("--api-keys-file", str(keys), "--class-max-queued", "batch=64,default=64"),
            *(_hold_args(o) if o.hold_slots else ()),
        ),
    )
    mesh = Mesh(options)
    mesh.start(timeout_s=300, progress=lambda line: None)
    return mesh, Path(model)


def _hold_args(o: argparse.Namespace) -> tuple[str, ...]:
    """Slots held to the end, as many as the decode batch, `--reserved-slots` of them urgent."""
    slots = ("--max-starting", str(o.max_num_seqs), "--reserved-slots", str(o.reserved_slots))
    return ("--hold-slots-until-end", *slots)


def run(o: argparse.Namespace) -> dict[str, Any]:
    from pdmesh_engine.model.configs import read_model_config

    with tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp:
        mesh, model = _start_mesh(o, Path(tmp))
        try:
            config = read_model_config(model)
            max_len = min(config.max_position_embeddings, o.max_model_len)
            jobs, arrivals, flood, scaling = _workload(o, max_len, config.vocab_size)
            url = f"http://127.0.0.1:{mesh.options.http_port}"
            fair_jobs = flood  # long enough outputs that the engine, not the front door, saturates
            result = {
                "scaling": scaling,
                "unloaded": asyncio.run(_phase(url, o, jobs, arrivals, None, (None, None))),
                "classes_on": asyncio.run(
                    _phase(url, o, jobs, arrivals, flood, ("interactive", "batch"))
                ),
                "classes_off": asyncio.run(_phase(url, o, jobs, arrivals, flood, (None, None))),
                "fairness": asyncio.run(_fairness(url, o, fair_jobs)),
            }
            mesh_view = httpx.get(
                f"{url}/mesh", headers={"Authorization": f"Bearer {KEY_OF['inter']}"}
            ).json()
            result["gateway_tenants"] = mesh_view.get("tenants")
            result["gateway_args"] = list(mesh.options.gateway_args[2:])
        finally:
            mesh.stop()
    unloaded = result["unloaded"]["inter_ttft_p90_s"]
    for phase in ("classes_on", "classes_off"):
        p90 = result[phase]["inter_ttft_p90_s"]
        result[phase]["p90_over_unloaded"] = p90 / unloaded if p90 and unloaded else None
    return result


def print_summary(r: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    print("interactive TTFT p90:")
    print(f"  unloaded     {ms(r['unloaded']['inter_ttft_p90_s'])}")
    for phase in ("classes_on", "classes_off"):
        p = r[phase]
        ratio = p["p90_over_unloaded"]
        ratio_text = "-" if ratio is None else f"{ratio:.2f}x unloaded"
        print(
            f"  {phase:<12} {ms(p['inter_ttft_p90_s'])} ({ratio_text}); "
            f"bulk ok {p['bulk']['ok']}, 429 {p['bulk']['rejected_429']}"
        )
    f = r["fairness"]
    ratio = f["tokens_a_over_b"]
    print(
        f"fairness (offered 10:1): tokens a {f['a']['tokens']}, b {f['b']['tokens']}, "
        f"a/b {'-' if ratio is None else f'{ratio:.2f}'}"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: a tiny seeded one)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="the interactive tenant's trace")
    p.add_argument("--num-requests", type=int, default=30, help="interactive requests per phase")
    p.add_argument("--rate", type=float, default=2.0, help="interactive arrivals per second")
    p.add_argument("--max-model-len", type=int, default=512, help="lengths scaled to this")
    p.add_argument("--flood-concurrency", type=int, default=48)
    p.add_argument("--flood-input-len", type=int, default=128)
    p.add_argument("--flood-output-len", type=int, default=64)
    p.add_argument(
        "--fair-concurrency",
        type=int,
        default=None,
        help="k: loops of 10k and k (default: the batch)",
    )
    p.add_argument("--fair-duration-s", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--max-num-seqs", type=int, default=8, help="the decode rank's batch")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument(
        "--hold-slots",
        action="store_true",
        help="the gateway holds fair-queue slots to the request's end (--max-starting = "
        "--max-num-seqs, --reserved-slots of them for interactive)",
    )
    p.add_argument("--reserved-slots", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tenants", help="priority classes and fairness between tenants")
    add_arguments(p)
    p.set_defaults(run=_run_cli)


def _run_cli(o: argparse.Namespace) -> int:
    result = run(o)
    if o.out is not None:
        o.out.write_text(json.dumps(result, indent=2))
    print_summary(result)
    return 0
