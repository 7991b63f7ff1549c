"""What the gateway retries, and how long it waits (pure: no grpc, redis or torch; tenacity drives
it).

Two loops, both before anything reached the client:
- starting a request (`StartRetry`, around one Reserve → Prefill → Decode, or one Generate):
  - a lost hand-off (`HandoffLost`) is retried at once as a new request, `handoff_retries` times;
  - a failing rank (UNAVAILABLE, RESOURCE_EXHAUSTED) is retried on another rank with exponential
    backoff, up to `max_attempts` tries in all;
  - anything else is final: `NoInstance` (no ready rank), `Overloaded` (waited until the timeout),
    DeadlineExceeded, InvalidArgument, a cancellation.
- waiting for decode blocks (`BlocksWait`, around one pass over the decode ranks): a pass where
  every rank was short of blocks (`DecodeFull`) is repeated with exponential backoff until the
  request's deadline; then the request is `Overloaded` (503).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryCallState

from pdmesh_gateway.router import NoInstance
from pdmesh_service import errors
from pdmesh_service.instance import InstanceInfo

RETRY_BACKOFF_S, MAX_BACKOFF_S = 0.02, 0.5  # first wait before a retry, doubling up to the cap

T = TypeVar("T")


class HandoffLost(errors.Unavailable):
    """The request's KV hand-off ended before decode admitted it (Prefill ABORTED: the reservation
    ended before the KV was ready; Decode NOT_FOUND / DEADLINE_EXCEEDED before admission). Nothing
    reached the client yet: retry the request from the start."""


class RankGone(errors.Unavailable):
    """A rank left the registry (its heartbeats stopped: dead, or paused) while a call to it was
    open; the call was abandoned."""

    def __init__(self, instance_id: str, message: str) -> None:
        super().__init__(message)
        self.instance_id = instance_id


class Overloaded(errors.ResourceExhausted):
    """The request waited at the gateway (prefill slot, decode blocks) until its timeout (not
    retried)."""


class DecodeFull(errors.ResourceExhausted):
    """Every decode rank left to try was short of KV blocks in this pass (wait, then try them
    again)."""


class Exclusions:
    """Ranks that failed one request: each is skipped for it until the rank heartbeats again after
    its failure (a restarted rank, same id, is back in play; a dead or paused one stays out)."""

    def __init__(self) -> None:
        self._since: dict[str, int] = {}  # instance id -> when it failed (ms, wall clock)

    def add(self, instance_id: str, now_ms: int | None = None) -> None:
        self._since[instance_id] = int(time.time() * 1000) if now_ms is None else now_ms

    def blocks(self, info: InstanceInfo) -> bool:
        failed = self._since.get(info.instance_id)
        return failed is not None and info.updated_ms <= failed

    def blocked(self, instances: Iterable[InstanceInfo]) -> set[str]:
        """The ids among `instances` to skip now."""
        return {i.instance_id for i in instances if self.blocks(i)}

    def __len__(self) -> int:
        return len(self._since)


def is_rank_failure(error: BaseException) -> bool:
    """A rank failed in a way another rank (or the same one later) may not: worth another try."""
    return isinstance(error, (errors.Unavailable, errors.ResourceExhausted)) and not isinstance(
        error, (NoInstance, Overloaded, HandoffLost)
    )


async def retried(retrying: AsyncRetrying, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`retrying(fn, *args)`, leaving no reference cycle behind: tenacity keeps the last try's
    actions (bound methods of `retrying`) in its per-thread state, a cycle that only a full
    collection frees; two per request were most of the gateway's garbage."""
    try:
        return await retrying(fn, *args)
    finally:
        retrying.iter_state.reset()


@dataclass(frozen=True)
class RetryPolicy:
    """How often a request's start is tried again (see the module docstring)."""

    max_attempts: int = 3  # tries in all against failing ranks
    handoff_retries: int = 1  # extra tries after lost hand-offs
    backoff_s: float = RETRY_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.handoff_retries < 0:
            raise ValueError(f"handoff_retries must be >= 0, got {self.handoff_retries}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 < backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}"
            )

    def should_retry(self, failures: Sequence[BaseException]) -> bool:
        """Whether to start again after `failures` (this request's, oldest first; the last one is
        new)."""
        last = failures[-1]
        if isinstance(last, HandoffLost):
            return sum(isinstance(e, HandoffLost) for e in failures) <= self.handoff_retries
        num_rank_failures = sum(not isinstance(e, HandoffLost) for e in failures)
        return is_rank_failure(last) and num_rank_failures < self.max_attempts

    def wait_s(self, failures: Sequence[BaseException]) -> float:
        """Seconds to wait before the next start: none after a lost hand-off (the ranks are fine),
        else `backoff_s * 2**n` for the n-th rank failure, capped."""
        if isinstance(failures[-1], HandoffLost):
            return 0.0
        num_rank_failures = sum(not isinstance(e, HandoffLost) for e in failures)
        return min(self.backoff_s * 2.0**num_rank_failures, self.max_backoff_s)


@dataclass
class StartRetry:
    """tenacity's `retry` and `wait` for one request's start, over the failures seen so far."""

    policy: RetryPolicy
    failures: list[BaseException] = field(default_factory=list)

    def retry(self, state: RetryCallState) -> bool:
        error = state.outcome.exception() if state.outcome is not None else None
        if error is None:
            return False
        self.failures.append(error)
        return self.policy.should_retry(self.failures)

    def wait(self, state: RetryCallState) -> float:
        return self.policy.wait_s(self.failures)


@dataclass(frozen=True)
class BlocksWait:
    """tenacity's `retry`, `wait` and `stop` for the passes over decode ranks short of blocks:
    exponential backoff from `backoff_s`, never past the deadline; stop once it passed.
    `remaining()` is the seconds left before the request's deadline."""

    remaining: Callable[[], float]
    backoff_s: float = RETRY_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S

    def retry(self, state: RetryCallState) -> bool:
        return state.outcome is not None and isinstance(state.outcome.exception(), DecodeFull)

    def wait(self, state: RetryCallState) -> float:
        delay = min(self.backoff_s * 2.0 ** (state.attempt_number - 1), self.max_backoff_s)
        return max(min(delay, self.remaining()), 0.0)

    def stop(self, state: RetryCallState) -> bool:
        return self.remaining() <= 0
