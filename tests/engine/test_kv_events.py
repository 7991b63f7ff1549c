"""KV events of the block pool: the net hash changes drained by `KVCacheManager.take_events`."""

from __future__ import annotations

from pdmesh_engine.block_hash import hash_full_blocks
from pdmesh_engine.kv_cache import BlockPool, KVCacheManager

BS = 4


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    prefix = kv.find_cached_prefix(rid, tokens)
    blocks = kv.allocate(rid, len(tokens), prefix)
    assert blocks is not None
    kv.cache_blocks(rid, tokens, len(tokens))
    return list(blocks)


def test_full_blocks_are_stored_in_prompt_order_and_drained_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = toks(3 * BS + 1)
    admit(kv, "a", tokens)
    events = kv.take_events()
    assert events.stored == hash_full_blocks(tokens, BS)
    assert events.removed == [] and not events.is_lost
    assert kv.take_events().is_empty


def test_eviction_is_a_removal_and_cached_hashes_follow_the_pool() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = toks(3 * BS + 1)
    admit(kv, "a", tokens)
    kv.free("a")
    kv.take_events()
    hashes = hash_full_blocks(tokens, BS)
    kv.allocate("x", 2 * BS)  # evicts the partial block, then the last full one
    events = kv.take_events()
    assert events.stored == [] and events.removed == [hashes[2]]
    assert sorted(kv.pool.cached_hashes()) == sorted(hashes[:2])


def test_a_batch_holds_the_net_change_per_hash() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    tokens = toks(2 * BS)
    first = hash_full_blocks(tokens, BS)
    admit(kv, "a", tokens)
    kv.free("a")
    kv.allocate("x", 3 * BS)  # both hashes evicted within the same batch that stored them
    events = kv.take_events()
    assert events.stored == [] and sorted(events.removed) == sorted(first)
    kv.free("x")
    admit(kv, "b", tokens)  # stored again: now held
    events = kv.take_events()
    assert events.stored == first and events.removed == []
    kv.free("b")
    kv.allocate("y", 3 * BS)  # removed, then stored again within one batch: held at the end
    kv.free("y")
    admit(kv, "c", tokens)
    events = kv.take_events()
    assert set(events.stored) == set(first) and events.removed == []
    assert set(events.stored) == set(kv.pool.cached_hashes())


def test_duplicate_content_is_stored_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = toks(2 * BS + 1)
    kv.find_cached_prefix("a", tokens), kv.find_cached_prefix("b", tokens)
    kv.allocate("a", len(tokens)), kv.allocate("b", len(tokens))
    kv.cache_blocks("a", tokens, len(tokens))
    kv.cache_blocks("b", tokens, len(tokens))
    assert kv.take_events().stored == hash_full_blocks(tokens, BS)


def test_no_events_without_caching() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    admit(kv, "a", toks(3 * BS))
    kv.free("a")
    kv.allocate("x", 8 * BS)
    assert kv.take_events().is_empty and kv.pool.cached_hashes() == []


def test_too_many_pending_changes_lose_the_batch_until_drained() -> None:
    pool = BlockPool(8, max_pending_events=3)
    blocks = pool.allocate(5)
    for i, block in enumerate(blocks):
        pool.set_hash(block, bytes([i]) * 16)
    events = pool.take_events()
    assert events.is_lost and events.stored == [] and not events.is_empty
    assert len(pool.cached_hashes()) == 5  # the snapshot to send instead
    pool.release(blocks)
    pool.allocate(4)  # 3 free blocks, then one cached: its hash removed, recorded again
    events = pool.take_events()
    assert not events.is_lost and len(events.removed) == 1
