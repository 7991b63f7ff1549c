"""Continuing a request on another decode rank when its rank fails mid-stream (pure: no grpc, redis
or torch).

A decode rank that dies (its stream breaks, it answers UNAVAILABLE, it aborts the request, or it
leaves the registry while the stream is silent) loses the request's KV, not the request: the tokens
already generated are known at the gateway. The continuation is a new request whose prompt is the
original prompt followed by those tokens, with what is left of the token budget; it is started like
any request (Reserve → Prefill → Decode, or Generate), so the prefill rank's prefix cache makes the
re-prefill cheap. The sampler state follows the request: `prior_output_tokens` tells the engine how
many draws a seeded generator has already made, so seeded sampling continues exactly where it was;
greedy decoding continues with the same tokens.

The client sees one stream: the continuation's tokens follow the ones already sent (the same
`RequestProgress` keeps the text, the stop strings and the counts); usage counts the original
prompt and every generated token once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pdmesh_gateway.core import GenerationRequest
from pdmesh_service import errors

DEFAULT_MAX_MIGRATIONS = 3


class MigrationsExhausted(errors.Unavailable):
    """The request's decode rank failed more often than --max-migrations allows."""


# what a failed request itself caused: continuing it elsewhere would fail the same way
_FINAL = (errors.InvalidArgument, errors.FailedPrecondition, errors.DeadlineExceeded)


def is_rank_loss(error: BaseException) -> bool:
    """Whether a decode stream that raised `error` lost its rank (worth continuing elsewhere) rather
    than failed the request itself (bad input, the request's own deadline)."""
    return isinstance(error, errors.MeshError) and not isinstance(
        error, (*_FINAL, MigrationsExhausted)
    )


def continuation(
    request: GenerationRequest, output_ids: Sequence[int], number: int = 1
) -> GenerationRequest | None:
    """The `number`-th continuation of `request` after `output_ids` were generated for it (all of
    them, including any the client has not been shown yet; its id `<id>~m<number>`); None when its
    token budget is spent."""
    done = len(output_ids)
    params = request.params
    if done >= params.max_tokens:
        return None
    resumed = replace(
        params,
        max_tokens=params.max_tokens - done,
        min_tokens=max(0, params.min_tokens - done),
        prior_output_tokens=params.prior_output_tokens + done,
    )
    return replace(
        request,
        request_id=f"{request.request_id}~m{number}",
        prompt_ids=(*request.prompt_ids, *output_ids),
        params=resumed,
    )


def tried(request: GenerationRequest, number: int) -> GenerationRequest:
    """The request as its `number`-th try is sent to workers (0: the first): every later try, and
    every continuation, has an id of its own (`<id>~<n>`), so no hand-off record or worker state
    that a failed try left behind (a dead rank's live reservation) is in its way."""
    if number == 0:
        return request
    return replace(request, request_id=f"{request.request_id}~{number}")
