"""The mesh side of `pdmesh bench costs`: TTFT and ITL of short requests on a real, idle mesh.

`run_mesh` starts a mesh as `pdmesh up` does (`pdmesh.launcher.Mesh`: a private embedded Redis,
kvstore, eplb, the workers, the gateway, all on loopback, free ports; the workers get the engine
options as flags and, unless given, `cores // worker processes` torch threads, as `pdmesh up`
gives them), sends the requests one at a time (each after the previous stream ended, with a short
pause: the mesh is idle when a request arrives) as streaming `POST /v1/completions` with token-id
prompts, `max_tokens`, `ignore_eos` and temperature 0 (`pdmesh_bench.serve.Sender`), and stops the
mesh. The first `warmup` requests are dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from functools import partial
from itertools import pairwise
from pathlib import Path

import httpx
import torch

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_bench.costs_fit import StepModel, attention_tokens
from pdmesh_bench.costs_host import HostGuard
from pdmesh_bench.costs_steps import FIRST_TOKEN_ID
from pdmesh_bench.serve import Result, Sender, fetch_model
from pdmesh_bench.traces import Job
from pdmesh_engine.model.registry import read_model_config
from pdmesh_service.redis_server import free_port
from pdmesh_service.worker.engine_options import engine_argv

PAUSE_S = 0.2  # between requests: the previous one's blocks are released, the loops are idle
BATCH = 8  # then this many streams at once: what a decode step pays per sequence it streams


@dataclass(frozen=True)
class MeshRun:
    """What one mesh measured: per request its TTFT, and every gap between its token chunks."""

    mode: str  # "agg" (1 decode that prefills) or "disagg" (1 prefill + 1 decode)
    worker_threads: int  # torch threads each worker ran with
    ttft_s: list[float]
    itl_s: list[float]
    num_errors: int
    startup_s: float
    batch_itl_s: list[float]  # gaps of BATCH streams sent at once (the later half of each)


def worker_threads(args: argparse.Namespace, options: MeshOptions) -> int:
    """The torch threads `pdmesh up` gives each worker: --torch-threads, else cores / workers."""
    if args.torch_threads is not None:
        return int(args.torch_threads)
    return max(1, (os.cpu_count() or 1) // max(1, options.num_worker_processes))


def mesh_options(
    args: argparse.Namespace, model_dir: Path, mode: str, log_dir: Path
) -> MeshOptions:
    options = MeshOptions(
        model_dir=model_dir,
        num_prefill=1 if mode == "disagg" else 0,
        num_decode=1,
        mode=mode,
        http_port=free_port(),
        grpc_port=free_port(),
        deployment=f"bench-costs-{os.getpid()}-{mode}",
        log_dir=log_dir / mode,
    )
    threads = worker_threads(args, options)
    flags = engine_argv(argparse.Namespace(**{**vars(args), "torch_threads": threads}))
    return replace(options, worker_args=tuple(flags))


def run_mesh(
    args: argparse.Namespace,
    model_dir: Path,
    mode: str,
    log_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    warmup: int,
) -> MeshRun:
    options = mesh_options(args, model_dir, mode, log_dir)
    say = lambda line: print(f"bench costs: [{mode}] {line}", file=sys.stderr, flush=True)  # noqa: E731
    start = time.perf_counter()
    mesh = Mesh(options)
    mesh.start(timeout_s=args.mesh_timeout_s, progress=say)
    startup_s = time.perf_counter() - start
    try:
        url = f"http://{options.host}:{options.http_port}"
        results = asyncio.run(_send(url, prompts, max_tokens, args.mesh_timeout_s))
        fresh = [[t + 1 for t in p] for p in prompts[:BATCH]]  # no prefix hits on the first round
        batch = asyncio.run(_send(url, fresh, 2 * max_tokens, args.mesh_timeout_s, at_once=True))
    finally:
        mesh.stop()
    kept = [r for r in results[warmup:] if r.ok]
    # the later half of each stream: every stream decodes then, none is still being prefilled
    late = [r.token_times[len(r.token_times) // 2 :] for r in batch if r.ok]
    return MeshRun(
        mode,
        worker_threads(args, options),
        [r.ttft_s for r in kept],
        [b - a for r in kept for a, b in pairwise(r.token_times)],
        sum(1 for r in [*results, *batch] if not r.ok),
        startup_s,
        [b - a for times in late for a, b in pairwise(times)],
    )


async def _send(
    url: str, prompts: list[list[int]], max_tokens: int, timeout_s: float, at_once: bool = False
) -> list[Result]:
    """One at a time (each after the previous one ended, and a pause), or all `at_once`."""
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        model, _ = await fetch_model(client, url)
        sender = Sender(client, f"{url}/v1/completions", model, timeout_s, len(prompts), 0)
        jobs = [Job(index, prompt, max_tokens, None) for index, prompt in enumerate(prompts)]
        if at_once:
            return list(await asyncio.gather(*(sender.issue(j, time.perf_counter()) for j in jobs)))
        results = []
        for job in jobs:
            results.append(await sender.issue(job, time.perf_counter()))
            await asyncio.sleep(PAUSE_S)
    for error in sender.errors[:3]:
        print(f"bench costs: request failed: {error}", file=sys.stderr)
    return results


def measure_overheads(
    args: argparse.Namespace,
    model_dir: Path,
    log_dir: Path,
    model: StepModel,
    transfer: tuple[float, float, float],
    mesh: dict[str, int],
    guard: HostGuard,
) -> tuple[dict[str, float], dict[str, str]]:
    """request_s, handoff_s, token_s from an agg and a disagg mesh (formulas: pdmesh_bench.costs);
    `transfer` = (latency s, bytes/s, KV bytes per token)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    length, max_tokens = mesh["prompt"], mesh["max_tokens"]
    vocab = read_model_config(model_dir).vocab_size

    def prompts() -> list[list[int]]:
        shape = (mesh["requests"], length)
        return torch.randint(FIRST_TOKEN_ID, vocab, shape, generator=gen).tolist()

    runs = {
        mode: guard.guarded(
            f"{mode} mesh",
            partial(
                run_mesh, args, model_dir, mode, log_dir, prompts(), max_tokens, mesh["warmup"]
            ),
        )
        for mode in ("agg", "disagg")
    }
    for run in runs.values():
        if len(run.ttft_s) < 1 or len(run.itl_s) < 1:
            raise RuntimeError(f"the {run.mode} mesh answered no request ({run.num_errors} errors)")
    prefill_attn = attention_tokens(0, length)
    agg, disagg = runs["agg"], runs["disagg"]
    # the ITL samples run from context length + 1 to length + max_tokens - 1
    context = length + max_tokens // 2
    tokens = {run.mode: itl_overhead(run, model, context) for run in runs.values()}
    # per thread count of the decode rank: the agg mesh's rank has every core, the disagg's fewer
    token_s = {run.worker_threads: max(0.0, tokens[run.mode]) for run in runs.values()}
    # per sequence a step streams: BATCH streams' ITL past the batch's step and token_s
    batch_context = length + 3 * max_tokens // 2
    sequence_s = {
        run.worker_threads: max(
            0.0,
            (
                statistics.median(run.batch_itl_s)
                - model.step_s(run.worker_threads, BATCH, BATCH * (batch_context + 1))
                - token_s[run.worker_threads]
            )
            / BATCH,
        )
        for run in runs.values()
        if run.batch_itl_s
    }
    agg_prefill = model.step_s(agg.worker_threads, length, prefill_attn)
    request_s = statistics.median(agg.ttft_s) - agg_prefill - token_s[agg.worker_threads]
    latency_s, bytes_per_s, bytes_per_token = transfer
    transfer_s = latency_s + length * bytes_per_token / bytes_per_s
    handoff_s = (
        statistics.median(disagg.ttft_s)
        - max(0.0, request_s)
        - model.step_s(disagg.worker_threads, length, prefill_attn)
        - transfer_s
    )
    overheads = {
        "request_s": max(0.0, request_s),
        "handoff_s": max(0.0, handoff_s),
        "token_s": {str(threads): value for threads, value in sorted(token_s.items())},
        "sequence_s": {str(threads): value for threads, value in sorted(sequence_s.items())},
    }
    return overheads, {"overheads": overhead_note(runs, mesh, tokens, request_s, handoff_s)}


def itl_overhead(run: MeshRun, model: StepModel, context: int) -> float:
    """Median ITL - the 1-token step at the worker's threads and the stream's median context."""
    return statistics.median(run.itl_s) - model.step_s(run.worker_threads, 1, context + 1)


def overhead_note(
    runs: dict[str, MeshRun],
    mesh: dict[str, int],
    tokens: dict[str, float],
    request_s: float,
    handoff_s: float,
) -> str:
    parts = [
        f"{run.mode} mesh ({run.worker_threads} torch threads per worker, started in "
        f"{run.startup_s:.0f} s): TTFT p50 {statistics.median(run.ttft_s) * 1e3:.2f} ms, "
        f"ITL p50 {statistics.median(run.itl_s) * 1e3:.2f} ms over {len(run.ttft_s)} requests, "
        f"{run.num_errors} errors; its token_s {tokens[run.mode] * 1e3:.2f} ms; {BATCH} streams "
        f"at once: ITL p50 {statistics.median(run.batch_itl_s or [0.0]) * 1e3:.2f} ms"
        for run in runs.values()
    ]
    return (
        f"{mesh['requests']} requests per mesh ({mesh['warmup']} untimed) of {mesh['prompt']} "
        f"random prompt tokens, max_tokens {mesh['max_tokens']}, one at a time on an idle mesh; "
        f"unclamped request_s {request_s * 1e3:.2f} ms, handoff_s {handoff_s * 1e3:.2f} ms; "
        "token_s by the decode rank's torch threads (the agg mesh's rank, on every core, shares "
        "them with its own gRPC thread and the gateway); request_s uses the agg one. "
        + ". ".join(parts)
    )
