"""Block pool and KV cache manager: counts, prefix sharing, LRU eviction, integrity, block
hashes."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pdmesh_engine.block_hash import hash_block, hash_full_blocks
from pdmesh_engine.kv_cache import BlockPool, KVCacheManager

BS = 4  # block size used throughout


def toks(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit a request as the scheduler does (prefix lookup + allocation), compute it fully, cache
    its blocks."""
    prefix = kv.find_cached_prefix(rid, tokens)
    blocks = kv.allocate(rid, len(tokens), prefix)
    assert blocks is not None
    kv.cache_blocks(rid, tokens, len(tokens))
    kv.check_integrity()
    return list(blocks)


def snapshot(kv: KVCacheManager) -> tuple:
    p = kv.pool
    return (
        list(p.ref_counts),
        list(p.block_hashes),
        dict(p.cached),
        list(p.evictable),
        {k: list(v) for k, v in kv.req_blocks.items()},
        kv.prefix_hits,
        kv.stats(),
    )


# ----- counts -----


def test_allocate_and_free_counts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    assert kv.stats().num_free == 10 and kv.stats().num_used == 0
    a = list(kv.allocate("a", 9))  # ceil(9 / 4) = 3 blocks
    assert len(a) == 3 and len(set(a)) == 3
    b = kv.allocate("b", 4)
    assert b is not None and len(b) == 1 and not set(a) & set(b)
    assert kv.stats().num_used == 4 and kv.stats().num_free == 6
    kv.check_integrity()
    # growing a request only adds the missing blocks and keeps the old ones in order
    grown = kv.allocate("a", 13)
    assert grown is not None and grown[:3] == a and len(grown) == 4
    assert kv.allocate("a", 10) == grown  # already enough: nothing new
    assert kv.stats().num_used == 5
    kv.free("a")
    kv.free("b")
    s = kv.stats()
    assert (s.num_used, s.num_free + s.num_cached) == (0, 10)
    kv.check_integrity()
    kv.free("never-seen")  # unknown request: a no-op
    kv.check_integrity()


def test_allocation_failure_returns_none_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, "a", toks(8))  # 2 blocks, both hashed
    kv.free("a")  # cached, evictable
    admit(kv, "b", toks(4, start=500))  # takes 1 free block
    before = snapshot(kv)
    assert kv.allocate("c", 4 * BS) is None  # 4 blocks wanted, 3 available
    assert kv.allocate("b", 5 * BS) is None  # growing past the pool fails too
    assert snapshot(kv) == before
    assert "c" not in kv.req_blocks
    kv.check_integrity()


def test_allocation_with_cached_prefix_counts_evictable_prefix_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = toks(12)
    admit(kv, "a", tokens)  # 3 blocks, all full and hashed
    kv.free("a")
    longer = tokens + toks(9, start=900)  # 21 tokens: 6 blocks, 3 from the cache
    prefix = kv.find_cached_prefix("b", longer)
    assert len(prefix) == 3
    before = snapshot(kv)
    # the 3 prefix blocks are themselves in the evictable queue: only 1 other block is left
    assert kv.allocate("b", len(longer), prefix) is None
    assert snapshot(kv) == before
    blocks = kv.allocate("b", 4 * BS, prefix)  # 3 cached + 1 new fits exactly
    assert blocks is not None and blocks[:3] == prefix and len(blocks) == 4
    assert kv.stats().num_used == 4 and kv.pool.num_available == 0
    kv.check_integrity()


def test_release_more_often_than_taken_raises() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([b])
    with pytest.raises(MemoryError):
        pool.allocate(3)
    with pytest.raises(ValueError):
        BlockPool(0)


# ----- prefix sharing -----


def test_same_full_prefix_blocks_are_shared_and_partial_last_block_is_not() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    common = toks(2 * BS)
    a = admit(kv, "a", common + [1, 2])  # 10 tokens: 2 full blocks + a partial one
    assert len(kv.pool.cached) == 2  # the partial block carries no hash
    b_tokens = common + [1, 2]  # identical prompt
    prefix = kv.find_cached_prefix("b", b_tokens)
    assert prefix == a[:2]
    b = kv.allocate("b", len(b_tokens), prefix)
    assert b is not None and b[:2] == a[:2] and b[2] != a[2]
    assert [kv.pool.ref_counts[x] for x in a] == [2, 2, 1]
    assert kv.pool.ref_counts[b[2]] == 1
    assert kv.prefix_hits == 2 * BS
    kv.check_integrity()
    # a third request sharing only the first block
    c_tokens = common[:BS] + [7] * 6
    prefix_c = kv.find_cached_prefix("c", c_tokens)
    assert prefix_c == a[:1]
    assert kv.allocate("c", len(c_tokens), prefix_c) is not None
    assert kv.pool.ref_counts[a[0]] == 3 and kv.pool.ref_counts[a[1]] == 2
    kv.check_integrity()
    for rid in ("a", "b", "c"):
        kv.free(rid)
    assert kv.stats().num_used == 0
    kv.check_integrity()


def test_find_cached_prefix_always_leaves_a_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = toks(3 * BS)  # exactly 3 full blocks
    a = admit(kv, "a", tokens)
    assert len(kv.pool.cached) == 3
    prefix = kv.find_cached_prefix("b", tokens)
    assert prefix == a[:2]  # not all 3: the last token must be computed
    assert len(tokens) - len(prefix) * BS >= 1
    assert kv.find_cached_prefix("c", tokens[:1]) == []
    assert kv.find_cached_prefix("d", tokens + [5]) == a  # one more token: all 3 blocks hit


def test_cached_prefix_survives_free_and_is_reused() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = toks(3 * BS + 1)
    a = admit(kv, "a", tokens)
    kv.free("a")
    s = kv.stats()
    assert (s.num_used, s.num_cached) == (0, 3)
    prefix = kv.find_cached_prefix("b", tokens)
    assert prefix == a[:3]
    assert kv.allocate("b", len(tokens), prefix)[:3] == a[:3]
    assert kv.stats().num_cached == 0 and kv.stats().num_used == 4
    kv.check_integrity()


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    tokens = toks(3 * BS + 1)
    admit(kv, "a", tokens)
    assert kv.pool.cached == {} and all(h is None for h in kv.pool.block_hashes)
    assert kv.find_cached_prefix("b", tokens) == []
    kv.free("a")
    assert kv.stats().num_cached == 0 and kv.stats().num_free == 8


def test_duplicate_content_keeps_the_first_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = toks(2 * BS + 1)
    # both admitted before either computed anything: no prefix hit, separate blocks
    pa, pb = kv.find_cached_prefix("a", tokens), kv.find_cached_prefix("b", tokens)
    assert pa == pb == []
    a, b = list(kv.allocate("a", len(tokens))), list(kv.allocate("b", len(tokens)))
    kv.cache_blocks("a", tokens, len(tokens))
    kv.cache_blocks("b", tokens, len(tokens))
    assert len(kv.pool.cached) == 2
    assert sorted(kv.pool.cached.values()) == sorted(a[:2])
    assert all(kv.pool.block_hashes[x] is None for x in b)
    kv.check_integrity()
    assert kv.find_cached_prefix("c", tokens) == a[:2]


def test_cache_blocks_registers_blocks_as_they_fill() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = toks(3 * BS)
    blocks = kv.allocate("a", len(tokens))
    kv.cache_blocks("a", tokens, BS - 1)
    assert kv.pool.cached == {}
    kv.cache_blocks("a", tokens, BS + 2)  # first block full
    assert kv.pool.cached == {hash_full_blocks(tokens[:BS], BS)[0]: blocks[0]}
    kv.cache_blocks("a", tokens, 3 * BS)
    expected = hash_full_blocks(tokens, BS)
    assert [kv.pool.block_hashes[b] for b in blocks] == expected
    kv.check_integrity()


# ----- LRU eviction -----


def test_eviction_is_least_recently_freed_first_and_tail_before_head() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a_tokens, b_tokens = toks(3 * BS), toks(3 * BS, start=500)
    a = admit(kv, "a", a_tokens)
    b = admit(kv, "b", b_tokens)
    kv.free("a")  # a freed before b
    kv.free("b")
    assert kv.stats().num_cached == 6
    assert list(kv.pool.evictable) == a[::-1] + b[::-1]
    # allocate one block at a time and watch which cached block goes
    evicted = []
    for i in range(6):
        evicted.extend(kv.allocate(f"x{i}", 1))
    assert evicted == a[::-1] + b[::-1]


def test_eviction_drops_the_hash_and_keeps_the_head_findable() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = toks(3 * BS + 1)  # 3 full blocks + 1 partial
    a = admit(kv, "a", tokens)
    kv.free("a")
    tail_hash = kv.pool.block_hashes[a[2]]
    assert tail_hash is not None
    # the partial block (freed first, no hash) goes first, then the last full block
    assert kv.allocate("x", 2 * BS) == [a[3], a[2]]
    assert tail_hash not in kv.pool.cached and kv.pool.block_hashes[a[2]] is None
    kv.check_integrity()
    assert kv.find_cached_prefix("b", tokens) == a[:2]
    # a block touched again (prefix hit) leaves the queue and is not evicted
    prefix = kv.find_cached_prefix("b", tokens)
    kv.allocate("b", 2 * BS, prefix)
    assert kv.pool.num_available == 0
    assert kv.allocate("y", 1) is None
    kv.check_integrity()


def test_refreed_blocks_move_to_the_back_of_the_queue() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = admit(kv, "a", toks(BS + 1))  # block 0 hashed
    kv.free("a")
    b = admit(kv, "b", toks(BS, start=700))
    kv.free("b")
    # reuse a's cached block: it leaves the queue, comes back after b's
    prefix = kv.find_cached_prefix("c", toks(BS + 1))
    assert prefix == a[:1]
    kv.allocate("c", BS + 1, prefix)
    kv.free("c")
    assert list(kv.pool.evictable)[-1] == a[0]
    assert list(kv.pool.evictable).index(b[0]) < list(kv.pool.evictable).index(a[0])


# ----- the integrity checker itself -----


def busy_manager() -> KVCacheManager:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, "a", toks(2 * BS + 1))
    admit(kv, "b", toks(2 * BS + 1))  # shares 2 blocks with a
    admit(kv, "c", toks(BS + 1, start=300))
    kv.free("c")  # leaves a cached block
    kv.check_integrity()
    return kv


def test_integrity_passes_in_normal_states() -> None:
    kv = busy_manager()
    s = kv.stats()
    assert s.num_used > 0 and s.num_cached > 0 and s.num_free > 0
    assert s.num_used + s.num_cached + s.num_free == s.num_blocks


def test_integrity_detects_wrong_ref_count() -> None:
    kv = busy_manager()
    kv.pool.ref_counts[kv.blocks_of("a")[0]] += 1
    with pytest.raises(AssertionError, match="ref counts"):
        kv.check_integrity()


def test_integrity_detects_block_held_without_reference() -> None:
    kv = busy_manager()
    stolen = next(iter(kv.pool.evictable))
    kv.req_blocks["a"].append(stolen)  # held by a request but ref 0 and evictable
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_integrity_detects_block_in_use_and_evictable() -> None:
    kv = busy_manager()
    kv.pool.evictable[kv.blocks_of("a")[2]] = None
    with pytest.raises(AssertionError, match="evictable"):
        kv.check_integrity()


def test_integrity_detects_unreferenced_block_missing_from_queue() -> None:
    kv = busy_manager()
    kv.pool.evictable.popitem(last=False)  # leaked: ref 0 but not allocatable
    with pytest.raises(AssertionError, match="evictable"):
        kv.check_integrity()


def test_integrity_detects_stale_index_entry() -> None:
    kv = busy_manager()
    block_hash, block = next(iter(kv.pool.cached.items()))
    kv.pool.block_hashes[block] = b"\x00" * 16  # the block was overwritten, the index not updated
    with pytest.raises(AssertionError, match="prefix index"):
        kv.check_integrity()


def test_integrity_detects_hash_unknown_to_the_index() -> None:
    kv = busy_manager()
    free_block = next(b for b in kv.pool.evictable if kv.pool.block_hashes[b] is None)
    kv.pool.block_hashes[free_block] = b"\x01" * 16
    with pytest.raises(AssertionError, match="index does not know"):
        kv.check_integrity()


def test_integrity_detects_request_holding_blocks_after_free() -> None:
    kv = busy_manager()
    blocks = kv.blocks_of("a")
    kv.pool.release(list(blocks))  # released behind the manager's back
    with pytest.raises(AssertionError, match="ref counts"):
        kv.check_integrity()


# ----- block hashes -----


def test_hash_chaining_depends_on_the_prefix() -> None:
    block = [5, 6, 7, 8]
    h1 = hash_full_blocks([1, 2, 3, 4] + block, BS)
    h2 = hash_full_blocks([9, 9, 9, 9] + block, BS)
    assert h1[0] != h2[0] and h1[1] != h2[1]
    assert hash_block(None, block) != h1[1]
    assert h1[1] == hash_block(h1[0], block)
    # same block tokens in a different prefix are not a prefix hit
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, "a", [1, 2, 3, 4] + block + [0])
    assert kv.find_cached_prefix("b", [9, 9, 9, 9] + block + [0]) == []


def test_hash_full_blocks_incremental_equals_full() -> None:
    tokens = toks(5 * BS + 3)
    full = hash_full_blocks(tokens, BS)
    assert len(full) == 5  # the partial tail is not hashed
    rest = hash_full_blocks(tokens, BS, start_block=2, parent=full[1])
    assert full[2:] == rest
    assert hash_full_blocks(tokens[: BS - 1], BS) == []


def test_block_hashes_are_stable() -> None:
    ids = [1, 2, 3, 4]
    a = hash_block(None, ids)
    assert a == hash_block(None, list(ids)) == hash_block(None, tuple(ids))
    assert isinstance(a, bytes) and len(a) == 16
    assert hash_full_blocks(toks(8), BS) == hash_full_blocks(toks(8), BS)
    assert hash_block(None, [1, 2, 3, 5]) != a
    assert hash_block(None, [4, 3, 2, 1]) != a
    # pinned values: the gateway and other processes must compute the same keys
    assert a.hex() == GOLDEN_FIRST
    assert hash_block(a, [5, 6, 7, 8]).hex() == GOLDEN_SECOND
    assert hash_block(None, [2**40, 0, 1, 50000]).hex() == GOLDEN_LARGE

    # the format: blake2b-128 over the parent digest followed by the ids as little-endian int64
    assert a == hashlib.blake2b(struct.pack("<4q", *ids), digest_size=16).digest()
    assert (
        hash_block(a, [5, 6, 7, 8])
        == hashlib.blake2b(a + struct.pack("<4q", 5, 6, 7, 8), digest_size=16).digest()
    )


GOLDEN_FIRST = "087a24230771ee662be37e5493b333d7"
GOLDEN_SECOND = "8222aab65152a8711ac413a3333a672c"
GOLDEN_LARGE = "c3fe9fd22c2128769a917a43f4dae66c"
