"""Simulated engine instances: the engine's own `Scheduler` and `KVCacheManager` per rank, with
the step's forward pass replaced by `Costs.step_s` on the virtual clock.

    Request → Scheduler.schedule() → (tokens, attended) per rank → Costs.step_s → sleep
            → Scheduler.update_from_output() → Stream (token times) of each request

A DEP instance's ranks step together (every rank takes part in each step while any has work, as
the real group does), so one rank's long prefill holds back the others' decodes: DP imbalance
falls out of the lockstep. CPU cost files share `cores` among every busy rank's threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdmesh_bench.sim.costs import Costs
from pdmesh_engine.block_hash import hash_full_blocks
from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_engine.request import Request
from pdmesh_engine.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput

SAMPLED = SampledToken(1)  # every simulated step samples this token (never an EOS: no EOS ids)


@dataclass(slots=True)
class Stream:
    """One request's tokens on a rank, as times on the virtual clock."""

    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    first: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Cpu:
    """Cores shared by the ranks of a CPU machine (None: a device per rank, no sharing).

    A step that starts while other ranks compute is slowed by `corun_slowdown` (what a busy
    neighbour costs: shared caches, memory bandwidth, two vCPUs of one core) and, when more
    threads than cores are busy, by their ratio."""

    def __init__(self, cores: int | None, corun_slowdown: float = 1.0) -> None:
        self.cores, self.corun_slowdown = cores, corun_slowdown
        self.busy_threads = self.busy_ranks = 0

    def slowdown(self, threads: int) -> float:
        """What a step that starts now on `threads` threads is slowed by (1: not at all)."""
        if self.cores is None:
            return 1.0
        shared = max(1.0, (self.busy_threads + threads) / self.cores)
        return shared * (self.corun_slowdown if self.busy_ranks else 1.0)


class Rank:
    """One rank's scheduler and the streams of its requests."""

    def __init__(
        self, name: str, costs: Costs, wake: asyncio.Event, max_kv_loads_per_step: int | None = None
    ) -> None:
        self.name, self._wake = name, wake
        self.kv = KVCacheManager(costs.num_kv_blocks, costs.block_size)
        config = SchedulerConfig(
            costs.max_num_seqs,
            costs.max_num_batched_tokens,
            costs.max_model_len,
            max_kv_loads_per_step,
        )
        self.scheduler = Scheduler(config, self.kv)
        self.streams: dict[str, Stream] = {}

    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    def add(self, request: Request) -> Stream:
        """Run `request` here (its prompt computed here, then decoded)."""
        stream = self.streams[request.request_id] = Stream()
        self.scheduler.add_request(request)
        self._wake.set()
        return stream

    def reserve(self, request: Request) -> bool:
        """Blocks for a prompt computed elsewhere; False when the pool is short."""
        return self.scheduler.reserve(request) is not None

    def kv_arrived(self, request_id: str) -> Stream:
        """The reserved request's KV and first token are in: it decodes from here."""
        stream = self.streams[request_id] = Stream()
        if self.scheduler.kv_arrived(request_id, SAMPLED.token_id) is not None:
            del self.streams[request_id]  # its first token already ended it
            stream.done.set()
        self._wake.set()
        return stream

    def cached_tokens(self, prompt: list[int]) -> int:
        """Leading prompt tokens this rank's prefix cache holds (what the kvstore's index says),
        leaving >= 1 token to compute; looks, changes nothing."""
        size = self.kv.block_size
        hashes = hash_full_blocks(prompt[: (len(prompt) - 1) // size * size], size)
        hits = 0
        for block_hash in hashes:
            if self.kv.pool.lookup(block_hash) is None:
                break
            hits += 1
        return hits * size

    def work(self, output: SchedulerOutput) -> tuple[int, int, int]:
        """(new tokens, positions its decode tokens attend, positions its prefill tokens attend)
        of a scheduled step: a chunk of n tokens from position p attends n p + n (n + 1) / 2;
        a one-token chunk is a decode."""
        decode = prefill = 0
        for item in output.scheduled:
            n, p = len(item.token_ids), item.start_position
            if n == 1:
                decode += p + 1
            else:
                prefill += n * p + n * (n + 1) // 2
        return output.num_tokens, decode, prefill

    def finish_step(self, output: SchedulerOutput, now: float) -> None:
        sampled = {s.request_id: SAMPLED for s in output.scheduled if s.needs_sample}
        for result in self.scheduler.update_from_output(output, sampled):
            stream = self.streams.get(result.request_id)
            if stream is None:
                continue
            if not stream.token_times:
                stream.cached_tokens = result.num_cached_tokens
                stream.first.set()
            stream.token_times.extend([now] * len(result.new_token_ids))
            if result.finish_reason is not None:
                del self.streams[result.request_id]
                stream.done.set()


class Instance:
    """A prefill or decode instance of `dep` ranks (DEP when > 1), stepping in lockstep."""

    def __init__(
        self,
        name: str,
        costs: Costs,
        cpu: Cpu,
        dep: int = 1,
        threads: int | None = None,
        eplb: bool = True,
        step_overhead_s: float = 0.0,
        max_kv_loads_per_step: int | None = None,
        sequence_overhead_s: float = 0.0,
    ) -> None:
        self.name, self.costs, self.cpu, self.threads, self.eplb = name, costs, cpu, threads, eplb
        self.step_overhead_s, self.sequence_overhead_s = step_overhead_s, sequence_overhead_s
        self._wake = asyncio.Event()
        self.ranks = [
            Rank(f"{name}/{r}" if dep > 1 else name, costs, self._wake, max_kv_loads_per_step)
            for r in range(dep)
        ]
        self.num_steps = self.max_batch = 0
        self.busy_s = 0.0

    async def run(self) -> None:
        """Step while any rank has work; sleep until woken otherwise."""
        loop = asyncio.get_running_loop()
        while True:
            outputs = [r.scheduler.schedule() for r in self.ranks]
            if all(o.is_empty for o in outputs):
                self._wake.clear()
                await self._wake.wait()
                continue
            work = [r.work(o) for r, o in zip(self.ranks, outputs, strict=True)]
            self.max_batch = max(self.max_batch, max(len(o.scheduled) for o in outputs))
            step_s = self.costs.step_s(work, self.threads, self.eplb) + self.step_overhead_s
            step_s += self.sequence_overhead_s * max(_num_sampling(o) for o in outputs)
            # on shared cores only the ranks with work compute (a DEP rank's dummy step is cheap)
            active = sum(1 for o in outputs if not o.is_empty)
            threads = (self.threads or 1) * active
            step_s *= self.cpu.slowdown(threads)
            self.cpu.busy_threads += threads
            self.cpu.busy_ranks += active
            try:
                await asyncio.sleep(step_s)
            finally:
                self.cpu.busy_threads -= threads
                self.cpu.busy_ranks -= active
            self.num_steps += 1
            self.busy_s += step_s
            for rank, output in zip(self.ranks, outputs, strict=True):
                rank.finish_step(output, loop.time())

    def least_loaded(self) -> Rank:
        return min(self.ranks, key=lambda r: r.load)


def _num_sampling(output: SchedulerOutput) -> int:
    """Sequences whose token this step streams."""
    return sum(1 for s in output.scheduled if s.needs_sample)


def by_load(instances: Sequence[Instance]) -> list[Rank]:
    """Every rank of `instances`, least loaded first (ties in order)."""
    ranks = [r for i in instances for r in i.ranks]
    return sorted(ranks, key=lambda r: r.load)
