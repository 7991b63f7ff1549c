"""Admission to prefill ranks at the gateway, and the bounded queue in front of it (pure asyncio: no
grpc, redis or torch).

Contract: a disaggregated request holds one slot of one prefill rank from before its decode Reserve
to the end of its Prefill, so decode blocks are only reserved for prompts a prefill rank is about to
run (not for prompts sitting in its queue, whose reservations would outlive their lease and starve
decode). Each rank has `limit` slots.

Waiting is event-driven: a waiter sits in the queue of the ranks it may take — {its rank} when it
chose one (`choose`: cache-aware routing, which counts the tokens the choice costs as that rank's
`queued_tokens` until the slot is released), else the usable ranks it read at arrival. A released
slot of rank r is granted to the oldest head among the queues whose ranks hold r; an arrival is
granted at once only when its queue is empty and one of its ranks is free (then the one with the
fewest slots in use, ties in turn). So a grant costs O(number of queues) — a few: one per rank plus
one per distinct set of usable ranks — and never touches the waiters behind the heads; a waiting
request costs nothing until it is granted. The ranks change only by `refresh` (the router's
membership changed): then every waiter reads its usable ranks again, a chooser chooses again, and
waiters left without any usable rank are answered None (the caller does without a prefill rank).

Queue bound: `acquire(bounded=True)` (a new request, not a retry or a continuation) is refused with
`Shed` (HTTP 429 with Retry-After) when `max_queued` requests already wait, or, with `max_wait_s`,
when its estimated wait (its place / the rate slots were granted lately) is longer. A waiter
cancelled (client gone, timeout) leaves the queue at once, having touched no worker; one cancelled
just after being granted gives its slot back.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pdmesh_gateway.retry import Overloaded

# a rank among the usable ones, and the prefill tokens the request costs it
Choose = Callable[[Sequence[str]], tuple[str, int]]
# the default bound on queued requests: this many times the slots of the ready prefill ranks
QUEUED_PER_SLOT = 8
RATE_WINDOW = 64  # grants the queue's drain rate is measured over
MAX_RETRY_AFTER_S = 60  # what clients (the OpenAI SDKs) still honour


class Shed(Overloaded):
    """The gateway's queue is full (or its wait too long): refused at once, to be tried again after
    `retry_after_s` (HTTP 429 with Retry-After; gRPC RESOURCE_EXHAUSTED)."""

    http_status, error_type = 429, "rate_limit_exceeded"

    def __init__(self, message: str, *, reason: str, retry_after_s: float) -> None:
        super().__init__(message, code=f"queue_{reason}")
        self.reason = reason  # "full" or "wait"
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        """Whole seconds, at least 1 (Retry-After's form)."""
        return str(min(max(math.ceil(self.retry_after_s), 1), MAX_RETRY_AFTER_S))


@dataclass(frozen=True)
class QueueLimits:
    """`max_queued`: requests that may wait for a slot (None: QUEUED_PER_SLOT x the slots of the
    ready prefill ranks); `max_wait_s`: the longest estimated wait a new request may join (None: no
    such bound)."""

    max_queued: int | None = None
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_queued is not None and self.max_queued < 1:
            raise ValueError(f"--max-queued must be >= 1, got {self.max_queued}")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise ValueError(f"--max-queue-wait-s must be positive, got {self.max_wait_s}")


@dataclass(eq=False, slots=True)
class _Waiter:
    seq: int  # arrival order
    ranks: Callable[[], Sequence[str]]
    future: asyncio.Future
    choose: Choose | None = None
    key: frozenset[str] = frozenset()  # the ranks it may take: its queue
    rank: str | None = None  # chosen (with `choose`)
    tokens: int = 0  # what the choice costs the rank
    is_gone: bool = False  # granted, answered or cancelled: dropped when it reaches a head


@dataclass
class _Drain:
    """When the last RATE_WINDOW slots were granted: the queue's drain rate."""

    times: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))

    def per_s(self, now: float) -> float | None:
        """Grants per second over the window up to `now` (falls while grants stop); None before
        two grants."""
        if len(self.times) < 2 or now <= self.times[0]:
            return None
        return len(self.times) / (now - self.times[0])


class PrefillAdmission:
    """Per-prefill-rank slots with FCFS queues in front of them (module docstring)."""

    def __init__(
        self,
        limit: int,
        limits: QueueLimits = QueueLimits(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: seconds, for the drain rate (the simulator passes its virtual clock)."""
        if limit < 1:
            raise ValueError(f"the prefill admission limit must be >= 1, got {limit}")
        self.limit, self.limits, self._clock = limit, limits, clock
        self._in_flight: dict[str, int] = {}
        self._queued_tokens: dict[str, int] = {}
        self._queues: dict[frozenset[str], deque[_Waiter]] = {}
        self._waiters: dict[int, _Waiter] = {}  # the live ones, in arrival order
        self._seq = itertools.count()
        self._num_ranks = 1  # ready prefill ranks, as `refresh` last said
        self._drain = _Drain()
        self._last = ""
        self.num_shed: dict[str, int] = {"full": 0, "wait": 0}  # refusals by `Shed.reason`

    # ----- views -----
    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def max_queued(self) -> int:
        """The bound in force (`QueueLimits.max_queued`, or its default for the ranks now)."""
        if self.limits.max_queued is not None:
            return self.limits.max_queued
        return QUEUED_PER_SLOT * self.limit * max(self._num_ranks, 1)

    def in_flight(self, rank: str) -> int:
        return self._in_flight.get(rank, 0)

    def queued_tokens(self, rank: str) -> int:
        """Prefill tokens of the requests that chose `rank` and have not released their slot."""
        return self._queued_tokens.get(rank, 0)

    def estimated_wait_s(self, place: int | None = None) -> float | None:
        """Seconds until the request at `place` in the queue (default: one arriving now) gets a
        slot, at the rate slots were granted lately; None before that rate is known."""
        rate = self._drain.per_s(self._clock())
        place = self.waiting + 1 if place is None else place
        return None if rate is None else place / rate

    # ----- the queue bound -----
    def check_room(self) -> None:
        """`Shed` if a new request may not join the queue now (full, or its wait too long)."""
        if self.waiting >= self.max_queued:
            rate = self._drain.per_s(self._clock())  # a place frees every 1/rate seconds
            why = f"{self.waiting} requests are queued (--max-queued {self.max_queued})"
            self._shed("full", why, 1 / rate if rate else 1.0)
        max_wait = self.limits.max_wait_s
        wait = None if max_wait is None else self.estimated_wait_s()
        if max_wait is not None and wait is not None and wait > max_wait:
            why = f"the estimated queue wait is {wait:.1f}s (--max-queue-wait-s {max_wait:g})"
            self._shed("wait", why, wait - max_wait)  # the wait shrinks by its excess by then

    def _shed(self, reason: str, why: str, retry_after_s: float) -> None:
        self.num_shed[reason] += 1
        raise Shed(
            f"the gateway is overloaded: {why}; retry later",
            reason=reason,
            retry_after_s=retry_after_s,
        )

    # ----- acquire / release -----
    async def acquire(
        self,
        ranks: Callable[[], Sequence[str]],
        choose: Choose | None = None,
        *,
        bounded: bool = False,
    ) -> str | None:
        """A slot of one of `ranks()` (the usable prefill rank ids, read now and at each `refresh`),
        in FCFS order; None at once when there is no usable rank (the caller does without a
        prefill rank). With `choose`, the slot is of the rank it chose; release it with the tokens
        of its last choice. `bounded`: a new request, refused with `Shed` when the queue is full."""
        usable = frozenset(ranks())
        if not usable:
            return None
        if bounded:
            self.check_room()
        waiter = _Waiter(next(self._seq), ranks, asyncio.get_running_loop().create_future(), choose)
        self._place(waiter, usable)
        if not waiter.future.done():
            self._waiters[waiter.seq] = waiter
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                if waiter.future.result() is not None:  # granted just before the cancel
                    self.release(waiter.future.result(), waiter.tokens)
            else:
                self._leave(waiter)
            raise

    def release(self, rank: str, tokens: int = 0) -> None:
        """Give back a slot taken by `acquire` (with the tokens its choice cost the rank); the
        oldest waiter that may take it does."""
        _add(self._in_flight, rank, -1)
        _add(self._queued_tokens, rank, -tokens)
        self._grant(rank)

    def refresh(self, num_ranks: int | None = None) -> None:
        """The usable ranks may have changed (a rank joined or left: `num_ranks` ready now): every
        waiter reads its ranks again (a chooser chooses again), in arrival order; then the free
        slots are granted."""
        if num_ranks is not None:
            self._num_ranks = num_ranks
        waiters = [w for w in self._waiters.values() if not w.future.done()]
        self._queues.clear()
        for waiter in waiters:  # every old choice out before any new one is weighed
            self._unchoose(waiter)
        for waiter in waiters:
            usable = frozenset(waiter.ranks())
            if not usable:
                self._answer(waiter, None)
            else:
                self._enqueue(waiter, usable)
        for rank in {r for key in self._queues for r in key}:
            self._grant(rank)

    # ----- internals -----
    def _place(self, waiter: _Waiter, usable: frozenset[str]) -> None:
        """Queue a new waiter, granted at once when its queue is empty and one of its ranks is
        free (no older waiter can want that rank: every head has no free rank)."""
        self._enqueue(waiter, usable)
        if self._head(waiter.key) is not waiter:
            return
        rank = self._pick(waiter.key)
        if rank is not None:
            self._queues[waiter.key].popleft()
            self._drop_if_empty(waiter.key)
            self._answer(waiter, rank)

    def _enqueue(self, waiter: _Waiter, usable: frozenset[str]) -> None:
        if waiter.choose is not None:
            waiter.rank, waiter.tokens = waiter.choose(sorted(usable))
            _add(self._queued_tokens, waiter.rank, waiter.tokens)
            waiter.key = frozenset((waiter.rank,))
        else:
            waiter.key = usable
        self._queues.setdefault(waiter.key, deque()).append(waiter)

    def _grant(self, rank: str) -> None:
        """Grant `rank`'s free slots to the oldest heads of the queues that may take it."""
        while self.in_flight(rank) < self.limit:
            best: _Waiter | None = None
            for key in [k for k in self._queues if rank in k]:
                head = self._head(key)
                if head is not None and (best is None or head.seq < best.seq):
                    best = head
            if best is None:
                return
            self._queues[best.key].popleft()
            self._drop_if_empty(best.key)
            self._answer(best, rank)

    def _head(self, key: frozenset[str]) -> _Waiter | None:
        queue = self._queues[key]
        while queue and (queue[0].is_gone or queue[0].future.done()):
            queue.popleft()
        if not queue:
            del self._queues[key]
            return None
        return queue[0]

    def _drop_if_empty(self, key: frozenset[str]) -> None:
        if not self._queues.get(key, True):
            del self._queues[key]

    def _answer(self, waiter: _Waiter, rank: str | None) -> None:
        waiter.is_gone = True
        self._waiters.pop(waiter.seq, None)
        if rank is not None:
            _add(self._in_flight, rank, 1)
            self._drain.times.append(self._clock())
        waiter.future.set_result(rank)

    def _leave(self, waiter: _Waiter) -> None:
        """A cancelled waiter: out of the count now, out of its queue when it reaches the head."""
        waiter.is_gone = True
        self._waiters.pop(waiter.seq, None)
        self._unchoose(waiter)

    def _unchoose(self, waiter: _Waiter) -> None:
        if waiter.rank is not None:
            _add(self._queued_tokens, waiter.rank, -waiter.tokens)
            waiter.rank, waiter.tokens = None, 0

    def _pick(self, ranks: Iterable[str]) -> str | None:
        """The free rank with the fewest slots in use, ties in turn; None when none is free."""
        free = sorted(r for r in ranks if self.in_flight(r) < self.limit)
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
