"""How a decode rank keeps the kvstore's hand-off records (the authority on who may write its blocks).

- `HandoffReporter`: READY (KV arrived) and CONSUMED (admitted) go to the kvstore one at a time, in
  order, best effort, each a compare-and-set from the state before it (so a report never touches a
  newer record opened under the same id).
- `HandoffEnder`: a published reservation that is cancelled is moved to CANCELLED by compare-and-set
  (`end_handoff`), and the state it was ended from decides (`core.may_be_written`) whether its blocks go
  back at once or stay quarantined until the KV lands or a cap passes. `settled(request_id)` waits for
  that decision (the Cancel RPC answers after it).
  One whose lease ran out is only moved RESERVED → EXPIRED (`expire_handoff`): if a prefill rank claimed
  it first, the record is left as it is and the reservation waits for its KV until the cap
  (`core.kv_may_still_arrive`, then `decide(request_id, wait)`). When the cap passes too, the claimed
  record is ended EXPIRED, best effort, and only then is the reservation dropped (`lapse`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pdmesh_service.errors import FailedPrecondition, NotFound
from pdmesh_service.logging import get_logger
from pdmesh_decode.core import kv_may_still_arrive, may_be_written
from pdmesh_service.handoff import HandoffState

log = get_logger(__name__)
_END_ATTEMPTS = 4                 # > the longest path in the state graph


class HandoffReporter:
    """Sends (request id, state, expected state) to the kvstore one at a time, in order; failures are logged."""

    def __init__(self, kvstore: Any) -> None:
        self.kvstore = kvstore
        self._queue: asyncio.Queue[tuple[str, HandoffState, HandoffState]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def report(self, request_id: str, state: HandoffState, expected: HandoffState) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        self._queue.put_nowait((request_id, state, expected))

    async def _run(self) -> None:
        while True:
            request_id, state, expected = await self._queue.get()
            try:
                await self.kvstore.update_handoff(request_id, state, expected=expected)
            except (FailedPrecondition, NotFound) as e:   # ended meanwhile (cancelled, expired), or lapsed
                log.info("hand-off not updated", request_id=request_id, state=state.name, reason=str(e))
            except Exception as e:  # noqa: BLE001 - bookkeeping only: never fails a request
                log.warning("hand-off update failed", request_id=request_id, state=state.name, error=str(e))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


async def end_handoff(kvstore: Any, request_id: str, state: HandoffState) -> HandoffState | None:
    """Move a live hand-off to `state` (EXPIRED/CANCELLED) by compare-and-set, first from RESERVED.

    Returns the state it was ended from; for a record already final, that final state; None when
    unknown (kvstore unreachable, record gone, or it kept changing): callers must assume the worst."""
    expected = HandoffState.RESERVED
    for _ in range(_END_ATTEMPTS):
        try:
            await kvstore.update_handoff(request_id, state, expected=expected)
            return expected
        except FailedPrecondition:
            pass                                   # not in `expected` any more: read where it is
        except Exception as e:  # noqa: BLE001 - NotFound, Unavailable, ...: unknown, the safe answer
            log.warning("cannot end the hand-off", request_id=request_id, state=state.name, error=str(e))
            return None
        try:
            current = (await kvstore.get_handoff(request_id)).state
        except Exception as e:  # noqa: BLE001 - as above
            log.warning("cannot read the hand-off", request_id=request_id, error=str(e))
            return None
        if current.terminal:
            return current
        expected = current
    return None


async def expire_handoff(kvstore: Any, request_id: str) -> HandoffState | None:
    """Move a hand-off RESERVED → EXPIRED by compare-and-set, and only from there (a prefill rank that claimed
    it keeps it). Returns RESERVED when this ended it, else the state found; None when unknown."""
    try:
        await kvstore.update_handoff(request_id, HandoffState.EXPIRED, expected=HandoffState.RESERVED)
        return HandoffState.RESERVED
    except FailedPrecondition:
        pass
    except Exception as e:  # noqa: BLE001 - NotFound, Unavailable, ...: unknown
        log.warning("cannot expire the hand-off", request_id=request_id, error=str(e))
        return None
    try:
        return (await kvstore.get_handoff(request_id)).state
    except Exception as e:  # noqa: BLE001 - as above
        log.warning("cannot read the hand-off", request_id=request_id, error=str(e))
        return None


class HandoffEnder:
    """Ends hand-offs in the kvstore, then `settle(request_id, free)`s a cancelled reservation's blocks or
    `decide(request_id, wait)`s on a reservation whose lease ran out."""

    def __init__(self, kvstore: Any, settle: Callable[[str, bool], Awaitable[None]],
                 decide: Callable[[str, bool], Awaitable[None]]) -> None:
        self.kvstore, self.settle, self.decide = kvstore, settle, decide
        self._pending: dict[str, asyncio.Task] = {}
        self._others: set[asyncio.Task] = set()

    def start(self, request_id: str, state: HandoffState) -> None:
        """End a cancelled reservation's hand-off, then settle its blocks (`settled` waits for it)."""
        task = asyncio.ensure_future(self._end(request_id, state))
        self._pending[request_id] = task
        task.add_done_callback(lambda t: self._pending.pop(request_id, None) if self._pending.get(request_id) is t
                               else None)

    def expire(self, request_id: str) -> None:
        """The lease ran out before the KV: RESERVED → EXPIRED, then decide whether the KV may still come."""
        self._spawn(self._expire(request_id))

    def lapse(self, request_id: str) -> None:
        """The cap passed with no KV: end the claimed record, then drop the reservation (`decide(.., False)`)."""
        self._spawn(self._lapse(request_id))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._others.add(task)
        task.add_done_callback(self._others.discard)

    async def _end(self, request_id: str, state: HandoffState) -> None:
        ended_from = await end_handoff(self.kvstore, request_id, state)
        try:
            await self.settle(request_id, not may_be_written(ended_from))
        except Exception as e:  # noqa: BLE001 - the engine stopped: its blocks are gone with it
            log.warning("cannot settle an ended reservation", request_id=request_id, error=str(e))

    async def _expire(self, request_id: str) -> None:
        await self._decide(request_id, kv_may_still_arrive(await expire_handoff(self.kvstore, request_id)))

    async def _decide(self, request_id: str, wait: bool) -> None:
        try:
            await self.decide(request_id, wait)
        except Exception as e:  # noqa: BLE001 - the engine stopped: its blocks are gone with it
            log.warning("cannot decide on a lapsed reservation", request_id=request_id, error=str(e))

    async def _lapse(self, request_id: str) -> None:
        # Only from the claimed states: a RESERVED record would be a retry's (the gateway retries once the
        # reservation is dropped, which is why it is dropped only after this).
        for claimed in (HandoffState.TRANSFERRING, HandoffState.READY):
            try:
                await self.kvstore.update_handoff(request_id, HandoffState.EXPIRED, expected=claimed)
                break
            except FailedPrecondition:
                continue
            except Exception as e:  # noqa: BLE001 - bookkeeping only: the record lapses by itself
                log.warning("cannot expire the hand-off", request_id=request_id, error=str(e))
                break
        await self._decide(request_id, False)

    async def settled(self, request_id: str) -> None:
        """Wait until an end of `request_id` in progress is decided (at once if there is none)."""
        task = self._pending.get(request_id)
        if task is not None:
            await asyncio.shield(task)

    async def close(self) -> None:
        tasks = [*self._pending.values(), *self._others]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
