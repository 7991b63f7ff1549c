"""Typed results and errors of the pdmesh client, and their conversion from/to the wire messages.

`Completion` and `Chunk` are this SDK's public results (the gateway has different internal types).
The finish-reason names and the sampling fields are read off the proto descriptors (the SDK depends
on pdmesh-proto only): `FINISH_REASON_<X>` is "<x>"; a value this build does not know (a newer
gateway's) reads as None, like FINISH_REASON_UNSPECIFIED.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.gateway.v1 import gateway_pb2

_FINISH_PREFIX = "FINISH_REASON_"
# Wire value → "stop" | "length" | "abort"; FINISH_REASON_UNSPECIFIED (0, not finished) is left out
# (None).
FINISH_REASONS: Mapping[int, str] = {
    number: name[len(_FINISH_PREFIX) :].lower()
    for name, number in common_pb2.FinishReason.items()
    if number != 0
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and the top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Completion:
    """A whole completion (`Client.generate`). finish_reason: "stop" | "length" | "abort";
    stop_reason: the stop string or stop token (as text) that ended it, or None."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_reason: str | None = None


@dataclass(frozen=True)
class Chunk:
    """A piece of a streamed completion (`Client.stream`); finish_reason, stop_reason and usage are
    set on the last one."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | None = None
    usage: Usage | None = None


# ----- errors ----------------------------------------------------------------------------------


class GenerateError(Exception):
    """A failed call; `code` is the gRPC status name (e.g. "INVALID_ARGUMENT")."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class InvalidRequest(GenerateError):
    """The request was rejected (INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION)."""


class ModelNotFound(GenerateError):
    """NOT_FOUND: no such model."""


class ServiceUnavailable(GenerateError):
    """UNAVAILABLE or RESOURCE_EXHAUSTED: no worker can take the request now (retried first)."""


class Timeout(GenerateError):
    """DEADLINE_EXCEEDED."""


class Cancelled(GenerateError):
    """CANCELLED."""


class Unauthenticated(GenerateError):
    """UNAUTHENTICATED: the gateway wants an API key (`api_key=`, or PDMESH_API_KEY) and got none,
    or a wrong one."""


_ERRORS: dict[grpc.StatusCode, type[GenerateError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServiceUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}
RETRYABLE_CODES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})


def error_from_rpc(error: grpc.RpcError) -> GenerateError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    return _ERRORS.get(code, GenerateError)(code.name, details)


def is_retryable(error: BaseException) -> bool:
    return isinstance(error, GenerateError) and error.code in RETRYABLE_CODES


API_KEY_ENV = "PDMESH_API_KEY"


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries an API key (`api_key` None: $PDMESH_API_KEY; "" or unset: none)."""
    key = (os.environ.get(API_KEY_ENV, "") if api_key is None else api_key).strip()
    return (("authorization", f"Bearer {key}"),) if key else ()


# ----- wire conversion -------------------------------------------------------------------------


def build_request(
    prompt: str | Sequence[int],
    *,
    request_id: str = "",
    model: str = "",
    max_tokens: int = 16,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    logprobs: int | None = None,
    ignore_eos: bool | None = None,
    min_tokens: int | None = None,
) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest for these settings (None: the server's default). Types are checked
    here."""
    settings = dict(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        stop=[stop] if isinstance(stop, str) else stop,
        stop_token_ids=stop_token_ids,
        logprobs=logprobs,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )
    request = gateway_pb2.GenerateRequest(
        request_id=request_id, model=model, sampling=sampling_pb(settings)
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def sampling_pb(settings: Mapping[str, Any]) -> common_pb2.SamplingParams:
    """The SamplingParams message of these settings, by proto field name; None (or absent) leaves a
    field unset, so the server's default applies. Unknown names are a ValueError."""
    fields = {f.name: f for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(f"unknown sampling settings {unknown}")
    pb = common_pb2.SamplingParams()
    for name, value in settings.items():
        if value is None:
            continue
        if fields[name].is_repeated:
            getattr(pb, name).extend(value)
        else:
            setattr(pb, name, value)
    return pb


def _logprobs(items) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
        for lp in items
    )


def _usage(msg) -> Usage | None:
    if not msg.HasField("usage"):
        return None
    return Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens)


def completion_from_proto(msg: gateway_pb2.GenerateResponse) -> Completion:
    return Completion(
        msg.request_id,
        msg.text,
        tuple(msg.token_ids),
        FINISH_REASONS.get(msg.finish_reason),
        _usage(msg),
        _logprobs(msg.logprobs),
        msg.stop_reason or None,
    )


def chunk_from_proto(msg: gateway_pb2.GenerateChunk) -> Chunk:
    return Chunk(
        msg.request_id,
        msg.text,
        tuple(msg.token_ids),
        _logprobs(msg.logprobs),
        FINISH_REASONS.get(msg.finish_reason),
        msg.stop_reason or None,
        _usage(msg),
    )
