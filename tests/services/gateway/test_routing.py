"""The routing policies (pure): prompt block hashes as the engine names them, the cache-aware
prefill choice, conditional disaggregation and its auto threshold, decode balance by KV tokens, and
the admission's per-rank choice with queued work."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_gateway.admission import PrefillAdmission
from pdmesh_gateway.router import Router
from pdmesh_gateway.routing import (
    DecodeBalance,
    HandoffModel,
    LocalPrefill,
    PrefillCandidate,
    cached_tokens,
    choose_prefill,
    local_threshold,
    prefills_locally,
    prompt_block_hashes,
)
from pdmesh_service.instance import InstanceInfo, Load, Role


def test_prompt_hashes_are_the_engine_prefix_cache_keys() -> None:
    """The hashes the gateway asks the index for are those an engine stores when it computes the
    prompt (its KV events), and a later prompt with that prefix hits exactly that many blocks."""
    cache = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True)
    prompt = list(range(100, 123))  # 23 tokens: 5 full blocks
    assert cache.find_cached_prefix("a", prompt) == []
    cache.allocate("a", len(prompt))
    cache.cache_blocks("a", prompt, len(prompt))
    cache.free("a")
    stored = cache.take_events().stored
    assert prompt_block_hashes(prompt, 4) == stored[:5]
    longer = prompt + [7, 8, 9]
    hits = cache.find_cached_prefix("b", longer)
    assert len(hits) == 5
    assert prompt_block_hashes(longer, 4)[:5] == cache.req_hashes["b"]
    assert len(prompt_block_hashes(prompt[:21], 4)) == 5  # (21 - 1) // 4: the last token's block
    assert len(prompt_block_hashes(prompt[:20], 4)) == 4  # ... is never a cache key


def test_prompt_hashes_chain_on_the_whole_prefix() -> None:
    a = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prompt_block_hashes([1, 2, 3, 4, 0, 6, 7, 8, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]


def test_cached_tokens_leave_the_last_token_to_compute() -> None:
    assert cached_tokens(3, 16, 100) == 48
    assert cached_tokens(7, 16, 100) == 99
    assert cached_tokens(0, 16, 100) == 0


def test_the_rank_holding_the_prefix_wins_when_its_queue_is_short() -> None:
    ranks = [PrefillCandidate("p0", 0), PrefillCandidate("p1", cached_tokens=900)]
    assert choose_prefill(1000, ranks).instance_id == "p1"


def test_a_loaded_rank_with_a_hit_loses_to_an_idle_rank() -> None:
    """p1 holds 900 of 1000 tokens but has 1500 tokens queued: p0 computes 1000 at once."""
    ranks = [
        PrefillCandidate("p0", 0),
        PrefillCandidate("p1", cached_tokens=900, queued_tokens=1500, in_flight=2),
    ]
    assert choose_prefill(1000, ranks).instance_id == "p0"
    ranks[1] = PrefillCandidate("p1", cached_tokens=900, queued_tokens=800, in_flight=2)
    assert choose_prefill(1000, ranks).instance_id == "p1"  # 100 + 800 < 1000


def test_ties_go_to_fewer_in_flight_then_round_robin() -> None:
    ranks = [PrefillCandidate("p0", in_flight=1), PrefillCandidate("p1"), PrefillCandidate("p2")]
    assert choose_prefill(10, ranks).instance_id == "p1"
    assert choose_prefill(10, ranks, last="p1").instance_id == "p2"
    assert choose_prefill(10, ranks, last="p2").instance_id == "p1"
    with pytest.raises(ValueError):
        choose_prefill(10, [])


def test_local_prefill_setting_parses() -> None:
    assert LocalPrefill.parse("off") == LocalPrefill() == LocalPrefill.parse("0")
    assert LocalPrefill.parse("AUTO").mode == "auto"
    assert LocalPrefill.parse("256") == LocalPrefill("fixed", 256)
    for bad in ("-1", "many", ""):
        with pytest.raises(ValueError, match="local-prefill-tokens"):
            LocalPrefill.parse(bad)


def test_local_prefill_only_within_the_threshold() -> None:
    assert prefills_locally(64, 64) and not prefills_locally(65, 64)
    assert not prefills_locally(1, 0)  # off


def test_auto_threshold_follows_the_measured_handoffs() -> None:
    model = HandoffModel(overhead_s=0.02, tokens_per_s=1000.0, alpha=0.5)
    assert model.threshold_tokens == 20
    # hand-offs that cost 100 ms besides prefill; prefill at 4000 tokens/s
    for _ in range(20):
        model.observe(4000, reserve_s=0.03, prefill_s=1.05, transfer_s=0.05, decode_s=0.02)
    assert model.overhead_s == pytest.approx(0.1, rel=1e-3)
    assert model.tokens_per_s == pytest.approx(4000.0, rel=1e-3)
    assert local_threshold(LocalPrefill("auto"), model) == pytest.approx(400, abs=1)
    assert local_threshold(LocalPrefill("fixed", 50), model) == 50
    assert local_threshold(LocalPrefill(), model) == 0
    model.observe(8, reserve_s=0.0, prefill_s=1.0, transfer_s=0.0, decode_s=0.0)
    assert model.tokens_per_s == pytest.approx(4000.0, rel=1e-3)  # too short to time speed


def _decode(name: str, blocks: int, running: int) -> InstanceInfo:
    load = Load(num_running=running, num_kv_blocks_used=blocks)
    return InstanceInfo(name, Role.DECODE, "127.0.0.1:1", ready=True, stats=load, block_size=16)


def test_decode_balance_by_kv_tokens_counts_prompts_sent_since_the_heartbeat() -> None:
    ranks = [_decode("d0", blocks=100, running=1), _decode("d1", blocks=10, running=5)]
    by_requests, by_kv = Router(), Router(decode_balance=DecodeBalance.KV_TOKENS)
    for router in (by_requests, by_kv):
        router.update(ranks)
    assert by_requests.pick_decode().instance_id == "d0"
    assert by_kv.pick_decode().instance_id == "d1"
    by_kv.note_sent("d1", tokens=2000)  # 160 + 2000 tokens > 1600
    assert by_kv.pick_decode().instance_id == "d0"


def test_admission_waits_for_the_chosen_rank_and_counts_its_queued_tokens() -> None:
    async def scenario() -> None:
        gate = PrefillAdmission(limit=1)
        ranks = lambda: ["p0", "p1"]  # noqa: E731
        held = await gate.acquire(ranks, lambda rs: ("p0", 300))
        assert held == "p0" and gate.queued_tokens("p0") == 300
        # a request whose prefix is on the busy p0 waits for it though p1 is free
        sticky = asyncio.ensure_future(gate.acquire(ranks, lambda rs: ("p0", 40)))
        other = asyncio.ensure_future(gate.acquire(ranks))  # no preference: takes free p1
        assert await other == "p1"
        await asyncio.sleep(0.05)
        assert not sticky.done() and gate.queued_tokens("p0") == 340
        gate.release("p0", 300)
        assert await sticky == "p0" and gate.queued_tokens("p0") == 40
        gate.release("p0", 40)
        gate.release("p1")
        assert gate.queued_tokens("p0") == 0 and gate.in_flight("p0") == 0

    asyncio.run(scenario())


def test_a_waiter_chooses_again_when_its_rank_goes_away() -> None:
    async def scenario() -> None:
        gate = PrefillAdmission(limit=1)
        up = ["p0", "p1"]
        assert await gate.acquire(lambda: list(up), lambda rs: ("p0", 10)) == "p0"
        assert await gate.acquire(lambda: list(up), lambda rs: ("p1", 10)) == "p1"
        waiter = asyncio.ensure_future(gate.acquire(lambda: list(up), lambda rs: (rs[0], 99)))
        await asyncio.sleep(0.03)
        assert gate.queued_tokens("p0") == 109  # chose p0 (first of the usable ranks)
        up.remove("p0")  # p0 left (the router's membership event); p1 frees up
        gate.refresh(num_ranks=1)
        gate.release("p1", 10)
        assert await waiter == "p1"
        assert gate.queued_tokens("p0") == 10 and gate.queued_tokens("p1") == 99

    asyncio.run(scenario())


def test_a_cancelled_chooser_gives_its_queued_tokens_back() -> None:
    async def scenario() -> None:
        gate = PrefillAdmission(limit=1)
        await gate.acquire(lambda: ["p0"], lambda rs: ("p0", 5))
        waiter = asyncio.ensure_future(gate.acquire(lambda: ["p0"], lambda rs: ("p0", 50)))
        await asyncio.sleep(0.03)
        assert gate.queued_tokens("p0") == 55
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.queued_tokens("p0") == 5 and gate.waiting == 0

    asyncio.run(scenario())
