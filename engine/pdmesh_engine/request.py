"""A request's state inside one engine: its tokens, how many are computed, and where it stands.

`num_computed_tokens` catches up with `num_tokens` (prompt + output); prefill and decode are the
same loop. A request whose prompt KV is computed elsewhere waits in WAITING_FOR_KV with its blocks
reserved until the KV has arrived.

Pure data: no tensors, no devices. A seeded request's random generator lives with the model runner,
keyed by request id (see `ModelRunner`). A structured-output request carries its grammar state
(`pdmesh_engine.grammar.GrammarState`), which every appended output token advances.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdmesh_engine.sampling import SamplingParams, check_prompt

if TYPE_CHECKING:
    from pdmesh_engine.grammar import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    hold_blocks: bool = False  # keep the KV blocks after finishing until released (prefill push)
    # its KV arrived from elsewhere and it waits for its first admission (the per-step load cap)
    kv_loaded: bool = False
    # speculative decoding: drafts for the tokens after the last one, verified in the next step
    # (proposed by the model runner at the end of this request's last step; dropped on preemption)
    spec_token_ids: list[int] = field(default_factory=list)
    # structured outputs: where the output stands in the request's grammar (None: unconstrained)
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        check_prompt(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop after the last appended token (stop strings are checked on text
        elsewhere)."""
        params, last = self.sampling_params, self.output_token_ids[-1]
        if self.grammar is not None and self.grammar.failed:  # a token the grammar forbids
            self.stop_reason = f"grammar: {self.grammar.error}"
            return RequestStatus.FINISHED_ABORTED
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def banned_token_ids(self, num_ahead: int = 0) -> list[int]:
        """Tokens that must not be sampled yet (EOS and stop ids before min_tokens); `num_ahead`:
        for the output token that many places after the next one (speculative decoding)."""
        params = self.sampling_params
        if self.num_output_tokens + num_ahead >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else list(self.eos_token_ids)
        return eos + list(params.stop_token_ids)
