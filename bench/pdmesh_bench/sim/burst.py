"""The decode admission cap's burst (`pdmesh bench admission`) on the simulator: R requests whose
KV arrives at one decode rank at once, stepped until each has its M tokens, per cap; the same
figures the real bench reports, so `pdmesh bench admission --sim COSTS.json` prints both."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from typing import Any

from pdmesh_bench.allreduce import percentile
from pdmesh_bench.sim.clock import run_virtual
from pdmesh_bench.sim.costs import Costs
from pdmesh_bench.sim.ranks import Cpu, Instance, Stream
from pdmesh_engine.request import Request
from pdmesh_engine.sampling import SamplingParams


def simulate_burst(
    costs: Costs,
    requests: int,
    prompt_len: int,
    max_tokens: int,
    cap: int | None,
    threads: int | None = None,
) -> dict[str, Any]:
    """steps, tokens_per_s, ITL and wait p50/p99 (ms) and the largest decode batch of one
    burst (wait: arrival to a request's first decode token; M counts the prefill's token)."""
    return run_virtual(_burst(costs, requests, prompt_len, max_tokens, cap, threads))


async def _burst(
    costs: Costs, num: int, prompt_len: int, max_tokens: int, cap: int | None, threads: int | None
) -> dict[str, Any]:
    costs = replace(costs, max_num_seqs=max(num, costs.max_num_seqs))
    instance = Instance("decode", costs, Cpu(None), 1, threads, max_kv_loads_per_step=cap)
    rank = instance.ranks[0]
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num):
        prompt = [rng.randrange(16, 1024) for _ in range(prompt_len)]
        if not rank.reserve(Request(f"r{i}", prompt, params)):
            raise ValueError("the cost file's KV pool is too small for the burst")
    loop = asyncio.get_running_loop()
    runner = loop.create_task(instance.run())
    t0 = loop.time()
    streams: list[Stream] = [rank.kv_arrived(f"r{i}") for i in range(num)]
    await asyncio.gather(*(s.done.wait() for s in streams))
    runner.cancel()
    times = [[t - t0 for t in s.token_times] for s in streams]
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:], strict=False)]
    waits = [ts[0] for ts in times]
    end = max(ts[-1] for ts in times)
    return {
        "cap": "off" if cap is None else str(cap),
        "steps": instance.num_steps,
        "tokens_per_s": sum(len(ts) for ts in times) / end,
        "itl_ms_p50": 1e3 * percentile(gaps, 50) if gaps else 0.0,
        "itl_ms_p99": 1e3 * percentile(gaps, 99) if gaps else 0.0,
        "wait_ms_p50": 1e3 * percentile(waits, 50),
        "wait_ms_p99": 1e3 * percentile(waits, 99),
        "max_batch": instance.max_batch,
    }
