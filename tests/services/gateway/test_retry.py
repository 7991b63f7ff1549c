"""The gateway's retry decisions (pure): what is tried again, how long it waits, and tenacity
driving them."""

from __future__ import annotations

import asyncio

import pytest
from tenacity import AsyncRetrying

from pdmesh_gateway.retry import (
    BlocksWait,
    DecodeFull,
    HandoffLost,
    Overloaded,
    RetryPolicy,
    StartRetry,
    is_rank_failure,
)
from pdmesh_gateway.router import NoInstance
from pdmesh_service import errors


def test_rank_failures_are_retried_up_to_max_attempts_with_doubling_backoff() -> None:
    policy = RetryPolicy(max_attempts=3, handoff_retries=1, backoff_s=0.02, max_backoff_s=0.05)
    down = errors.Unavailable("decode d0: down")
    assert policy.should_retry([down]) and policy.wait_s([down]) == pytest.approx(0.04)
    assert policy.should_retry([down, errors.ResourceExhausted("full")])
    assert policy.wait_s([down, down]) == pytest.approx(0.05)  # 0.08, capped
    assert not policy.should_retry([down, down, down])  # three tries in all


@pytest.mark.parametrize(
    "error",
    [
        NoInstance("none"),
        Overloaded("waited"),
        errors.DeadlineExceeded("late"),
        errors.InvalidArgument("bad"),
        asyncio.CancelledError(),
        RuntimeError("bug"),
    ],
)
def test_final_errors_are_never_retried(error: BaseException) -> None:
    assert not is_rank_failure(error)
    assert not RetryPolicy(max_attempts=10, handoff_retries=10).should_retry([error])


def test_lost_handoffs_are_retried_at_once_on_their_own_budget() -> None:
    policy = RetryPolicy(max_attempts=2, handoff_retries=2)
    lost, down = HandoffLost("prefill p0: aborted"), errors.Unavailable("down")
    assert policy.should_retry([lost]) and policy.wait_s([lost]) == 0.0
    assert policy.should_retry([lost, lost]) and not policy.should_retry([lost, lost, lost])
    assert policy.should_retry([lost, lost, down])  # a rank failure has its own count
    # the second rank failure ends it (max_attempts=2)
    assert not policy.should_retry([down, lost, lost, down])
    # and a lost hand-off after them still has its budget
    assert policy.should_retry([down, down, lost])


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="handoff_retries"):
        RetryPolicy(handoff_retries=-1)


def test_tenacity_runs_the_start_decisions() -> None:
    """A lost hand-off, then a failing rank, then success: three tries; the failures are recorded in
    order."""
    outcomes: list[BaseException | None] = [HandoffLost("lost"), errors.Unavailable("down"), None]
    calls: list[int] = []

    async def start() -> str:
        calls.append(len(calls))
        outcome = outcomes[len(calls) - 1]
        if outcome is not None:
            raise outcome
        return "stream"

    async def main() -> tuple[str, StartRetry]:
        decisions = StartRetry(RetryPolicy(backoff_s=0.001, max_backoff_s=0.001))
        return await AsyncRetrying(retry=decisions.retry, wait=decisions.wait)(start), decisions

    result, decisions = asyncio.run(main())
    assert result == "stream" and calls == [0, 1, 2]
    assert [type(e) for e in decisions.failures] == [HandoffLost, errors.Unavailable]


def test_tenacity_raises_the_final_error_itself() -> None:
    async def start() -> str:
        raise NoInstance("no ready decode instance")

    async def main() -> None:
        decisions = StartRetry(RetryPolicy())
        await AsyncRetrying(retry=decisions.retry, wait=decisions.wait)(start)

    with pytest.raises(NoInstance):
        asyncio.run(main())


def test_blocks_wait_backs_off_within_the_deadline_and_stops_after_it() -> None:
    """Passes that find every rank full are repeated until the deadline; then the callback's
    Overloaded."""

    async def main() -> tuple[list[float], int]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.2
        wait = BlocksWait(
            remaining=lambda: deadline - loop.time(), backoff_s=0.01, max_backoff_s=0.04
        )
        slept: list[float] = []
        passes: list[None] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)
            await asyncio.sleep(seconds)

        async def full_pass() -> str:
            passes.append(None)
            raise DecodeFull("all full")

        def overloaded(state: object) -> None:
            raise Overloaded("timeout")

        with pytest.raises(Overloaded):
            await AsyncRetrying(
                retry=wait.retry,
                wait=wait.wait,
                stop=wait.stop,
                sleep=sleep,
                retry_error_callback=overloaded,
            )(full_pass)
        assert loop.time() >= deadline
        return slept, len(passes)

    slept, num_passes = asyncio.run(main())
    assert slept[:3] == pytest.approx([0.01, 0.02, 0.04]) and max(slept) <= 0.04 + 1e-9
    assert num_passes == len(slept) + 1  # a pass after every wait, the last one past the deadline


def test_blocks_wait_does_not_retry_other_errors() -> None:
    async def main() -> None:
        wait = BlocksWait(remaining=lambda: 10.0)

        async def down() -> None:
            raise NoInstance("none left")

        await AsyncRetrying(retry=wait.retry, wait=wait.wait, stop=wait.stop)(down)

    with pytest.raises(NoInstance):
        asyncio.run(main())
