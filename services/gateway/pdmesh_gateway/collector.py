"""Garbage collection that does not stall the gateway's event loop under a long queue.

A full CPython collection walks every live tracked object. A queued request holds ~200 of them
(its connection, the ASGI stack, its coroutines), so at 800 queued requests a full collection
walks ~130K objects and stops the loop that relays every token for 100+ ms. Those objects are
live, not garbage, and the gateway makes almost no cyclic garbage (what tenacity kept was the bulk:
`retry.retried`): while the queue is long, full collections are deferred (young ones go on), and
one runs once the queue is short again. Under an overload longer than `max_defer_s`, one runs
every `max_defer_s` anyway, to bound what the deferral can keep."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)

DEFER_ABOVE = 64  # queued requests above which full collections wait
MAX_DEFER_S = 300.0
TICK_S = 1.0
_NEVER = 1 << 30  # a full-collection threshold no run reaches


@dataclass
class QueueAwareCollector:
    """Defers full collections from the `tick` that sees more than `defer_above` requests wait,
    until one sees at most a quarter of that (or `max_defer_s` passed): then one runs."""

    defer_above: int = DEFER_ABOVE
    max_defer_s: float = MAX_DEFER_S
    deferred_since: float | None = None
    num_deferred: int = 0  # full collections run at the end of a deferral

    def __post_init__(self) -> None:
        self.full_threshold = gc.get_threshold()[2]

    def tick(self, waiting: int, now: float) -> None:
        if self.deferred_since is None:
            if waiting > self.defer_above:
                young, older, _ = gc.get_threshold()
                gc.set_threshold(young, older, _NEVER)
                self.deferred_since = now
        elif waiting <= self.defer_above // 4 or now - self.deferred_since >= self.max_defer_s:
            self.collect(now)

    def collect(self, now: float) -> None:
        """End the deferral with the full collection it held back."""
        young, older, _ = gc.get_threshold()
        gc.set_threshold(young, older, self.full_threshold)
        deferred_s = 0.0 if self.deferred_since is None else now - self.deferred_since
        freed = gc.collect()
        self.deferred_since, self.num_deferred = None, self.num_deferred + 1
        log.info("full collection after a long queue", deferred_s=round(deferred_s, 1), freed=freed)

    async def run(self, waiting: Callable[[], int], tick_s: float = TICK_S) -> None:
        """Forever: `tick` on the number of requests `waiting` at the gateway."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick_s)
            self.tick(waiting(), loop.time())
