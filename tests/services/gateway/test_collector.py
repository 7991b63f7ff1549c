"""The gateway defers full garbage collections while its queue is long (a full collection walks
every live object: at 800 queued requests a 100+ ms stop of the loop that relays every token),
runs the one it held back once the queue is short or the deferral is too old, and makes no
reference cycle per request for them to find."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest
from tenacity import AsyncRetrying, retry_if_exception_type, wait_none

from pdmesh_gateway.collector import QueueAwareCollector
from pdmesh_gateway.retry import retried


class _Cycle:
    """Only a full collection frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _restore_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)


def _dead_cycle_in_the_oldest_generation() -> weakref.ref[_Cycle]:
    cycle = _Cycle()
    gc.collect(1)  # alive: moved to the oldest generation
    ref = weakref.ref(cycle)
    del cycle
    return ref


def test_full_collections_wait_while_the_queue_is_long_and_run_once_it_is_short() -> None:
    full = gc.get_threshold()[2]
    collector = QueueAwareCollector(defer_above=10)
    collector.tick(10, now=0.0)  # not above the bound
    assert collector.deferred_since is None and gc.get_threshold()[2] == full

    collector.tick(11, now=1.0)
    assert collector.deferred_since == 1.0 and gc.get_threshold()[2] > 1_000_000
    dead = _dead_cycle_in_the_oldest_generation()
    collector.tick(3, now=2.0)  # more than a quarter of the bound still waits
    assert dead() is not None and collector.num_deferred == 0

    collector.tick(2, now=3.0)
    assert dead() is None and collector.num_deferred == 1  # the held-back collection freed it
    assert collector.deferred_since is None and gc.get_threshold()[2] == full


def test_an_overload_longer_than_max_defer_s_still_gets_a_full_collection() -> None:
    collector = QueueAwareCollector(defer_above=10, max_defer_s=60.0)
    collector.tick(500, now=0.0)
    dead = _dead_cycle_in_the_oldest_generation()
    collector.tick(500, now=59.0)
    assert dead() is not None
    collector.tick(500, now=60.0)
    assert dead() is None and collector.num_deferred == 1
    collector.tick(500, now=61.0)  # the queue is still long: deferred again
    assert collector.deferred_since == 61.0


def test_a_retried_call_leaves_no_cycle_behind() -> None:
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("first try fails")
        return "ok"

    retrying = AsyncRetrying(retry=retry_if_exception_type(ConnectionError), wait=wait_none())
    alive = weakref.ref(retrying)
    gc.disable()
    try:
        assert asyncio.run(retried(retrying, flaky)) == "ok" and len(calls) == 2
        del retrying
        assert alive() is None  # freed by its reference count: no collection needed
    finally:
        gc.enable()
