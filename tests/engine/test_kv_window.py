"""`WindowedKVManager`: the window pool holds only what a step reads, releases the rest into the
prefix cache, and a prefix hit is only as long as the window blocks it needs are cached."""

from __future__ import annotations

import pytest

from pdmesh_engine.kv_window import NULL_BLOCK, WindowedKVManager

B, SPAN = 4, 5  # a step reads 5 positions back: at most 3 window blocks with its own


def _decode(kv: WindowedKVManager, rid: str, tokens: list[int], upto: int, start: int) -> None:
    """Step one token at a time from `start` to `upto` (as the scheduler would)."""
    for end in range(start + 1, upto + 1):
        assert kv.allocate(rid, end) is not None
        kv.cache_blocks(rid, tokens, end)
        kv.check_integrity()
        live = [b for b in kv.window_table(rid) if b != NULL_BLOCK]
        first = max(0, end - 1 - SPAN) // B
        assert len(live) == -(-end // B) - first, (end, kv.window_table(rid))


def test_window_blocks_behind_the_span_are_released_into_the_cache() -> None:
    kv = WindowedKVManager(num_full_blocks=16, num_window_blocks=8, block_size=B, span=SPAN)
    tokens = list(range(100, 140))
    assert kv.allocate("a", 7) is not None  # a prefill chunk of 7
    kv.cache_blocks("a", tokens, 7)
    _decode(kv, "a", tokens, 30, 7)
    table = kv.window_table("a")
    assert table[0] == NULL_BLOCK and table[-1] != NULL_BLOCK
    assert len(kv.blocks_of("a")) == 30 // B + 1  # the full pool keeps every block
    free, cached, used = kv.window_counts()
    assert used <= 1 + 3 and cached > 0  # NULL + the live window; full blocks left cached
    kv.free("a")
    kv.check_integrity()
    assert kv.window_counts()[2] == 1  # only NULL
    stats = kv.stats()
    assert stats.window_blocks == (8, *kv.window_counts()) and stats.num_used == 0


def test_a_hit_needs_the_window_blocks_before_its_boundary() -> None:
    """Released window blocks leave the cache oldest first, so a hit at the end of a prompt
    outlives the window blocks of its beginning; once those it needs are gone, there is no hit."""
    kv = WindowedKVManager(num_full_blocks=64, num_window_blocks=10, block_size=B, span=SPAN)
    tokens = list(range(200, 226))
    assert kv.allocate("a", 12) is not None
    kv.cache_blocks("a", tokens, 12)
    _decode(kv, "a", tokens, 24, 12)
    kv.free("a")  # logical window blocks 0..5 are cached, 0 oldest
    other = list(range(300, 400))
    assert kv.allocate("c", 20) is not None  # 5 blocks: the 3 free ones, then evicts 0 and 1
    kv.free("c")
    hits = kv.find_cached_prefix("b", tokens)
    assert len(hits) == 6  # 24 tokens: it needs window blocks 4 and 5 only
    assert kv.allocate("b", 26, hits) is not None
    kv.check_integrity()
    table = kv.window_table("b")
    assert table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in table[4:]
    kv.free("b")
    assert kv.allocate("e", 36) is not None  # all 9 usable window blocks: every one evicted
    kv.cache_blocks("e", other, 36)
    kv.free("e")
    assert len(kv.full.find_cached_prefix("probe", tokens)) == 6  # the full chain is cached,
    assert kv.find_cached_prefix("d", tokens) == []  # its window blocks are not


def test_allocate_is_all_or_none_over_both_pools() -> None:
    kv = WindowedKVManager(num_full_blocks=64, num_window_blocks=4, block_size=B, span=SPAN)
    assert kv.allocate("a", 12) is not None  # 3 window blocks: the pool (NULL + 3) is full
    before = kv.stats()
    assert kv.allocate("b", 4) is None
    assert kv.stats() == before and "b" not in kv.req_blocks
    kv.check_integrity()
    with pytest.raises(ValueError, match="window pool needs"):
        WindowedKVManager(8, 1, B, SPAN)
