"""The gateway's engine-neutral core: requests, validation, events, and stop strings (pure).

Both transports (OpenAI REST in `openai_api`/`rest`, gRPC in `servicer`) turn their input into a
`GenerationRequest` with `build_request`, and read `GenerationEvent`s from the orchestrator.
Chain: GenerateRequest(pb) / JSON body → GenerationRequest → (workers) TokenChunk(pb) → WorkerChunk
→ GenerationEvent → GenerationResult (folded, non-streaming) → GenerateResponse(pb) / JSON.
These are the gateway's internal types; the SDK (`pdmesh_client`) has its own public `Chunk` and
`Completion`, built from the gateway's pb answers.
Every rejection is an `InvalidArgument` (400) whose `param` names the offending field, or a
`NotFound` (404) for an unknown model. No grpc, redis or torch here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pdmesh_engine.sampling import PromptError, SamplingParams, check_prompt, find_stop_string
from pdmesh_engine.tokenizer import IncrementalDetokenizer
from pdmesh_gateway.tenants import Tenancy
from pdmesh_service.errors import InvalidArgument, NotFound

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
# the engine's names
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))


def invalid(param: str | None, message: str) -> InvalidArgument:
    """An InvalidArgument that names the request field it is about (`param`, OpenAI's error
    field)."""
    return InvalidArgument(message, param=param)


def model_not_found(name: str) -> NotFound:
    return NotFound(f"The model `{name}` does not exist.", param="model", code="model_not_found")


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ModelInfo:
    """The served model: its public name, its directory name (`root`) and its limits."""

    name: str
    root: str
    max_model_len: int
    vocab_size: int
    created: int = 0

    def resolve(self, requested: Any) -> str:
        """The model a request names: None/"" means the served one; an unknown name is a 404."""
        if requested is None or requested == "":
            return self.name
        if not isinstance(requested, str):
            raise invalid("model", f"model must be a string, got {type(requested).__name__}")
        if requested not in (self.name, self.root):
            raise model_not_found(requested)
        return self.name


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request: its mesh-wide id, prompt ids and sampling settings."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    model: str
    # the DP rank of the ranks its prompt goes to (a prefill rank; a decode rank when decode
    # computes it), from the X-Data-Parallel-Rank header; None: any
    dp_rank: int | None = None
    # its tenant and class (`tenants`), for the gateway's fair queue; None: the open tenant, the
    # class of params.priority
    tenancy: Tenancy | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's logprob and the top alternatives (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prefill_path: str = ""  # disagg, local or agg (`start.Path`); "": not known

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class WorkerChunk:
    """What a worker sent for a request (a decode `TokenChunk`, or the prefill's first token),
    before the gateway applies stop strings and detokenizes. finish_reason: "stop" | "length" |
    "abort" | None."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_token_id: int = 0  # the stop token that ended the request (finish "stop"), else 0
    num_prompt_tokens: int = 0  # 0: not told (only the last chunk tells)
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class GenerationEvent:
    """What the client is shown next: tokens and text produced since the previous event (stop
    strings applied); the last one has finish_reason and usage.

    finish_reason: "stop" | "length" | "abort"; stop_reason: the stop string or stop token id.
    """

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None


@dataclass
class GenerationResult:
    """All events of a request folded together (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None

    def add(self, event: GenerationEvent) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.usage = (
                event.finish_reason,
                event.stop_reason,
                event.usage,
            )


def fold(events: Iterable[GenerationEvent]) -> GenerationResult:
    result = GenerationResult()
    for event in events:
        result.add(event)
    return result


# ----- validation ------------------------------------------------------------------------------


def check_prompt_ids(ids: Any, model: ModelInfo, param: str = "prompt") -> tuple[int, ...]:
    """Token ids as a tuple: a non-empty list of ints in [0, vocab_size) (the engine's
    `check_prompt`)."""
    if not isinstance(ids, (list, tuple)):
        raise invalid(
            param, f"{param} token ids must be a list of integers, got {type(ids).__name__}"
        )
    try:
        check_prompt(ids, vocab_size=model.vocab_size)
    except PromptError as e:
        raise invalid(param, str(e)) from e
    return tuple(ids)


def check_context(
    num_prompt: int,
    max_tokens: int,
    model: ModelInfo,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> None:
    """The prompt plus max_tokens must fit the context (as vLLM: over the context is a 400)."""
    if num_prompt >= model.max_model_len:
        raise invalid(
            prompt_param,
            f"This model's maximum context length is {model.max_model_len} tokens. "
            f"However, your prompt has {num_prompt} tokens (at least one token must "
            f"be left for the completion).",
        )
    if num_prompt + max_tokens > model.max_model_len:
        raise invalid(
            max_tokens_param,
            f"This model's maximum context length is {model.max_model_len} tokens. "
            f"However, you requested {num_prompt + max_tokens} tokens ({num_prompt} in "
            f"the prompt, {max_tokens} for the completion). Please reduce the prompt "
            f"or {max_tokens_param}.",
        )


def _check_stop(stop: Any, param: str) -> None:
    items = [stop] if isinstance(stop, str) else stop
    if isinstance(items, (list, tuple)):
        if len(items) > MAX_STOP_STRINGS:
            raise invalid(
                param, f"{param} takes at most {MAX_STOP_STRINGS} strings, got {len(items)}"
            )
        if any(isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS for s in items):
            raise invalid(
                param, f"{param} strings must be at most {MAX_STOP_STRING_CHARS} characters"
            )


def sampling_params(
    values: Mapping[str, Any], names: Mapping[str, str] | None = None
) -> SamplingParams:
    """SamplingParams from engine-named fields (None = default); `names` maps them to the API's
    names."""
    names = names or {}
    if values.get("stop") is not None:
        _check_stop(values["stop"], names.get("stop", "stop"))
    try:
        return SamplingParams.from_dict({k: v for k, v in values.items() if v is not None})
    except ValueError as e:
        message = str(e)
        field_name = max(
            (f for f in SAMPLING_FIELDS if message.startswith(f + " ")), key=len, default=None
        )
        if field_name is None:
            raise invalid(None, message) from None
        param = names.get(field_name, field_name)  # the API's name for the field the message names
        raise invalid(param, param + message[len(field_name) :]) from None


def build_request(
    request_id: str,
    prompt_ids: Sequence[int],
    values: Mapping[str, Any],
    model: ModelInfo,
    model_name: str,
    *,
    default_max_tokens: int | None = 16,
    names: Mapping[str, str] | None = None,
    prompt_param: str = "prompt",
) -> GenerationRequest:
    """Validate sampling values against the prompt and the model; None max_tokens default = rest of
    context."""
    names = names or {}
    ids = check_prompt_ids(list(prompt_ids), model, prompt_param)
    values = dict(values)
    if values.get("max_tokens") is None:
        # <= 0 left: check_context rejects the prompt
        remaining = max(model.max_model_len - len(ids), 1)
        values["max_tokens"] = (
            remaining if default_max_tokens is None else min(default_max_tokens, remaining)
        )
    params = sampling_params(values, names)
    check_context(
        len(ids), params.max_tokens, model, prompt_param, names.get("max_tokens", "max_tokens")
    )
    try:
        params.validate_for_vocab(model.vocab_size)
    except ValueError as e:
        raise invalid(names.get("stop_token_ids", "stop_token_ids"), str(e)) from None
    return GenerationRequest(request_id, ids, params, model_name)


# ----- stop strings ----------------------------------------------------------------------------


class TextStream:
    """Text of a generated token stream with stop strings applied at the gateway.

    Contract: `push(ids)` returns the text that may be shown now. While the stream runs, the last
    `max(len(stop)) - 1` characters are held back (they may begin a stop string), as vLLM does.
    On a match the text is cut before the stop string (or after it, with include_stop_str) and
    `stop_hit` is set; nothing more is emitted afterwards. `finish()` flushes the held-back text.
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._detok = detokenizer
        self._stop = tuple(stop)
        self._include = include_stop
        self._holdback = max((len(s) for s in self._stop), default=1) - 1 if not include_stop else 0
        self._text = ""
        self._emitted = 0
        self.stop_hit: str | None = None

    @property
    def text(self) -> str:
        return self._text

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stop_hit is None and token_ids:
            self._append(self._detok.push(list(token_ids)))
        end = (
            len(self._text)
            if self.stop_hit
            else max(self._emitted, len(self._text) - self._holdback)
        )
        return self._emit(end)

    def finish(self) -> str:
        """End of stream: flush the detokenizer and emit everything left."""
        if self.stop_hit is None:
            self._append(self._detok.flush())
        return self._emit(len(self._text))

    def _append(self, new: str) -> None:
        if not new:
            return
        self._text += new
        hit = find_stop_string(self._text, self._stop, len(new)) if self._stop else None
        if hit is not None:
            index, stop = hit
            self._text = self._text[: index + (len(stop) if self._include else 0)]
            self.stop_hit = stop

    def _emit(self, end: int) -> str:
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
