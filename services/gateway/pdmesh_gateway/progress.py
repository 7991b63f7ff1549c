"""One request's progress: worker chunks in, client events out (pure: no grpc, redis or torch).

`RequestProgress.event(chunk)` applies stop strings (`TextStream`) and detokenizes, counts tokens
and keeps the timings the metrics need. Contract: once an event carried a finish_reason, `finished`
is set and later chunks are not expected (the orchestrator stops reading). `output_ids` are the
tokens taken so far (a migrated request continues after them); the chunks of a continuation are fed
to the same progress, so usage counts the original prompt and every token once.
"""

from __future__ import annotations

import time

from pdmesh_engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdmesh_gateway.core import (
    GenerationEvent,
    GenerationRequest,
    TextStream,
    TokenLogprob,
    Usage,
    WorkerChunk,
)


class RequestProgress:
    """Detokenized text with stop strings, token counts and timings (time.monotonic) of one
    request."""

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer) -> None:
        params = request.params
        detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_ids, params.skip_special_tokens
        )
        self.request = request
        self.text = TextStream(detokenizer, params.stop, params.include_stop_str_in_output)
        self.output_ids: list[int] = []
        self.num_cached_tokens = 0
        self.prefill_path = ""  # where the first start computed the prompt (`start.Path`)
        self.num_migrations = 0
        self.started_at, self.first_token_at, self.ended_at = time.monotonic(), 0.0, 0.0
        # when the request left the gateway's queue for its first start (0.0: not known); the
        # metrics split its time there from the prefill phase with it
        self.admitted_at = 0.0
        self.finished = False
        self.finish_reason = ""  # the last event's, once `finished`

    def migrated(self) -> None:
        """The request goes on on another decode rank (chunks of its continuation follow)."""
        self.num_migrations += 1

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)

    def event(self, chunk: WorkerChunk) -> GenerationEvent | None:
        """The event for one chunk (None if it carries nothing to tell)."""
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        text = ""
        wants_logprobs = self.request.params.logprobs is not None
        for k, token_id in enumerate(chunk.token_ids):
            if self.text.stop_hit:
                break
            token_ids.append(token_id)
            if wants_logprobs and k < len(chunk.logprobs):
                logprobs.append(chunk.logprobs[k])
            text += self.text.push([token_id])
        self.output_ids += token_ids
        num_prompt_tokens = len(self.request.prompt_ids)
        if not self.num_migrations:  # a continuation's cache hits are its own re-prefill's
            self.num_cached_tokens = min(
                max(self.num_cached_tokens, chunk.num_cached_tokens), num_prompt_tokens
            )
        if token_ids and not self.first_token_at:
            self.first_token_at = time.monotonic()
        if self.text.stop_hit is None and chunk.finish_reason is None:
            if not (token_ids or text):
                return None
            return GenerationEvent(tuple(token_ids), text, tuple(logprobs))
        text += self.text.finish()
        finish: str | None
        stop_reason: str | int | None
        if self.text.stop_hit is not None:
            finish, stop_reason = "stop", self.text.stop_hit
        else:
            finish = chunk.finish_reason
            stop_reason = (chunk.stop_token_id or None) if finish == "stop" else None
        usage = Usage(num_prompt_tokens, self.num_tokens, self.num_cached_tokens, self.prefill_path)
        self.finished, self.ended_at, self.finish_reason = True, time.monotonic(), finish or ""
        return GenerationEvent(tuple(token_ids), text, tuple(logprobs), finish, stop_reason, usage)
