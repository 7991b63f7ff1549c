"""Admission to prefill ranks at the gateway (pure asyncio: no grpc, redis or torch).

Contract: a disaggregated request holds one slot of one prefill rank from before its decode Reserve
to the end of its Prefill, so decode blocks are only reserved for prompts a prefill rank is about to
run (not for prompts sitting in its queue, whose reservations would outlive their lease and starve
decode). Each rank has `limit` slots. Requests wait in ONE first-come-first-served queue. A request
without a preference gets its rank when it is admitted: the one with the fewest slots in use among
those with a free slot, ties broken in turn. A request with a `choose` function (cache-aware
routing) picks its rank when it arrives (again if that rank goes away) and waits for a slot of that
rank, in FCFS order among those waiting for it; the tokens its choice says it costs count as that
rank's queued work (`queued_tokens`) until the slot is released. A waiter cancelled (client gone,
timeout) leaves the queue without having touched a worker; one cancelled just after being granted
gives its slot back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RECHECK_S = 0.25  # waiters also re-read the usable ranks this often (ranks come and go)


# a rank among the usable ones, and the prefill tokens the request costs it
Choose = Callable[[Sequence[str]], tuple[str, int]]


@dataclass(eq=False)
class _Waiter:
    ranks: Callable[[], Sequence[str]]
    future: asyncio.Future
    choose: Choose | None = None
    rank: str | None = None  # chosen (with `choose`)
    tokens: int = 0  # what the choice costs the rank


class PrefillAdmission:
    """Per-prefill-rank slots with one FCFS queue in front of them."""

    def __init__(self, limit: int, recheck_s: float = RECHECK_S) -> None:
        if limit < 1:
            raise ValueError(f"the prefill admission limit must be >= 1, got {limit}")
        self.limit, self.recheck_s = limit, recheck_s
        self._in_flight: dict[str, int] = {}
        self._queued_tokens: dict[str, int] = {}
        self._queue: deque[_Waiter] = deque()
        self._last = ""

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def in_flight(self, rank: str) -> int:
        return self._in_flight.get(rank, 0)

    def queued_tokens(self, rank: str) -> int:
        """Prefill tokens of the requests that chose `rank` and have not released their slot."""
        return self._queued_tokens.get(rank, 0)

    async def acquire(
        self, ranks: Callable[[], Sequence[str]], choose: Choose | None = None
    ) -> str | None:
        """A slot of one of `ranks()` (the usable prefill rank ids), waiting in FCFS order; None at
        once when there is no usable rank at all (the caller does without a prefill rank). With
        `choose`, the slot is of the rank it chose; release it with the tokens of its last
        choice."""
        waiter = _Waiter(ranks, asyncio.get_running_loop().create_future(), choose)
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
                # granted just before the cancel: give it back
                self.release(waiter.future.result(), waiter.tokens)
            elif waiter in self._queue:
                self._queue.remove(waiter)
                self._unchoose(waiter)
                self._grant()  # the next one may fit where this one did not
            raise

    def release(self, rank: str, tokens: int = 0) -> None:
        """Give back a slot taken by `acquire` (with the tokens its choice cost the rank); the
        waiters may take it."""
        _add(self._in_flight, rank, -1)
        _add(self._queued_tokens, rank, -tokens)
        self._grant()

    def _grant(self) -> None:
        """Admit waiters in queue order while a rank has a free slot for them: one without a
        preference takes the least busy free rank (none left free: the ones after it wait too),
        one with a choice takes a slot of its rank when there is one."""
        blocked = False  # an earlier waiter without a preference found no free rank
        for waiter in list(self._queue):
            ranks = list(waiter.ranks())
            if not ranks:
                rank: str | None = None
                self._unchoose(waiter)
            elif waiter.choose is not None:
                if waiter.rank not in ranks:
                    self._unchoose(waiter)
                    waiter.rank, waiter.tokens = waiter.choose(ranks)
                    _add(self._queued_tokens, waiter.rank, waiter.tokens)
                rank = waiter.rank
                if self.in_flight(rank) >= self.limit:
                    continue
            else:
                rank = None if blocked else self._pick(ranks)
                if rank is None:
                    blocked = True
                    continue
            if rank is not None:
                _add(self._in_flight, rank, 1)
            self._queue.remove(waiter)
            waiter.future.set_result(rank)

    def _unchoose(self, waiter: _Waiter) -> None:
        if waiter.rank is not None:
            _add(self._queued_tokens, waiter.rank, -waiter.tokens)
            waiter.rank, waiter.tokens = None, 0

    def _pick(self, ranks: list[str]) -> str | None:
        free = sorted(r for r in set(ranks) if self.in_flight(r) < self.limit)
        if not free:
            return None
        best = min(self.in_flight(r) for r in free)
        tied = [r for r in free if self.in_flight(r) == best]
        self._last = next((r for r in tied if r > self._last), tied[0])
        return self._last


def _add(counts: dict[str, int], key: str, delta: int) -> None:
    """counts[key] += delta, dropping keys that reach 0 (or less)."""
    value = counts.get(key, 0) + delta
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)
