"""Continuous batching with chunked prefill: `schedule()` and `update_from_output()`, pure and
deterministic.

Each step gets a token budget. Running requests go first (a decode takes one token, an unfinished
prefill takes a chunk), then waiting requests in priority order (`SamplingParams.priority`, lower
first; equal priorities in arrival order), which reuse cached prefix blocks.
When blocks run out, the latest running request is preempted and recomputed later.
With `max_kv_loads_per_step` N, at most N requests whose KV just arrived (`kv_arrived`) join the
running batch per step; the queue stays in arrival order, so a capped request blocks those behind it
until the next step.

Speculative decoding (`num_spec_tokens` K > 0): a decoding request is scheduled with its last token
plus the drafts the runner proposed in its previous step (`Request.spec_token_ids`, at most K, fewer
when the budget, max_tokens or the context leave less room), and a request whose chunk samples also
holds blocks for `num_lookahead_tokens` positions past it, where the proposer writes its own KV.
The runner answers such requests with `SpecTokens`; `num_computed_tokens` then advances over the
accepted drafts only (the tokens after the first rejection are recomputed, their KV overwritten),
so only verified blocks get prefix-cache hashes.
No sockets, no devices: the model runner turns a `SchedulerOutput` into a forward pass.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_engine.request import Request, RequestStatus
from pdmesh_engine.sampling import check_prompt


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # at most this many kv-loaded requests (see `Request.kv_loaded`) are admitted per step;
    # None or 0: no cap
    max_kv_loads_per_step: int | None = None
    num_spec_tokens: int = 0  # K drafts per decode step (0: speculative decoding off)
    num_lookahead_tokens: int = 0  # positions past a sampling chunk the proposer writes


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # tokens computed this step (drafts last)
    start_position: int  # position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: list[int]  # every block the request holds
    needs_sample: bool  # the chunk reaches the last known token: sample the next one
    num_draft_tokens: int = 0  # the last this many of token_ids are drafts to verify
    # blocks cover this many positions past the last of token_ids (for the proposer's KV)
    num_lookahead_tokens: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # single-token decodes first, then longer chunks
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished since the previous step

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class SpecTokens:
    """A speculating request's step: what it emits and the drafts for its next step."""

    tokens: tuple[SampledToken, ...]  # the accepted drafts, then the target's own token
    num_draft_tokens: int  # drafts verified this step
    num_accepted: int  # drafts accepted (= len(tokens) - 1)
    next_draft_ids: tuple[int, ...]  # proposed for the step after this one


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config, self.kv = config, kv
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # finished, blocks kept until release_held()
        self._finished_ids: list[str] = []

    # ----- admission -----
    def add_request(self, request: Request) -> None:
        self._check_admissible(request)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue behind every request of its priority or a more urgent one (all
        equal: at the end, FCFS)."""
        priority = request.sampling_params.priority
        if not self.waiting or self.waiting[-1].sampling_params.priority <= priority:
            self.waiting.append(request)
            return
        index = next(i for i, r in enumerate(self.waiting) if r.sampling_params.priority > priority)
        self.waiting.insert(index, request)

    def _requeue_first(self, request: Request) -> None:
        """Back into the waiting queue (preempted) ahead of the others of its priority."""
        priority = request.sampling_params.priority
        index = next(
            (i for i, r in enumerate(self.waiting) if r.sampling_params.priority >= priority),
            len(self.waiting),
        )
        self.waiting.insert(index, request)

    def reserve(self, request: Request) -> list[int] | None:
        """Reserve blocks for a prompt whose KV is computed elsewhere; None if the pool is short."""
        self._check_admissible(request)
        blocks = self.kv.reserve(request.request_id, request.num_prompt_tokens)
        if blocks is None:
            return None
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self.waiting_for_kv[request.request_id] = request
        return list(blocks)

    def kv_arrived(self, request_id: str, first_token_id: int | None = None) -> StepOutput | None:
        """The prompt's KV is in the reserved blocks: the request joins the queue to decode.

        Without `first_token_id` the last prompt token is computed again to sample the first output
        token. A first token that already ends the request (EOS, stop token, max_tokens) finishes it
        here, and the returned output says why; otherwise None.
        """
        request = self.waiting_for_kv.pop(request_id)
        request.num_computed_tokens = request.num_prompt_tokens - (first_token_id is None)
        self.kv.cache_blocks(
            request_id,
            request.all_token_ids,
            request.num_computed_tokens,
            request.sampling_params.cache_salt,
        )
        if first_token_id is not None:
            request.append_output(first_token_id)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish(request_id, status)
                return StepOutput(
                    request_id,
                    [],
                    [],
                    [],
                    status.value,
                    request.stop_reason,
                    request.num_prompt_tokens,
                    request.num_cached_tokens,
                )
        request.status = RequestStatus.WAITING
        request.kv_loaded = True
        self._enqueue(request)
        return None

    def _check_admissible(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_prompt(request.prompt_token_ids, max_model_len=self.config.max_model_len)

    # ----- the step -----
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, num_new, budget)
            end = request.num_computed_tokens + num_new + len(drafts)
            lookahead = self._lookahead(request, end - len(drafts), end)
            blocks = self.kv.allocate(request.request_id, end + lookahead)
            while blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                blocks = self.kv.allocate(request.request_id, end + lookahead)
            if blocks is None:
                break
            scheduled.append(self._scheduled(request, num_new, blocks, drafts, lookahead))
            budget -= num_new + len(drafts)
            index += 1
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        scheduled.sort(key=lambda s: len(s.token_ids) != 1)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, preempted, finished)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit waiting requests in queue order (priority, then arrival) while budget, seats and
        blocks allow.

        Admission stops at the first kv-loaded request over the `max_kv_loads_per_step` cap (it
        and everything behind it keep their places for the next step); requests prefilled here
        and preempted ones (recomputed) are not counted.
        """
        cap, num_loads = self.config.max_kv_loads_per_step, 0
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.kv_loaded and cap and num_loads >= cap:
                break
            prefix: list[int] = []
            computed = request.num_computed_tokens
            if computed == 0:
                prefix = self.kv.find_cached_prefix(
                    request.request_id, request.all_token_ids, request.sampling_params.cache_salt
                )
                computed = len(prefix) * self.kv.block_size
            num_new = min(request.num_tokens - computed, budget)
            lookahead = self._lookahead(request, computed + num_new, computed + num_new)
            blocks = self.kv.allocate(request.request_id, computed + num_new + lookahead, prefix)
            if blocks is None:
                break
            self.waiting.popleft()
            if request.num_preemptions == 0 and request.num_output_tokens == 0:
                request.num_cached_tokens = computed
            request.num_computed_tokens = computed
            num_loads += request.kv_loaded
            request.kv_loaded = False
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new, blocks, [], lookahead))
            budget -= num_new
        return budget

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The drafts to verify with a decode of `num_new` tokens: none unless it is a one-token
        decode; at most what the budget, max_tokens and the context leave room for (a step emits
        up to len(drafts) + 1 tokens, at positions below max_model_len)."""
        if not request.spec_token_ids or num_new != 1 or request.num_computed_tokens == 0:
            return []
        room = min(
            budget - 1,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        return request.spec_token_ids[: max(room, 0)]

    def _lookahead(self, request: Request, known_end: int, end: int) -> int:
        """Positions past `end` (this step's last scheduled position + 1) the proposer may write:
        `num_lookahead_tokens` when the chunk samples (it reaches `known_end` = num_tokens),
        capped by the context; 0 with speculation off or for a chunk that does not sample."""
        if not self.config.num_spec_tokens or known_end != request.num_tokens:
            return 0
        return max(0, min(self.config.num_lookahead_tokens, self.config.max_model_len - end))

    def _scheduled(
        self,
        request: Request,
        num_new: int,
        blocks: list[int],
        drafts: list[int],
        lookahead: int,
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request.request_id,
            request.all_token_ids[start : start + num_new] + drafts,
            start,
            blocks,
            start + num_new == request.num_tokens,
            len(drafts),
            lookahead,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.spec_token_ids = []  # the runner proposes again when the recomputation samples
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._requeue_first(request)

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, SampledToken | SpecTokens]
    ) -> list[StepOutput]:
        """Advance computed counts, append sampled tokens, finish requests that stop."""
        results: list[StepOutput] = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            token = sampled.get(item.request_id)
            if isinstance(token, SpecTokens):
                results.append(self._apply_spec(request, item, token))
                continue
            request.num_computed_tokens += len(item.token_ids)
            self.kv.cache_blocks(
                request.request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                request.sampling_params.cache_salt,
            )
            if token is None:
                continue
            status = self._append(request, token)
            if status is not None:
                self.finish(request.request_id, status)
            results.append(self._step_output(request, [token]))
        return results

    def _append(self, request: Request, token: SampledToken) -> RequestStatus | None:
        """Append one output token (and its logprobs); the status it ends the request with."""
        request.append_output(token.token_id)
        if token.logprob is not None:
            request.output_logprobs.append(token.logprob)
            request.output_top_logprobs.append(list(token.top_logprobs))
        return request.check_stop(self.config.max_model_len)

    def _apply_spec(self, request: Request, item: ScheduledRequest, spec: SpecTokens) -> StepOutput:
        """A verify step's outcome: the KV of the scheduled tokens up to the last accepted draft
        is valid (the emitted target token is the next input); tokens are appended one by one and
        the first that stops the request drops the rest, as a step at a time would."""
        request.num_computed_tokens += len(item.token_ids) - item.num_draft_tokens
        request.num_computed_tokens += spec.num_accepted
        emitted: list[SampledToken] = []
        status = None
        for token in spec.tokens:
            emitted.append(token)
            status = self._append(request, token)
            if status is not None:
                break
        request.spec_token_ids = list(spec.next_draft_ids) if status is None else []
        # a stop inside the step leaves fewer tokens than the computed positions
        computed = min(request.num_computed_tokens, request.num_tokens)
        self.kv.cache_blocks(
            request.request_id, request.all_token_ids, computed, request.sampling_params.cache_salt
        )
        if status is not None:
            self.finish(request.request_id, status)
        return self._step_output(request, emitted)

    def _step_output(self, request: Request, tokens: list[SampledToken]) -> StepOutput:
        status = request.status
        with_logprobs = tokens[0].logprob is not None
        return StepOutput(
            request.request_id,
            [t.token_id for t in tokens],
            [t.logprob for t in tokens if t.logprob is not None] if with_logprobs else [],
            [list(t.top_logprobs) for t in tokens] if with_logprobs else [],
            status.value if status.is_finished else None,
            request.stop_reason,
            request.num_prompt_tokens,
            request.num_cached_tokens,
        )

    # ----- ending requests -----
    def finish(
        self, request_id: str, status: RequestStatus, stop_reason: int | str | None = None
    ) -> bool:
        """End a request (stop, length or abort) and return its blocks; False if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request in self.running:
            self.running.remove(request)
        elif request_id in self.waiting_for_kv:
            del self.waiting_for_kv[request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.hold_blocks and status is not RequestStatus.FINISHED_ABORTED:
            self.held[request_id] = request
        else:
            self.kv.free(request_id)
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._finished_ids.append(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        if self.release_held(request_id):
            return True
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished `hold_blocks` request kept; False if none are held."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    @property
    def has_unfinished(self) -> bool:
        """Requests that steps can advance (not those still waiting for KV from elsewhere)."""
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_kv)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        held = set(self.kv.req_blocks)
        live = {r.request_id for r in self.running} | set(self.waiting_for_kv) | set(self.held)
        if not held <= live | {r.request_id for r in self.waiting}:
            raise AssertionError(
                f"blocks held by requests that are not live: {sorted(held - live)[:5]}"
            )
