"""Admission to prefill ranks at the gateway (pure asyncio: no grpc, redis or torch).

Contract: a disaggregated request holds one slot of one prefill rank from before its decode Reserve
to the end of its Prefill, so decode blocks are only reserved for prompts a prefill rank is about to
run (not for prompts sitting in its queue, whose reservations would outlive their lease and starve
decode). Each rank has `limit` slots. Requests wait in ONE first-come-first-served queue; the rank
is picked when the request is admitted: the one with the fewest slots in use among those with a free
slot, ties broken in turn. A waiter cancelled (client gone, timeout) leaves the queue without having
touched a worker; one cancelled just after being granted gives its slot back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RECHECK_S = 0.25  # waiters also re-read the usable ranks this often (ranks come and go)


@dataclass(eq=False)
class _Waiter:
    ranks: Callable[[], Sequence[str]]
    future: asyncio.Future


class PrefillAdmission:
    """Per-prefill-rank slots with one FCFS queue in front of them."""

    def __init__(self, limit: int, recheck_s: float = RECHECK_S) -> None:
        if limit < 1:
            raise ValueError(f"the prefill admission limit must be >= 1, got {limit}")
        self.limit, self.recheck_s = limit, recheck_s
        self._in_flight: dict[str, int] = {}
        self._queue: deque[_Waiter] = deque()
        self._last = ""

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def in_flight(self, rank: str) -> int:
        return self._in_flight.get(rank, 0)

    async def acquire(self, ranks: Callable[[], Sequence[str]]) -> str | None:
        """A slot of one of `ranks()` (the usable prefill rank ids), waiting in FCFS order; None at
        once when there is no usable rank at all (the caller does without a prefill rank)."""
        waiter = _Waiter(ranks, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._grant()
        try:
            while not waiter.future.done():
                await asyncio.wait([waiter.future], timeout=self.recheck_s)
                self._grant()
            return waiter.future.result()
        except asyncio.CancelledError:
            if (
                waiter.future.done()
                and not waiter.future.cancelled()
                and waiter.future.result() is not None
            ):
                self.release(waiter.future.result())  # granted just before the cancel: give it back
            elif waiter in self._queue:
                self._queue.remove(waiter)
                self._grant()  # the next one may fit where this one did not
            raise

    def release(self, rank: str) -> None:
        """Give back a slot taken by `acquire`; the head of the queue may take it."""
        left = self._in_flight.get(rank, 0) - 1
        if left > 0:
            self._in_flight[rank] = left
        else:
            self._in_flight.pop(rank, None)
        self._grant()

    def _grant(self) -> None:
        """Admit waiters from the head of the queue while a rank has a free slot for them."""
        while self._queue:
            waiter = self._queue[0]
            ranks = list(waiter.ranks())
            if ranks:
                rank = self._pick(ranks)
                if rank is None:
                    return
                self._in_flight[rank] = self._in_flight.get(rank, 0) + 1
            else:
                rank = None
            self._queue.popleft()
            waiter.future.set_result(rank)

    def _pick(self, ranks: list[str]) -> str | None:
        free = sorted(r for r in set(ranks) if self.in_flight(r) < self.limit)
        if not free:
            return None
        best = min(self.in_flight(r) for r in free)
        tied = [r for r in free if self.in_flight(r) == best]
        self._last = next((r for r in tied if r > self._last), tied[0])
        return self._last
