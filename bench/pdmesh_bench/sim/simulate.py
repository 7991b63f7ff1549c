"""One simulated run: a workload (`serve.build_workload`, as `pdmesh bench serve` builds it) through
a `SimMesh`, summarised with `serve.summarize` so that a simulated run's JSON has the real
benchmark's keys, plus `sim`: per-instance utilisation, throughput per instance and per rank
("GPU"), the gateway's queue over time and the run's settings.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from pdmesh_bench.serve import (
    Result,
    ServeOptions,
    arrival_mode,
    build_workload,
    closed_loop,
    open_loop,
    session_loop,
    summarize,
)
from pdmesh_bench.sim.clock import run_virtual
from pdmesh_bench.sim.costs import Costs
from pdmesh_bench.sim.mesh import GatewayOptions, SimMesh, Topology
from pdmesh_bench.traces import distribution

QUEUE_SAMPLES = 400  # points of the queue-over-time series (at most)


def simulate(
    costs: Costs, topology: Topology, gateway: GatewayOptions, workload: ServeOptions
) -> dict[str, Any]:
    """The run's summary (`serve.summarize`'s keys) with `sim` and `config`."""
    return run_virtual(_simulate(costs, topology, gateway, workload))


async def _simulate(
    costs: Costs, topology: Topology, gateway: GatewayOptions, o: ServeOptions
) -> dict[str, Any]:
    max_model_len = o.max_model_len or costs.max_model_len
    work = build_workload(o, max_model_len)
    jobs = work.jobs(o.seed)
    mesh = SimMesh(costs, topology, gateway)
    config = {
        **asdict(o),
        "max_model_len": max_model_len,
        "model": costs.name,
        "url": f"sim {topology}",
        "mode": arrival_mode(o),
        "topology": asdict(topology),
        "gateway": {k: str(v) if v is not None else None for k, v in asdict(gateway).items()},
        "costs": costs.source,
    }
    queue: list[tuple[float, int, int]] = []  # (time, waiting at the gateway, running on decode)
    sampler = asyncio.get_running_loop().create_task(_sample(mesh, queue))
    deadline = None if o.duration_s is None else o.duration_s
    if o.dp_replay is not None:
        from pdmesh_bench.dp_replay import replay_all

        dp_size = o.dp_size or (
            topology.prefill_dep if topology.mode == "disagg" else topology.decode_dep
        )
        replayed = await replay_all(o, work, config, dp_size, lambda _: mesh)
        sampler.cancel()
        mesh.close()
        return {**replayed, "sim": report(mesh, [], mesh.clock(), queue)}
    if work.sessions is not None:
        results = await session_loop(mesh, jobs, work.sessions, o.think_s, o.concurrency, deadline)
    elif o.concurrency is not None:
        results = await closed_loop(mesh, jobs, o.concurrency, deadline)
    else:
        results = await open_loop(mesh, jobs, 0.0, deadline)
    duration = mesh.clock()
    sampler.cancel()
    mesh.close()
    summary = summarize(results, duration, None, work.reusable())
    summary["sim"] = report(mesh, results, duration, queue)
    summary["config"] = config
    summary["scaling"] = work.info
    return summary


async def _sample(mesh: SimMesh, queue: list[tuple[float, int, int]]) -> None:
    """The gateway's queue and decode's running requests, each time either changes (bounded:
    every other point is dropped when the list fills)."""
    last = (-1, -1)
    while True:
        now = (mesh.admission.waiting, sum(r.scheduler.num_running for r in mesh.decode_ranks))
        if now != last:
            queue.append((mesh.clock(), *now))
            last = now
            if len(queue) >= 2 * QUEUE_SAMPLES:
                del queue[1::2]
        await asyncio.sleep(0.01)


def report(
    mesh: SimMesh, results: list[Result], duration: float, queue: list[tuple[float, int, int]]
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    duration = max(duration, 1e-9)
    topology = mesh.topology
    instances = {
        i.name: {"steps": i.num_steps, "busy_fraction": i.busy_s / duration} for i in mesh.instances
    }
    return {
        "topology": str(topology),
        "num_ranks": topology.num_ranks,
        "output_tokens_per_s_per_instance": out_tokens
        / duration
        / (len(mesh.decodes) + len(mesh.prefills)),
        "output_tokens_per_s_per_rank": out_tokens / duration / topology.num_ranks,
        "input_tokens_per_s_per_prefill_rank": (
            sum(r.prompt_tokens - r.cached_tokens for r in ok)
            / duration
            / topology.num_prefill_ranks
            if topology.num_prefill_ranks
            else None
        ),
        "queue_s": distribution([q for q in mesh.queue_s.values()]),
        "num_local_prefills": mesh.num_local,
        "num_disaggregated": mesh.num_disaggregated,
        "num_reserve_retries": mesh.num_reserve_retries,
        "local_threshold_tokens": mesh.handoffs.threshold_tokens,
        "instances": instances,
        "queue_over_time": [list(q) for q in queue],
    }
