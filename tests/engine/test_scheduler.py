"""Scheduler with a real KVCacheManager and fake sampled tokens: no model, no device."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_engine.request import Request, RequestStatus
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import (
    SampledToken,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    StepOutput,
)

BS = 4
EOS = 1


def make(
    num_blocks: int = 64,
    max_num_seqs: int = 8,
    max_batched: int = 64,
    max_model_len: int = 256,
    caching: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_batched, max_model_len),
        KVCacheManager(num_blocks, BS, caching),
    )


def req(rid: str, n: int, start: int = 100, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(
        rid, list(range(start, start + n)), SamplingParams(**params), eos_token_ids=(EOS,)
    )


def fake_token(request: Request) -> int:
    """A deterministic 'sample': depends only on the request's tokens so far (like greedy
    decoding)."""
    return 10 + (sum(request.all_token_ids) * 31 + request.num_tokens) % 500


def step(
    s: Scheduler, token_fn: Callable[[Request], int] = fake_token
) -> tuple[SchedulerOutput, list[StepOutput]]:
    """One engine step: schedule, 'run the model' (sample for rows that need it), update; check
    integrity."""
    out = s.schedule()
    _check_output(s, out)
    sampled = {
        item.request_id: SampledToken(token_fn(s.requests[item.request_id]))
        for item in out.scheduled
        if item.needs_sample
    }
    results = s.update_from_output(out, sampled)
    s.check_integrity()
    return out, results


def _check_output(s: Scheduler, out: SchedulerOutput) -> None:
    assert out.num_tokens <= s.config.max_num_batched_tokens
    assert len(out.scheduled) <= s.config.max_num_seqs
    assert s.num_running <= s.config.max_num_seqs
    ids = [item.request_id for item in out.scheduled]
    assert len(ids) == len(set(ids))
    lengths = [len(item.token_ids) for item in out.scheduled]
    assert all(n >= 1 for n in lengths)
    singles = [n == 1 for n in lengths]
    assert singles == sorted(singles, reverse=True), "single-token decodes must come first"
    for item in out.scheduled:
        r = s.requests[item.request_id]
        end = item.start_position + len(item.token_ids)
        assert item.start_position == r.num_computed_tokens
        assert item.token_ids == r.all_token_ids[item.start_position : end]
        assert item.needs_sample == (end == r.num_tokens)
        assert len(item.block_ids) * BS >= end
        assert list(item.block_ids) == s.kv.blocks_of(item.request_id)
    s.check_integrity()


def run_all(
    s: Scheduler, max_steps: int = 500, token_fn: Callable[[Request], int] = fake_token
) -> tuple[dict[str, list[int]], dict[str, str], list[SchedulerOutput]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    outputs = []
    for _ in range(max_steps):
        if not s.has_unfinished:
            break
        out, results = step(s, token_fn)
        outputs.append(out)
        for r in results:
            tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
            if r.finish_reason is not None:
                assert r.request_id not in reasons
                reasons[r.request_id] = r.finish_reason
    assert not s.has_unfinished, "did not finish"
    assert s.kv.stats().num_used == 0
    return tokens, reasons, outputs


# ----- chunked prefill and batching -----


def test_long_prompt_is_chunked_across_steps() -> None:
    s = make(max_batched=8)
    s.add_request(req("a", 20, max_tokens=2))
    chunks = []
    for _ in range(3):
        out, results = step(s)
        [item] = out.scheduled
        chunks.append((item.start_position, len(item.token_ids), item.needs_sample))
        assert bool(results) == item.needs_sample
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    r = s.requests["a"]
    assert r.num_computed_tokens == 20 and r.num_output_tokens == 1
    out, _ = step(s)  # the decode of the first output token
    assert [(i.start_position, len(i.token_ids)) for i in out.scheduled] == [(20, 1)]
    assert not s.has_unfinished and s.kv.stats().num_used == 0


def test_token_budget_is_shared_and_decodes_come_first() -> None:
    s = make(max_batched=16)
    s.add_request(req("a", 3, max_tokens=10))
    s.add_request(req("b", 40, start=300, max_tokens=2))
    out, _ = step(s)
    assert [(i.request_id, len(i.token_ids)) for i in out.scheduled] == [("a", 3), ("b", 13)]
    out, _ = step(s)  # a decodes (1 token), b gets the other 15
    assert [(i.request_id, i.start_position, len(i.token_ids)) for i in out.scheduled] == [
        ("a", 3, 1),
        ("b", 13, 15),
    ]
    assert out.num_tokens == 16


def test_decode_sorted_before_an_earlier_running_prefill() -> None:
    s = make(max_batched=16)
    s.add_request(req("long", 40, max_tokens=2))
    step(s)  # long: 16 of 40
    remote = req("remote", 5, start=700, max_tokens=4)
    assert s.reserve(remote) is not None
    s.kv_arrived("remote", 42)
    out, _ = step(s)  # long takes the whole budget
    assert [i.request_id for i in out.scheduled] == ["long"]
    out, _ = step(s)  # long's last 8 tokens, then remote's decode
    assert [i.request_id for i in out.scheduled] == ["remote", "long"]
    assert [len(i.token_ids) for i in out.scheduled] == [1, 8]
    # running order is admission order
    assert [r.request_id for r in s.running] == ["long", "remote"]


def test_needs_sample_only_on_the_last_chunk() -> None:
    s = make(max_batched=5)
    s.add_request(req("a", 12, max_tokens=3))
    flags = []
    while s.has_unfinished:
        out, results = step(s)
        flags.append([i.needs_sample for i in out.scheduled])
        assert {r.request_id for r in results} == {
            i.request_id for i in out.scheduled if i.needs_sample
        }
    assert flags == [[False], [False], [True], [True], [True]]


def test_max_num_seqs_caps_running() -> None:
    s = make(max_num_seqs=2)
    for i in range(5):
        s.add_request(req(f"r{i}", 3, start=100 * i, max_tokens=3))
    out, _ = step(s)
    assert [i.request_id for i in out.scheduled] == ["r0", "r1"]
    assert s.num_running == 2 and s.num_waiting == 3
    seen_running = set()
    while s.has_unfinished:
        out, _ = step(s)
        assert len(out.scheduled) <= 2 and s.num_running <= 2
        seen_running |= {i.request_id for i in out.scheduled}
    assert seen_running == {f"r{i}" for i in range(5)}


def test_admission_is_first_come_first_served() -> None:
    s = make(num_blocks=10, max_num_seqs=3, max_batched=8)
    order = ["r3", "r0", "r4", "r1", "r2"]
    for n, rid in enumerate(order):
        s.add_request(req(rid, 2 + 3 * n, start=1000 * n, max_tokens=4))
    first_step: dict[str, int] = {}
    for k in range(200):
        if not s.has_unfinished:
            break
        out, _ = step(s)
        for item in out.scheduled:
            first_step.setdefault(item.request_id, k)
    assert sorted(first_step, key=lambda r: (first_step[r], order.index(r))) == order
    assert [first_step[r] for r in order] == sorted(first_step[r] for r in order)


def test_head_of_queue_blocks_later_requests_when_blocks_are_short() -> None:
    s = make(num_blocks=6, max_batched=64)
    s.add_request(req("a", 12, max_tokens=8))  # 3 blocks, grows to 5
    step(s)
    s.add_request(req("big", 14, start=300, max_tokens=1))  # needs 4 blocks, only 3 free
    s.add_request(req("small", 2, start=600, max_tokens=1))  # would fit, but must wait its turn
    out, _ = step(s)
    assert [i.request_id for i in out.scheduled] == ["a"]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    tokens, reasons, outputs = run_all(s)
    firsts = [
        next(k for k, o in enumerate(outputs) if any(i.request_id == r for i in o.scheduled))
        for r in ("big", "small")
    ]
    assert firsts[0] <= firsts[1]
    assert reasons == {"a": "length", "big": "length", "small": "length"}


# ----- preemption -----


def test_preemption_frees_the_latest_request_and_it_finishes_later() -> None:
    # 6 blocks of 4; a and b grow to 8 + 12 = 20 tokens = 5 blocks each: both cannot fit.
    # c waits behind them (max_num_seqs=2); the preempted b goes back in front of it.
    s = _three_requests(num_blocks=6)
    preempted_at = None
    b_tokens_at_preemption = None
    tokens: dict[str, list[int]] = {}
    reasons = {}
    recompute = None
    for k in range(100):
        if not s.has_unfinished:
            break
        out, results = step(s)
        for r in results:
            tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
            if r.finish_reason:
                reasons[r.request_id] = r.finish_reason
        if out.preempted_ids and preempted_at is None:
            preempted_at = k
            assert out.preempted_ids == ["b"]  # the latest request, not the earlier one
            b = s.requests["b"]
            assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert b.num_preemptions == 1
            assert s.kv.blocks_of("b") == []
            assert "b" not in {i.request_id for i in out.scheduled}
            assert [r.request_id for r in s.waiting] == ["b", "c"]
            b_tokens_at_preemption = list(b.all_token_ids)
        elif (
            preempted_at is not None
            and recompute is None
            and any(i.request_id == "b" for i in out.scheduled)
        ):
            recompute = next(i for i in out.scheduled if i.request_id == "b")
    assert preempted_at is not None, "the pool was never short"
    # b is recomputed from scratch (prompt + the outputs it had), minus what the prefix cache kept
    assert recompute is not None and recompute.needs_sample
    assert recompute.start_position % BS == 0
    assert recompute.start_position + len(recompute.token_ids) == len(b_tokens_at_preemption)
    assert recompute.token_ids == b_tokens_at_preemption[recompute.start_position :]
    assert reasons == {"a": "length", "b": "length", "c": "length"}
    assert len(tokens["a"]) == len(tokens["b"]) == 12
    # the outputs are what an unpressured run produces (fake sampling depends only on the tokens)
    ref_tokens, _, ref_outputs = run_all(_three_requests(num_blocks=64))
    assert tokens == ref_tokens
    assert not any(o.preempted_ids for o in ref_outputs)
    assert s.kv.stats().num_used == 0


def _three_requests(num_blocks: int) -> Scheduler:
    s = make(num_blocks=num_blocks, max_num_seqs=2, max_batched=64)
    s.add_request(req("a", 8, max_tokens=12))
    s.add_request(req("b", 8, start=300, max_tokens=12))
    s.add_request(req("c", 3, start=600, max_tokens=2))
    return s


def test_many_requests_under_block_pressure_all_finish() -> None:
    s = make(num_blocks=12, max_num_seqs=6, max_batched=24)
    for i in range(8):
        s.add_request(req(f"r{i}", 3 + 5 * (i % 4), start=37 * i, max_tokens=6 + i))
    tokens, reasons, outputs = run_all(s)
    assert any(o.preempted_ids for o in outputs)
    assert reasons == {f"r{i}": "length" for i in range(8)}
    assert {r: len(t) for r, t in tokens.items()} == {f"r{i}": 6 + i for i in range(8)}
    # the same outputs as without pressure
    ref = make(num_blocks=200, max_num_seqs=6, max_batched=24)
    for i in range(8):
        ref.add_request(req(f"r{i}", 3 + 5 * (i % 4), start=37 * i, max_tokens=6 + i))
    assert run_all(ref)[0] == tokens


def test_preempting_itself_when_alone_and_short() -> None:
    # a waiting-for-KV reservation holds blocks; the running request must give way and retry later
    s = make(num_blocks=4, max_batched=64)
    s.add_request(req("a", 6, max_tokens=8))  # grows to 14 tokens = 4 blocks
    step(s)
    assert s.reserve(req("held", 7, start=500, max_tokens=1)) is not None  # 2 blocks
    preempted = []
    for _ in range(10):
        out, _ = step(s)
        preempted += out.preempted_ids
        if preempted:
            break
    assert preempted == ["a"]
    assert s.requests["a"].status is RequestStatus.PREEMPTED and s.kv.blocks_of("a") == []
    assert s.abort("held")
    tokens, reasons, _ = run_all(s)
    assert reasons == {"a": "length"}


# ----- abort -----


def test_abort_while_waiting() -> None:
    s = make()
    s.add_request(req("a", 5))
    assert s.abort("a")
    assert s.num_waiting == 0 and not s.has_unfinished
    out = s.schedule()
    assert out.is_empty and out.finished_ids == ["a"]
    assert s.kv.stats().num_used == 0
    s.check_integrity()


def test_abort_mid_prefill_between_chunks() -> None:
    s = make(max_batched=8)
    s.add_request(req("a", 30, max_tokens=4))
    s.add_request(req("b", 3, start=500, max_tokens=4))
    step(s)
    assert 0 < s.requests["a"].num_computed_tokens < 30
    assert s.abort("a")
    s.check_integrity()
    assert "a" not in s.kv.req_blocks
    tokens, reasons, outputs = run_all(s)
    assert reasons == {"b": "length"}
    assert all(i.request_id != "a" for o in outputs for i in o.scheduled)
    assert outputs[0].finished_ids == ["a"]


def test_abort_mid_decode_and_unknown_ids() -> None:
    s = make()
    s.add_request(req("a", 5, max_tokens=50))
    s.add_request(req("b", 6, start=400, max_tokens=5))
    for _ in range(3):
        step(s)
    assert s.requests["a"].num_output_tokens == 3
    assert s.abort("a")
    assert not s.abort("a")  # already gone
    assert not s.abort("nope")
    s.check_integrity()
    tokens, reasons, _ = run_all(s)
    assert reasons == {"b": "length"}
    assert s.kv.stats().num_used == 0


def test_abort_between_schedule_and_update_is_ignored_by_update() -> None:
    s = make()
    s.add_request(req("a", 5, max_tokens=5))
    s.add_request(req("b", 5, start=400, max_tokens=5))
    out = s.schedule()
    assert s.abort("a")
    results = s.update_from_output(out, {i.request_id: SampledToken(7) for i in out.scheduled})
    assert [r.request_id for r in results] == ["b"]
    s.check_integrity()
    assert s.kv.blocks_of("a") == []
    run_all(s)


# ----- WAITING_FOR_KV (disaggregated prefill) -----


def test_reserve_then_kv_arrived_decodes_from_prompt_length() -> None:
    s = make(num_blocks=16)
    r = req("r", 10, max_tokens=3)
    blocks = s.reserve(r)
    assert blocks is not None and len(blocks) == 3 and s.kv.blocks_of("r") == blocks
    assert r.status is RequestStatus.WAITING_FOR_KV
    assert s.kv.stats().num_used == 3 and s.num_waiting == 1
    s.add_request(req("other", 4, start=500, max_tokens=2))
    for _ in range(3):
        out, _ = step(s)
        assert "r" not in {i.request_id for i in out.scheduled}
    assert s.kv_arrived("r", 77) is None  # not finished: it goes on decoding
    assert r.output_token_ids == [77] and r.num_computed_tokens == 10
    out, results = step(s)
    [item] = [i for i in out.scheduled if i.request_id == "r"]
    assert (item.token_ids, item.start_position, item.needs_sample) == ([77], 10, True)
    assert item.block_ids[:3] == blocks
    tokens, reasons, _ = run_all(s)
    assert reasons["r"] == "length"
    assert r.num_output_tokens == 3 and r.output_token_ids[0] == 77


def test_kv_arrived_without_first_token_recomputes_the_last_prompt_token() -> None:
    s = make(num_blocks=16)
    s.reserve(req("r", 10, max_tokens=2))
    s.kv_arrived("r")
    out, results = step(s)
    [item] = out.scheduled
    assert (item.token_ids, item.start_position, item.needs_sample) == ([109], 9, True)
    assert [r.request_id for r in results] == ["r"]
    run_all(s)


@pytest.mark.parametrize(
    "params, first, reason, stop_reason",
    [
        ({"max_tokens": 1}, 5, "length", None),
        ({"ignore_eos": False}, EOS, "stop", None),
        ({"stop_token_ids": [5]}, 5, "stop", 5),
    ],
)
def test_kv_arrived_with_a_final_first_token_finishes_at_once(
    params: dict, first: int, reason: str, stop_reason: int | None
) -> None:
    s = make(num_blocks=16)
    r = req("r", 10, **params)
    s.reserve(r)
    result = s.kv_arrived("r", first)
    assert result is not None and result.request_id == "r"
    assert (result.finish_reason, result.stop_reason) == (reason, stop_reason)
    assert r.is_finished and r.output_token_ids == [first]
    assert s.kv.stats().num_used == 0 and not s.has_unfinished
    out = s.schedule()
    assert out.is_empty and out.finished_ids == ["r"]
    s.check_integrity()


def test_reservation_registers_prompt_blocks_in_the_prefix_cache() -> None:
    s = make(num_blocks=16)
    s.reserve(req("r", 9, max_tokens=4))
    s.kv_arrived("r", 5)
    s.add_request(req("same", 9, max_tokens=1))  # same prompt: 2 full blocks cached
    out, _ = step(s)
    item = next(i for i in out.scheduled if i.request_id == "same")
    assert item.start_position == 2 * BS
    assert item.block_ids[:2] == s.kv.blocks_of("r")[:2]


def test_aborted_reservation_returns_its_blocks() -> None:
    s = make(num_blocks=8)
    s.reserve(req("r", 10))
    assert s.kv.stats().num_used == 3
    assert s.abort("r")
    assert s.kv.stats().num_used == 0 and s.num_waiting == 0
    s.check_integrity()
    with pytest.raises(KeyError):
        s.kv_arrived("r", 1)


def test_reserve_returns_none_when_the_pool_is_short() -> None:
    s = make(num_blocks=4)
    assert s.reserve(req("a", 12)) is not None  # 3 blocks
    before = (s.kv.stats(), dict(s.kv.req_blocks))
    r = req("b", 5)  # 2 blocks, 1 left
    assert s.reserve(r) is None
    assert (s.kv.stats(), dict(s.kv.req_blocks)) == before
    assert "b" not in s.requests and r.status is RequestStatus.WAITING
    assert s.reserve(req("b", 4)) is not None  # 1 block fits
    s.check_integrity()
    with pytest.raises(ValueError, match="already in use"):
        s.reserve(req("b", 4))


# ----- stop conditions -----


def run_one(
    params: dict, tokens: list[int], s: Scheduler | None = None
) -> tuple[list[int], str, Request]:
    s = s or make()
    r = req("x", 4, **params)
    s.add_request(r)
    feed = iter(tokens)
    got, reason = [], None
    while s.has_unfinished:
        _, results = step(s, lambda _: next(feed))
        for res in results:
            got += res.new_token_ids
            reason = res.finish_reason or reason
    assert s.kv.stats().num_used == 0
    return got, reason, r


def test_eos_stops_unless_ignored() -> None:
    got, reason, r = run_one({"ignore_eos": False, "max_tokens": 10}, [5, 6, EOS, 7, 8])
    assert (got, reason, r.stop_reason) == ([5, 6, EOS], "stop", None)
    assert r.status is RequestStatus.FINISHED_STOPPED
    got, reason, _ = run_one({"ignore_eos": True, "max_tokens": 5}, [5, EOS, EOS, 7, 8])
    assert (got, reason) == ([5, EOS, EOS, 7, 8], "length")


def test_stop_token_ids_set_stop_reason() -> None:
    got, reason, r = run_one({"stop_token_ids": [9, 8], "max_tokens": 10}, [5, 8, 7])
    assert (got, reason, r.stop_reason) == ([5, 8], "stop", 8)


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    params = {"ignore_eos": False, "stop_token_ids": [9], "min_tokens": 3, "max_tokens": 10}
    got, reason, _ = run_one(params, [EOS, 9, 5, 9, 6])
    assert (got, reason) == ([EOS, 9, 5, 9], "stop")
    got, reason, _ = run_one(params, [EOS, 9, EOS, 5])  # the 3rd token may stop
    assert (got, reason) == ([EOS, 9, EOS], "stop")


def test_max_tokens_and_max_model_len_give_length() -> None:
    got, reason, r = run_one({"max_tokens": 3}, [5, 6, 7, 8])
    assert (got, reason) == ([5, 6, 7], "length")
    assert r.status is RequestStatus.FINISHED_LENGTH
    got, reason, r = run_one({"max_tokens": 100}, list(range(20, 40)), make(max_model_len=10))
    assert (got, reason, r.num_tokens) == (list(range(20, 26)), "length", 10)


def test_finished_ids_reported_on_the_next_schedule() -> None:
    s = make()
    s.add_request(req("a", 4, max_tokens=1))
    s.add_request(req("b", 4, start=300, max_tokens=2))
    out, results = step(s)
    assert [(r.request_id, r.finish_reason) for r in results] == [("a", "length"), ("b", None)]
    out, _ = step(s)
    assert out.finished_ids == ["a"]
    assert s.schedule().finished_ids == ["b"]


# ----- admission checks -----


def test_prompt_at_or_over_max_model_len_is_rejected() -> None:
    s = make(max_model_len=16)
    with pytest.raises(ValueError, match="context"):
        s.add_request(req("a", 16))
    with pytest.raises(ValueError, match="context"):
        s.reserve(req("b", 30))
    s.add_request(req("c", 15, max_tokens=5))
    assert "a" not in s.requests and "b" not in s.requests
    tokens, reasons, _ = run_all(s)
    assert (tokens["c"].__len__(), reasons["c"]) == (1, "length")


def test_duplicate_request_id_is_rejected() -> None:
    s = make()
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 6))
    step(s)
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 6))
    assert s.num_running + s.num_waiting == 1


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        Request("a", [], SamplingParams())


# ----- determinism -----


def _workload() -> list[tuple]:
    s = make(num_blocks=14, max_num_seqs=4, max_batched=12)
    for i in range(7):
        s.add_request(req(f"r{i}", 2 + (7 * i) % 19, start=50 * (i % 3), max_tokens=3 + i % 5))
    trace = []
    for _ in range(300):
        if not s.has_unfinished:
            break
        out, results = step(s)
        trace.append(
            (
                [
                    (
                        i.request_id,
                        list(i.token_ids),
                        i.start_position,
                        list(i.block_ids),
                        i.needs_sample,
                    )
                    for i in out.scheduled
                ],
                list(out.preempted_ids),
                list(out.finished_ids),
                [(r.request_id, r.new_token_ids, r.finish_reason) for r in results],
            )
        )
    assert not s.has_unfinished
    return trace


def test_same_inputs_give_the_same_schedule() -> None:
    a, b = _workload(), _workload()
    assert len(a) > 5
    assert a == b
