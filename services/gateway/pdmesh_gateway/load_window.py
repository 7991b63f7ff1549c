"""The autoscaler's window on the gateway's load (pure: no asyncio, grpc or redis; times are passed
in, `time.monotonic` seconds).

Chain: requests (`arrived` → `left_queue` → `ended`, from the orchestrator and the starter) and the
pools' state (`sample`, each autoscale tick) → `snapshot(now)` → `autoscale.Signals`.

Queue time: a request's wait at the gateway from its arrival until it leaves the gateway's queues
for its first start (its prefill slot granted; on the agg or local path, its decode call begun): the
fair queue, the prefill admission queue and any retries before that. A request that ends without
leaving (shed, timed out, client gone) counts its wait until then. The snapshot's queue time is the
p90 of the waits recorded in the window or, if longer, the age of the oldest request still waiting
(a queue that nobody leaves shows at once, not when it drains).

Memory: every record older than the window is dropped when a newer one is added, so the window
holds what arrived in `window_s` (a few per request), whether or not anybody takes snapshots.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TypeVar

from pdmesh_gateway.autoscale import PoolSignals, Signals

QUEUE_QUANTILE = 0.9
T = TypeVar("T", int, float)


@dataclass(slots=True)
class QueueTicket:
    """One request's passage through the gateway's queues; `left_at` once it left them."""

    seq: int
    arrived_at: float
    left_at: float | None = None


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    prefill_utilization: float
    decode_utilization: float
    kv_waiting: float


@dataclass
class LoadWindow:
    """What the gateway saw over the last `window_s` seconds (module docstring)."""

    window_s: float
    started_at: float = 0.0  # when the window began filling (the rate's span until it is full)
    _arrivals: deque[tuple[float, int]] = field(default_factory=deque)  # (at, prompt tokens)
    _waits: deque[tuple[float, float]] = field(default_factory=deque)  # (left at, wait s)
    _outputs: deque[tuple[float, int]] = field(default_factory=deque)  # (ended at, tokens)
    _samples: deque[_Sample] = field(default_factory=deque)
    _queued: dict[int, QueueTicket] = field(default_factory=dict)  # in arrival order
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"the load window must be positive, got {self.window_s}")

    # ----- requests -----
    def arrived(self, now: float, prompt_tokens: int) -> QueueTicket:
        """A request entered the gateway; it waits in its queues until `left_queue`."""
        ticket = QueueTicket(next(self._seq), now)
        self._queued[ticket.seq] = ticket
        _push(self._arrivals, (now, prompt_tokens), now - self.window_s)
        return ticket

    def left_queue(self, ticket: QueueTicket, now: float) -> None:
        """The request left the gateway's queues (its first start began); later calls are no-ops."""
        if ticket.left_at is not None:
            return
        ticket.left_at = now
        self._queued.pop(ticket.seq, None)
        _push(self._waits, (now, now - ticket.arrived_at), now - self.window_s)

    def ended(self, ticket: QueueTicket, now: float, output_tokens: int) -> None:
        """The request ended (any way): its wait counts until now if it never left the queue."""
        self.left_queue(ticket, now)
        _push(self._outputs, (now, output_tokens), now - self.window_s)

    # ----- the pools -----
    def sample(
        self,
        now: float,
        prefill_utilization: float,
        decode_utilization: float,
        kv_waiting: float,
    ) -> None:
        """The pools' state now (one sample per autoscale tick)."""
        sample = _Sample(now, prefill_utilization, decode_utilization, kv_waiting)
        self._samples.append(sample)
        while self._samples and self._samples[0].at < now - self.window_s:
            self._samples.popleft()

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def oldest_wait_s(self, now: float) -> float:
        """How long the oldest request still in the queues has waited (0: none waits)."""
        first = next(iter(self._queued.values()), None)
        return 0.0 if first is None else max(now - first.arrived_at, 0.0)

    def snapshot(self, now: float, prefill_ready: int, decode_ready: int) -> Signals:
        """The window up to `now` as the planner's `Signals`."""
        since = now - self.window_s
        arrivals = [tokens for at, tokens in self._arrivals if at >= since]
        waits = [wait for at, wait in self._waits if at >= since]
        outputs = [tokens for at, tokens in self._outputs if at >= since]
        samples = [s for s in self._samples if s.at >= since]
        span = max(min(self.window_s, now - self.started_at), 1e-9)
        return Signals(
            queue_time_s=max(_quantile(waits, QUEUE_QUANTILE), self.oldest_wait_s(now)),
            kv_waiting=_mean([s.kv_waiting for s in samples]),
            arrival_rate=len(arrivals) / span,
            mean_prompt_tokens=_mean(arrivals),
            mean_output_tokens=_mean(outputs),
            prefill=PoolSignals(prefill_ready, _mean([s.prefill_utilization for s in samples])),
            decode=PoolSignals(decode_ready, _mean([s.decode_utilization for s in samples])),
        )


def _push(records: deque[tuple[float, T]], record: tuple[float, T], horizon: float) -> None:
    """Append `record` (its time first) and drop those older than `horizon`."""
    records.append(record)
    while records and records[0][0] < horizon:
        records.popleft()


def _mean(values: list[float] | list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
