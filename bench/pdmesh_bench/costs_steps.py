"""The engine side of `pdmesh bench costs`: whole `EngineCore.step()` calls timed in this process
(the model and its formulas: `pdmesh_bench.costs`).

`StepBench` owns one `EngineCore` built with the workers' engine options and switches torch's
intra-op threads between timed steps (`threads`, interleaved step by step, so every thread count
meets the same drift of a shared host). Each timed step is `pdmesh_bench.engine.StepRecorder`'s:
schedule + forward + sample + update, the scheduler's output kept, from which T (tokens computed)
and A (`costs_fit.attention_tokens` summed over the scheduled requests) are read, never assumed.
Prompts are seeded random token ids, fresh for every request (no prefix-cache hits); requests run
greedy with EOS ignored.

    decode(B, C)     B requests with C-token prompts are prefilled (untimed, at the most
                     threads), then warmup + repeats steps per thread count each decode all B
                     (context C, C+1, ...); the requests are aborted after
    prefill(T)       per timed step, fresh prompts summing to T tokens (one prompt unless the
                     context is shorter) with max_tokens 1 are added, one step computes all of
                     them, and the engine is drained
    moe_share(B, C)  a decode batch as above, stepped under `pdmesh_bench.forward.module_times`'s
                     hooks: the MoE modules' inclusive time / the hooked step's wall time
    expert_rows(n)   the expert-load ring's rows of the last n steps ([L][P] tokens per slot)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdmesh_bench.costs_fit import attention_tokens
from pdmesh_bench.engine import StepRecorder
from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import SchedulerOutput
from pdmesh_engine.transfer.layout import handoff_nbytes

MOE_LABEL = "moe (router + experts + shared)"  # pdmesh_bench.forward's label of a MoE layer
FIRST_TOKEN_ID = 16  # prompts draw ids from [16, vocab): clear of the special tokens


@dataclass(frozen=True)
class StepTime:
    """One timed engine step: T tokens computed, A context positions attended, its wall time."""

    threads: int
    num_tokens: int
    attn_tokens: int
    seconds: float


def attention_of(output: SchedulerOutput) -> int:
    """A of a scheduled step: its new tokens' attended positions, summed."""
    return sum(attention_tokens(s.start_position, len(s.token_ids)) for s in output.scheduled)


def median_time(times: list[StepTime], threads: int) -> tuple[float, float, float]:
    """(median seconds, median T, median A) of the steps timed at `threads`."""
    mine = [t for t in times if t.threads == threads]
    if not mine:
        raise ValueError(f"no step was timed at {threads} threads")
    return (
        statistics.median(t.seconds for t in mine),
        statistics.median(t.num_tokens for t in mine),
        statistics.median(t.attn_tokens for t in mine),
    )


class StepBench:
    def __init__(self, engine: EngineCore, threads: list[int], seed: int) -> None:
        if not threads or min(threads) < 1:
            raise ValueError(f"thread counts must be >= 1, got {threads}")
        self.engine, self.threads = engine, sorted(set(threads))
        self.recorder = StepRecorder(engine)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = engine.model_config.vocab_size
        self.budget = engine.config.max_num_batched_tokens
        # the longest prompt admitted (one output token must fit) that one step can compute
        self.max_prompt = min(engine.max_model_len - 1, self.budget)

    # ----- requests -----
    def prompt(self, length: int) -> list[int]:
        return torch.randint(FIRST_TOKEN_ID, self.vocab, (length,), generator=self.gen).tolist()

    def _drain(self) -> None:
        while self.engine.has_unfinished:
            self.engine.step()

    def _start_batch(self, batch: int, context: int, steps_after: int) -> list[str]:
        """B requests of C-token prompts, stepped (untimed) until every one has its first token;
        each may still decode `steps_after` tokens."""
        torch.set_num_threads(max(self.threads))
        lead = -(-batch * context // self.budget) + 2  # steps the prefill may take
        params = SamplingParams(max_tokens=lead + steps_after + 2, temperature=0.0, ignore_eos=True)
        ids = [self.engine.add_request(self.prompt(context), params) for _ in range(batch)]
        started: set[str] = set()
        for _ in range(10 * lead):
            started.update(o.request_id for o in self.engine.step())
            if len(started) == batch:
                return ids
        raise RuntimeError(
            f"{batch} prompts of {context} tokens did not start in {10 * lead} steps"
        )

    def _end_batch(self, ids: list[str]) -> None:
        for request_id in ids:
            self.engine.abort(request_id)
        self._drain()

    # ----- timing -----
    def _timed(
        self, runs: int, warmup: int, expected: int, before: Callable[[], None] | None = None
    ) -> list[StepTime]:
        """`runs` rounds of one step per thread count; the rounds after `warmup` are kept. With
        `before` (adds requests), each step is followed by a drain."""
        out: list[StepTime] = []
        for i in range(runs):
            for threads in self.threads:
                torch.set_num_threads(threads)
                if before is not None:
                    before()
                self.recorder.step()
                seconds, output = self.recorder.steps[-1]
                if output.num_tokens != expected:
                    raise RuntimeError(
                        f"a timed step computed {output.num_tokens} tokens, expected {expected}"
                    )
                if i >= warmup:
                    out.append(StepTime(threads, output.num_tokens, attention_of(output), seconds))
                if before is not None:
                    self._drain()
        self.recorder.steps.clear()
        return out

    def decode(self, batch: int, context: int, warmup: int, repeats: int) -> list[StepTime]:
        """Steps that each decode `batch` requests at context `context` and a little more."""
        runs = warmup + repeats
        ids = self._start_batch(batch, context, runs * len(self.threads))
        try:
            return self._timed(runs, warmup, batch)
        finally:
            self._end_batch(ids)

    def prefill_lengths(self, num_tokens: int) -> list[int]:
        """Prompt lengths summing to T: one prompt, or as few equal ones as the context allows."""
        if num_tokens > self.budget:
            raise ValueError(f"{num_tokens} tokens exceed the step budget {self.budget}")
        count = -(-num_tokens // self.max_prompt)
        return [num_tokens // count + (i < num_tokens % count) for i in range(count)]

    def prefill(
        self, num_tokens: int, warmup: int, repeats: int, lengths: list[int] | None = None
    ) -> list[StepTime]:
        """Steps that each prefill fresh prompts of `lengths` (default `prefill_lengths(T)`)."""
        lengths = lengths or self.prefill_lengths(num_tokens)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def add() -> None:
            for length in lengths:
                self.engine.add_request(self.prompt(length), params)

        return self._timed(warmup + repeats, warmup, sum(lengths), add)

    # ----- MoE -----
    def moe_share(self, batch: int, context: int, repeats: int) -> dict[int, float | None]:
        """Per thread count: the MoE modules' inclusive time / the wall time of the same hooked
        decode steps; None where no MoE module ran in Python (a C layer path)."""
        from pdmesh_bench.forward import module_times

        model = self.engine.runner.model
        ids = self._start_batch(batch, context, (repeats + 1) * len(self.threads))
        shares: dict[int, float | None] = {}
        try:
            for threads in self.threads:
                torch.set_num_threads(threads)
                self.engine.step()  # warm at this thread count
                start = time.perf_counter()
                modules = module_times(model, self.engine.step, repeats)
                step_ms = (time.perf_counter() - start) * 1e3 / repeats
                moe_ms = modules.get(MOE_LABEL)
                shares[threads] = None if moe_ms is None else min(1.0, moe_ms / step_ms)
        finally:
            self._end_batch(ids)
        return shares

    def expert_rows(self, num_steps: int) -> list[list[list[int]]]:
        """The expert-load ring's rows ([L][P] tokens per slot) of the last `num_steps` steps
        (fewer if the ring holds fewer); [] for a model without routed experts."""
        recorder = self.engine.runner.expert_load
        if recorder is None:
            return []
        window = recorder.counts.shape[0]
        first = max(recorder.step - min(num_steps, window), recorder.restart_step)
        return [recorder.counts[s % window].tolist() for s in range(first, recorder.step)]


def handoff_bytes(engine: EngineCore) -> tuple[float, float]:
    """(bytes per prompt token, mean fixed bytes per hand-off) of this engine's KV hand-off: the
    groups that move every block give the per-token bytes (block bytes / block size); the groups
    that move only the blocks of the last `span` positions (V4's window) a fixed part, averaged
    over where the prompt ends within a block."""
    groups = [memory.group() for memory in engine.kv_memory()]
    per_token = sum(g.bytes_per_block / g.block_size for g in groups if not g.span)
    windowed = [g for g in groups if g.span]
    if not windowed:
        return per_token, 0.0
    period = max(g.block_size for g in windowed)
    lengths = range(4 * period, 5 * period)  # past the first window: the steady state
    fixed = statistics.mean(sum(handoff_nbytes(windowed, n).values()) for n in lengths)
    return per_token, fixed
