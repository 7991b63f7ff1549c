"""The fair queue's core (no asyncio): DRR fairness by tokens across tenants, strict priority
across classes, starvation promotion, concurrency caps, and the queue bounds."""

from __future__ import annotations

import random

import pytest

from pdmesh_gateway.fair_queue import Entry, FairQueue, FairQueueConfig, Rejected
from pdmesh_gateway.tenants import PriorityClass, TenantLimits

DEFAULT, BATCH = PriorityClass.DEFAULT, PriorityClass.BATCH
INTERACTIVE, SYSTEM = PriorityClass.INTERACTIVE, PriorityClass.SYSTEM


def _enqueue(q: FairQueue, tenant: str, cls=DEFAULT, cost=100, now=0.0, **limits) -> Entry:
    return q.enqueue(TenantLimits(tenant, **limits), cls, cost, cost // 2, now)


def test_ten_to_one_offered_load_gets_equal_tokens_within_20_percent() -> None:
    """A saturated queue (capacity 4 start slots, each finishing after its cost in ticks):
    tenant A offers 10x B's requests; both keep requests waiting, so both get equal tokens."""
    rng = random.Random(0)
    q = FairQueue(FairQueueConfig(capacity=4, max_queued=10_000, quantum_tokens=256))
    served = {"a": 0, "b": 0}
    running: list[tuple[float, Entry]] = []
    for tick in range(4000):
        now = float(tick)
        for _ in range(10):
            _enqueue(q, "a", cost=rng.randint(50, 400), now=now)
        _enqueue(q, "b", cost=rng.randint(50, 400), now=now)
        for end, entry in [r for r in running if r[0] <= now]:
            running.remove((end, entry))
            q.finished(entry)  # its first byte, and its end: the slots are the bottleneck
        for entry in q.pump(now):
            served[entry.tenant] += entry.cost
            running.append((now + entry.cost / 100, entry))
        if q.num_queued > 5000:  # the offered load is far past capacity: trim A's backlog
            break
    assert served["b"] > 0 and abs(served["a"] - served["b"]) <= 0.2 * served["b"], served


def test_a_tenant_that_asks_little_gets_all_it_asks() -> None:
    q = FairQueue(FairQueueConfig(capacity=1, max_queued=1000, quantum_tokens=100))
    for _ in range(20):
        _enqueue(q, "big")
    small = _enqueue(q, "small")
    order = []
    for _ in range(3):
        (entry,) = q.pump(0.0)
        order.append(entry.tenant)
        q.finished(entry)
    assert small.state != "queued" and order.count("small") == 1


def test_strict_priority_across_classes_fifo_within_a_tenant() -> None:
    q = FairQueue(FairQueueConfig(capacity=1))
    batch = [_enqueue(q, "b", BATCH, now=0.0) for _ in range(3)]
    inter = _enqueue(q, "i", INTERACTIVE, now=1.0)
    system = _enqueue(q, "s", SYSTEM, now=2.0)
    default = _enqueue(q, "d", DEFAULT, now=3.0)
    granted = []
    for now in (4.0, 5.0, 6.0, 7.0, 8.0, 9.0):
        (entry,) = q.pump(now)
        granted.append(entry)
        assert q.pump(now) == []  # one start slot
        q.started(entry)
        q.finished(entry)
    assert granted == [system, inter, default, *batch]


def test_starvation_promotion_after_the_bound() -> None:
    q = FairQueue(FairQueueConfig(capacity=1, starvation_s=10.0))
    old = _enqueue(q, "b", BATCH, now=0.0)
    for i in range(5):
        _enqueue(q, "i", INTERACTIVE, now=float(i))
    (first,) = q.pump(5.0)
    assert first.priority is INTERACTIVE  # before the bound: strict priority
    q.finished(first)
    (second,) = q.pump(10.0)
    assert second is old and q.num_promoted == 1  # waited 10 s: it goes first
    q.finished(second)
    assert q.pump(10.0)[0].priority is INTERACTIVE


def test_max_concurrency_holds_and_a_capped_tenant_does_not_block_others() -> None:
    q = FairQueue(FairQueueConfig(capacity=10))
    capped = [_enqueue(q, "c", max_concurrency=2) for _ in range(5)]
    other = _enqueue(q, "o")
    granted = q.pump(0.0)
    assert [e.tenant for e in granted].count("c") == 2 and other in granted
    for entry in granted:
        q.started(entry)  # streaming: start slots free, concurrency still held
    assert q.pump(0.0) == [] and q.running("c") == 2
    q.finished(granted[0])
    assert q.pump(0.0) == [capped[2]]


def test_per_class_tenant_and_total_bounds_reject_with_reasons() -> None:
    q = FairQueue(FairQueueConfig(capacity=1, max_queued=6, class_max_queued={BATCH: 2}), [])
    _enqueue(q, "x", INTERACTIVE)
    q.pump(0.0)  # takes the only slot
    _enqueue(q, "b", BATCH)
    _enqueue(q, "b", BATCH)
    with pytest.raises(Rejected) as info:
        _enqueue(q, "b", BATCH)
    assert info.value.reason == "class_full" and info.value.retry_after_s > 0
    # a full class refuses only tenants holding their share of it: a newcomer still gets in
    _enqueue(q, "b2", BATCH)
    _enqueue(q, "t", max_queued=1)
    with pytest.raises(Rejected) as info:
        _enqueue(q, "t", max_queued=1)
    assert info.value.reason == "tenant_full"
    _enqueue(q, "y")
    _enqueue(q, "y")  # 6 queued: full
    with pytest.raises(Rejected) as info:
        _enqueue(q, "y")  # y holds 2 of 6 with 4 tenants waiting: over its share
    assert info.value.reason == "full"
    _enqueue(q, "z")  # holds none: admitted over the bound (by one per tenant at most)
    stats = q.stats()
    assert stats[("b", BATCH)].rejected_requests == {"class_full": 1}
    assert stats[("b", BATCH)].rejected_tokens == {"class_full": 100}
    view = q.view(0.0)
    assert view["queued"] == 7 and view["starting"] == 1


def test_a_flooding_tenant_cannot_lock_others_out_of_a_full_queue() -> None:
    q = FairQueue(FairQueueConfig(capacity=1, max_queued=8))
    flooded = 0
    for _ in range(100):
        try:
            _enqueue(q, "flood")
        except Rejected:
            flooded += 1
    assert flooded == 92
    for _ in range(8):
        _enqueue(q, "polite")  # under its share (half of what waits) each time
    with pytest.raises(Rejected) as info:
        _enqueue(q, "polite")  # 8 of 16: its share
    assert info.value.reason == "full"


def test_a_rate_limited_tenant_waits_for_its_bucket_and_says_when() -> None:
    q = FairQueue(FairQueueConfig(capacity=4))
    first = q.enqueue(TenantLimits("r", max_tokens_per_s=100.0), DEFAULT, 300, 250, 0.0)
    assert q.pump(0.0) == [first]  # 250 prompt tokens from a full bucket of 100: 150 in debt
    second = q.enqueue(TenantLimits("r", max_tokens_per_s=100.0), DEFAULT, 10, 5, 0.0)
    assert q.pump(0.0) == [] and q.next_wakeup(0.0) == pytest.approx(1.5)
    q.charge(first, 50, 0.0)  # output tokens deepen the debt
    assert q.next_wakeup(0.0) == pytest.approx(2.0)
    assert q.pump(2.0) == [second]


def test_leaving_the_queue_keeps_the_others_order() -> None:
    q = FairQueue(FairQueueConfig(capacity=1))
    a = [_enqueue(q, "a") for _ in range(3)]
    q.leave(a[0], "client_gone", 0.0)
    assert q.pump(0.0) == [a[1]]
    assert q.stats()[("a", DEFAULT)].rejected_requests == {"client_gone": 1}


def test_slots_held_until_the_end_and_reserved_for_urgent_classes() -> None:
    q = FairQueue(FairQueueConfig(capacity=3, hold_until_end=True, reserved_slots=1))
    batch = [_enqueue(q, "b", BATCH) for _ in range(3)]
    granted = q.pump(0.0)
    assert granted == batch[:2]  # the last slot is kept for system and interactive
    for entry in granted:
        q.started(entry)  # streaming: the slots stay held
    assert q.pump(0.0) == [] and q.num_starting == 2
    urgent = _enqueue(q, "i", INTERACTIVE)
    assert q.pump(0.0) == [urgent]
    q.finished(granted[0])
    assert q.pump(0.0) == [] and q.num_starting == 2  # one free slot: reserved
    q.finished(urgent)
    assert q.pump(0.0) == [batch[2]]
