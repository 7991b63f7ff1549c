"""The decode admission cap (`max_kv_loads_per_step`): at most N requests whose KV just arrived join
the running batch per step, in arrival order; the cap changes when tokens come, never which.

Scheduler tests use a real KVCacheManager and fake sampled tokens; the last test runs EngineCore on
the tiny preset.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from pdmesh.tools.model_init import init_model
from pdmesh_bench.admission import deliver
from pdmesh_engine import EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_engine.request import Request, RequestStatus
from pdmesh_engine.scheduler import SampledToken, Scheduler, SchedulerConfig
from pdmesh_service.worker.engine_options import add_engine_options, engine_argv, engine_config

BS = 4


def make(cap: int | None, num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, 64, 256, cap), KVCacheManager(num_blocks, BS))


def req(rid: str, n: int = 4, max_tokens: int = 8, start: int = 100) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(start, start + n)), params)


def arrive(s: Scheduler, *ids: str, n: int = 4, max_tokens: int = 8) -> None:
    """Reserve and deliver each request's KV (with a first token), in this order."""
    for k, rid in enumerate(ids):
        assert s.reserve(req(rid, n, max_tokens, start=100 + 50 * k)) is not None
    for rid in ids:
        assert s.kv_arrived(rid, 7) is None


def step(s: Scheduler) -> list[str]:
    """One step with fake greedy tokens; the ids of the requests admitted in it."""
    before = {r.request_id for r in s.running}
    out = s.schedule()
    admitted = [i.request_id for i in out.scheduled if i.request_id not in before]
    sampled = {i.request_id: SampledToken(9) for i in out.scheduled if i.needs_sample}
    s.update_from_output(out, sampled)
    s.check_integrity()
    return sorted(admitted)


def test_a_cap_of_two_admits_five_arrivals_two_two_then_one() -> None:
    s = make(cap=2)
    arrive(s, "a", "b", "c", "d", "e")
    assert [step(s) for _ in range(4)] == [["a", "b"], ["c", "d"], ["e"], []]
    assert s.num_running == 5
    assert not any(r.kv_loaded for r in s.running)  # cleared once running


def test_without_a_cap_every_arrival_joins_the_first_step() -> None:
    s = make(cap=None)
    arrive(s, "a", "b", "c", "d", "e")
    assert step(s) == ["a", "b", "c", "d", "e"]


def test_capped_requests_keep_their_places_and_block_those_behind_them() -> None:
    """FCFS: a local request behind a capped arrival waits with it; one in front is not counted."""
    s = make(cap=1)
    s.add_request(req("front", 4, start=600))
    arrive(s, "a", "b")
    s.add_request(req("behind", 4, start=700))
    assert step(s) == ["a", "front"]
    assert [r.request_id for r in s.waiting] == ["b", "behind"]
    assert step(s) == ["b", "behind"]


def test_a_preempted_request_is_readmitted_beside_the_capped_arrivals() -> None:
    """b arrived with its KV, ran, was preempted: when it comes back it is a recompute, not a KV
    load, so the step that readmits it still admits one new arrival (cap 1)."""
    s = make(cap=1, num_blocks=6)
    arrive(s, "a", "b", max_tokens=20)
    assert s.reserve(req("x", 8, start=900)) is not None  # holds the last two blocks
    assert step(s) == ["a"]
    assert step(s) == ["b"]
    for _ in range(10):
        out = s.schedule()
        s.update_from_output(out, {i.request_id: SampledToken(9) for i in out.scheduled})
        if out.preempted_ids:
            break
    assert out.preempted_ids == ["b"]
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and not b.kv_loaded
    s.abort("a")
    s.abort("x")
    arrive(s, "c", "d")
    assert step(s) == ["b", "c"]  # b is not counted; c fills the cap
    [d] = s.waiting
    assert d.request_id == "d" and d.kv_loaded
    assert s.kv.stats().num_free >= 1  # the cap held d back, not the pool


def test_the_option_flows_from_the_command_line_to_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_config(parser.parse_args([])).max_kv_loads_per_step is None
    assert (
        engine_config(parser.parse_args(["--max-kv-loads-per-step", "0"])).max_kv_loads_per_step
        is None
    )
    args = parser.parse_args(["--max-kv-loads-per-step", "4"])
    assert engine_config(args).max_kv_loads_per_step == 4
    assert engine_argv(args) == ["--max-kv-loads-per-step", "4"]
    with pytest.raises(ValueError, match="max_kv_loads_per_step"):
        engine_config(parser.parse_args(["--max-kv-loads-per-step", "-1"]))


CONFIG = EngineConfig(num_blocks=128, block_size=16, device="cpu", num_threads=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("cap") / "tiny", preset="tiny", seed=0, verbose=False)


def test_the_cap_changes_timing_never_tokens(model_dir: Path) -> None:
    prompts = [[(7 + 13 * i + 29 * k) % 900 + 4 for i in range(11 + 3 * k)] for k in range(5)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = {}
    for cap in (None, 2):
        engine = EngineCore(model_dir, replace(CONFIG, max_kv_loads_per_step=cap))
        first = deliver(engine, prompts, params)
        for rid, token in first.items():
            assert engine.kv_arrived(rid, token) is None
        tokens: dict[str, list[int]] = {rid: [token] for rid, token in first.items()}
        batches = []
        while engine.has_unfinished:
            outputs = engine.step()
            batches.append(len(outputs))
            for out in outputs:
                tokens[out.request_id].extend(out.new_token_ids)
        engine.check_integrity()
        results[cap] = tokens, batches
    assert results[2][1][:3] == [2, 4, 5]  # the cap did shape the batches
    assert results[None][1][0] == 5
    assert results[2][0] == results[None][0]
    assert all(len(t) == 6 for t in results[2][0].values())
