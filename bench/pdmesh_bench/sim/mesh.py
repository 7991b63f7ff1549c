"""A simulated mesh: the gateway's request path over simulated instances, on the virtual clock.

    Job → (request_s / 2) → local prefill? (routing.prefills_locally, HandoffModel)
        ├ local or agg: the decode rank computes the prompt and decodes (Generate)
        └ disagg: PrefillAdmission slot (FCFS, cache-aware choose_prefill) → Reserve on the least
          loaded decode rank (retried while its pool is short) → Prefill → slot released →
          KV transfer (Costs.transfer_s) → Decode from the first token
      → tokens (+ request_s / 2) → serve.Result

The gateway's own cores decide (`PrefillAdmission`, `choose_prefill`, `prefills_locally`,
`local_threshold`, `HandoffModel`), so a change to them changes the simulation too.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from pdmesh_bench.serve import Result
from pdmesh_bench.sim.costs import Costs
from pdmesh_bench.sim.ranks import Cpu, Instance, Rank, Stream
from pdmesh_bench.traces import Job
from pdmesh_engine.request import Request
from pdmesh_engine.sampling import SamplingParams
from pdmesh_gateway.admission import PrefillAdmission, QueueLimits, Shed
from pdmesh_gateway.routing import (
    HandoffModel,
    LocalPrefill,
    PrefillCandidate,
    PrefillRouting,
    choose_prefill,
    local_threshold,
    prefills_locally,
)

RESERVE_BACKOFF_S = 0.05  # a Reserve refused for lack of blocks is tried again after this


@dataclass(frozen=True)
class Topology:
    """Instances in `pdmesh up`'s terms (agg: decode instances only, each prefilling itself)."""

    prefill: int = 1
    decode: int = 1
    prefill_dep: int = 1
    decode_dep: int = 1
    mode: str = "disagg"

    def __post_init__(self) -> None:
        if self.mode not in ("agg", "disagg"):
            raise ValueError(f"mode must be agg or disagg, got {self.mode!r}")
        if self.decode < 1 or min(self.prefill, self.prefill_dep, self.decode_dep) < 0:
            raise ValueError("a topology needs >= 1 decode instance and DEP sizes >= 1")
        if self.mode == "disagg" and self.prefill < 1:
            raise ValueError("disagg needs >= 1 prefill instance (or --mode agg)")

    @property
    def num_prefill_ranks(self) -> int:
        return self.prefill * self.prefill_dep if self.mode == "disagg" else 0

    @property
    def num_ranks(self) -> int:
        """Worker processes (one per rank), and devices on a GPU machine."""
        return self.num_prefill_ranks + self.decode * self.decode_dep

    def __str__(self) -> str:
        dep = lambda d: f"(DEP{d})" if d > 1 else ""  # noqa: E731
        if self.mode == "agg":
            return f"agg {self.decode}D{dep(self.decode_dep)}"
        return f"{self.prefill}P{dep(self.prefill_dep)}{self.decode}D{dep(self.decode_dep)}"


@dataclass(frozen=True)
class GatewayOptions:
    """The gateway's options the simulation honours (the defaults are `pdmesh up`'s)."""

    max_prefill_inflight: int = 2
    prefill_routing: PrefillRouting = PrefillRouting.CACHE_AWARE
    local_prefill: LocalPrefill = LocalPrefill()
    max_queued: int | None = None
    max_queue_wait_s: float | None = None
    eplb: bool = True
    threads: int | None = None  # per rank (CPU); None: cores // ranks, as `pdmesh up` sets it
    max_kv_loads_per_step: int | None = None  # decode ranks' admission cap (None: off)


class SimMesh:
    """Instances, the gateway's state, and `issue(job)` (a `serve.Issuer`)."""

    def __init__(self, costs: Costs, topology: Topology, options: GatewayOptions) -> None:
        self.costs, self.topology, self.options = costs, topology, options
        loop = asyncio.get_running_loop()
        self.clock = loop.time
        threads = options.threads
        if threads is None and costs.cores is not None:
            threads = max(1, costs.cores // topology.num_ranks)
        cpu = Cpu(costs.cores, costs.corun_slowdown)

        def instances(role: str, count: int, dep: int) -> list[Instance]:
            """Decode ranks stream their tokens: they pay the per-step and per-sequence
            overheads; a prefill rank's one token goes with the hand-off."""
            is_decode = role == "decode"
            overhead = costs.overheads.token(threads) if is_decode else 0.0
            per_sequence = costs.overheads.sequence(threads) if is_decode else 0.0
            cap = options.max_kv_loads_per_step if is_decode else None
            return [
                Instance(
                    f"{role}-{i}",
                    costs,
                    cpu,
                    dep,
                    threads,
                    options.eplb,
                    overhead,
                    cap,
                    per_sequence,
                )
                for i in range(count)
            ]

        self.prefills = instances("prefill", topology.prefill, topology.prefill_dep)
        if topology.mode == "agg":
            self.prefills = []
        self.decodes = instances("decode", topology.decode, topology.decode_dep)
        self.prefill_ranks = {r.name: r for i in self.prefills for r in i.ranks}
        self.decode_ranks = [r for i in self.decodes for r in i.ranks]
        limits = QueueLimits(options.max_queued, options.max_queue_wait_s)
        self.admission = PrefillAdmission(options.max_prefill_inflight, limits, self.clock)
        self.admission.refresh(len(self.prefill_ranks))
        self.handoffs = HandoffModel()
        self.num_local = self.num_disaggregated = self.num_reserve_retries = 0
        self.queue_s: dict[int, float] = {}  # job index → its wait for a prefill slot
        self.errors: list[str] = []
        self._ids = itertools.count()
        self._last_prefill = ""
        self._tasks = [
            loop.create_task(i.run(), name=i.name) for i in [*self.prefills, *self.decodes]
        ]

    @property
    def instances(self) -> list[Instance]:
        return [*self.prefills, *self.decodes]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def issue(self, job: Job, scheduled: float, rank: int | None = None) -> Result:
        """One request end to end (module docstring); its times are on the virtual clock.
        `rank`: pinned to that DP rank (the prefill rank; in agg, the decode rank)."""
        result = Result(job.index, scheduled, rank, prompt_tokens=len(job.prompt))
        half = self.costs.overheads.request_s / 2
        await asyncio.sleep(half)
        request_id = f"sim-{next(self._ids)}"
        try:
            if rank is None and self._is_local(job.prompt) or not self.prefill_ranks:
                self.num_local += 1
                times, cached = await self._generate(request_id, job, rank)
            else:
                self.num_disaggregated += 1
                times, cached = await self._disaggregated(request_id, job, rank)
        except Shed as e:
            result.error = f"429: {e}"
            self.errors.append(result.error)
            result.end = self.clock()
            return result
        result.token_times = [t + half for t in times]
        result.end = result.token_times[-1]
        result.output_tokens, result.cached_tokens, result.ok = len(times), cached, True
        return result

    def _is_local(self, prompt: list[int]) -> bool:
        if not self.prefill_ranks:
            return True
        rank = _pick(self.decode_ranks, None)
        threshold = local_threshold(self.options.local_prefill, self.handoffs)
        return prefills_locally(len(prompt) - rank.cached_tokens(prompt), threshold)

    async def _generate(
        self, request_id: str, job: Job, pinned: int | None
    ) -> tuple[list[float], int]:
        rank = _pick(self.decode_ranks, pinned)
        stream = rank.add(_request(request_id, job.prompt, job.max_tokens))
        await stream.done.wait()
        return stream.token_times, stream.cached_tokens

    async def _disaggregated(
        self, request_id: str, job: Job, pinned: int | None
    ) -> tuple[list[float], int]:
        prompt = job.prompt
        choose = None
        if self.options.prefill_routing is PrefillRouting.CACHE_AWARE:
            choose = lambda usable: self._choose(prompt, usable)  # noqa: E731
        usable = list(self.prefill_ranks)
        if pinned is not None:
            usable = [usable[pinned % len(usable)]]
        arrived = self.clock()
        name = await self.admission.acquire(lambda: usable, choose, bounded=True)
        self.queue_s[job.index] = self.clock() - arrived
        assert name is not None  # there are prefill ranks (else the request is local)
        prefill = self.prefill_ranks[name]
        decode = _pick(self.decode_ranks, None)
        request = _request(request_id, prompt, job.max_tokens)
        began = self.clock()
        while not decode.reserve(request):
            self.num_reserve_retries += 1
            await asyncio.sleep(RESERVE_BACKOFF_S)
            request = _request(request_id, prompt, job.max_tokens)
        reserved = self.clock()
        first: Stream = prefill.add(_request(f"{request_id}/p", prompt, 1))
        await first.done.wait()
        transfer_s = self.costs.transfer_s(len(prompt))
        await asyncio.sleep(transfer_s)
        self.admission.release(name, len(prompt) - first.cached_tokens if choose else 0)
        prefill_s = self.clock() - reserved
        self.handoffs.observe(
            len(prompt) - first.cached_tokens, reserved - began, prefill_s, transfer_s, 0.0
        )
        now = self.clock()
        stream = decode.kv_arrived(request_id)
        await stream.done.wait()
        return [now, *stream.token_times], first.cached_tokens

    def _choose(self, prompt: list[int], usable: Sequence[str]) -> tuple[str, int]:
        candidates = [
            PrefillCandidate(
                name,
                self.prefill_ranks[name].cached_tokens(prompt),
                self.admission.queued_tokens(name),
                self.admission.in_flight(name),
            )
            for name in usable
        ]
        best = choose_prefill(len(prompt), candidates, self._last_prefill)
        self._last_prefill = best.instance_id
        return best.instance_id, len(prompt) - best.cached_tokens


def _pick(ranks: Sequence[Rank], pinned: int | None) -> Rank:
    """Rank `pinned` (modulo their number), else the least loaded (ties: the first)."""
    if pinned is not None:
        return ranks[pinned % len(ranks)]
    return min(ranks, key=lambda r: r.load)


def _request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(request_id, list(prompt), params)


def ranks_of(instances: Sequence[Instance]) -> list[Rank]:
    return [r for i in instances for r in i.ranks]
