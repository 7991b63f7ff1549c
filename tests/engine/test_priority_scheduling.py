"""The engine's waiting queue is ordered by `SamplingParams.priority` (lower first), arrival order
within a priority; preempted requests go back ahead of their own priority only."""

from __future__ import annotations

from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_engine.request import Request
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import Scheduler, SchedulerConfig


def _scheduler(max_num_seqs: int = 1) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, KVCacheManager(num_blocks=32, block_size=4))


def _request(rid: str, priority: int = 0) -> Request:
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=4, priority=priority))


def test_waiting_requests_run_by_priority_then_arrival() -> None:
    scheduler = _scheduler()
    for rid, priority in [("b1", 10), ("d1", 0), ("b2", 10), ("i1", -10), ("d2", 0), ("s1", -20)]:
        scheduler.add_request(_request(rid, priority))
    assert [r.request_id for r in scheduler.waiting] == ["s1", "i1", "d1", "d2", "b1", "b2"]
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["s1"]


def test_equal_priorities_keep_first_come_first_served() -> None:
    scheduler = _scheduler()
    for i in range(5):
        scheduler.add_request(_request(f"r{i}", 3))
    assert [r.request_id for r in scheduler.waiting] == [f"r{i}" for i in range(5)]


def test_a_preempted_request_goes_back_ahead_of_its_priority_only() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("urgent", -10))
    scheduler.add_request(_request("late", 0))
    victim = _request("victim", 0)
    scheduler._requeue_first(victim)
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "victim", "late"]


def test_kv_arrivals_join_the_queue_by_priority() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("local", 0))
    remote = _request("remote", -10)
    assert scheduler.reserve(remote) is not None
    scheduler.kv_arrived("remote", first_token_id=None)
    assert [r.request_id for r in scheduler.waiting] == ["remote", "local"]
