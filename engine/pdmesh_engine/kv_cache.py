"""Paged KV cache: the block pool (memory and bookkeeping) and the per-request block manager.

Memory (allocated by the model family, `model.deepseek_v3.runtime.allocate_kv_memory` for V3; this
module is pure bookkeeping and imports no torch): one contiguous tensor `[num_layers, num_blocks,
block_size, L + R]` holding the MLA latent and rope key of every cached token; a block's bytes in
one layer are contiguous, so the pool can be registered once with NIXL and addressed per (layer,
block).

Bookkeeping invariants (checked by `check_integrity`):
- every block is in exactly one of: in use (ref_count > 0), cached (ref 0, has a hash, evictable),
  free (ref 0, no hash); free + cached + in use = total;
- the evictable queue holds exactly the blocks with ref 0, least recently freed first;
- a block's ref_count equals the number of requests that hold it.

Cache salts: a request's blocks are hashed under its `cache_salt` (`block_hash.salt_root`), so
requests with different salts never share a cached block (`find_cached_prefix`, `cache_blocks`).

KV events (with caching on): every hash the pool starts holding (`set_hash`) or stops holding (its
block evicted or reused) is recorded, and `KVCacheManager.take_events` drains them as a
`KVCacheEvents` batch (the net change since the last drain, for the kvstore's prefix index).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdmesh_engine.block_hash import BlockHash, hash_full_blocks


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    num_blocks: int
    num_free: int
    num_cached: int
    num_used: int
    prefix_queries: int
    prefix_hits: int  # tokens served from the prefix cache
    # a windowed family's second pool (pdmesh_engine.kv_window): its blocks, then (free, cached,
    # in use) as the counts above; None with one pool
    window_blocks: tuple[int, int, int, int] | None = None


MAX_PENDING_EVENTS = 1 << 16  # hashes changed since the last drain; beyond this the batch is lost


@dataclass(frozen=True, slots=True)
class KVCacheEvents:
    """The net change of the pool's hashes since the previous drain.

    `stored` and `removed` are disjoint (a hash stored then evicted within one batch is in
    `removed`, evicted then stored again in `stored`), so a subscriber may apply them in any order.
    `is_lost`: more than `MAX_PENDING_EVENTS` hashes changed and the batch was dropped; the
    subscriber must be sent a snapshot (`BlockPool.cached_hashes`) instead.
    """

    stored: list[BlockHash]
    removed: list[BlockHash]
    is_lost: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.stored and not self.removed and not self.is_lost


class BlockPool:
    """Block ids with reference counts and prefix hashes; allocation evicts the LRU cached block."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        max_pending_events: int = MAX_PENDING_EVENTS,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.enable_caching = num_blocks, enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # hash -> held now (True: stored, False: removed), since the last `take_events`
        self.pending_events: dict[BlockHash, bool] = {}
        self.max_pending_events, self.events_lost = max_pending_events, False

    @property
    def num_available(self) -> int:
        return len(self.evictable)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.evictable):
            raise MemoryError(f"need {count} KV blocks, {len(self.evictable)} available")
        blocks = []
        for _ in range(count):
            block, _ = self.evictable.popitem(last=False)
            self._drop_hash(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (prefix hits)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference each; blocks reaching 0 become evictable (first given, first
        evicted)."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"KV block {block} released more often than taken")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.evictable[block] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def set_hash(self, block: int, block_hash: BlockHash) -> None:
        if not self.enable_caching or self.block_hashes[block] is not None:
            return
        if block_hash in self.cached:  # same content computed twice: keep the first copy
            return
        self.block_hashes[block] = block_hash
        self.cached[block_hash] = block
        self._record(block_hash, True)

    def _drop_hash(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block] = None
            self._record(block_hash, False)

    def _record(self, block_hash: BlockHash, is_stored: bool) -> None:
        if self.events_lost:
            return
        self.pending_events[block_hash] = is_stored
        if len(self.pending_events) > self.max_pending_events:
            self.pending_events.clear()
            self.events_lost = True

    def take_events(self) -> KVCacheEvents:
        """Drain the hashes stored and removed since the last call (see `KVCacheEvents`)."""
        pending, lost = self.pending_events, self.events_lost
        self.pending_events, self.events_lost = {}, False
        return KVCacheEvents(
            [h for h, is_stored in pending.items() if is_stored],
            [h for h, is_stored in pending.items() if not is_stored],
            lost,
        )

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the pool holds now (in use or evictable): a snapshot for the prefix index."""
        return list(self.cached)

    def check_integrity(self, holders: list[list[int]]) -> None:
        """Raise AssertionError naming the first broken invariant; `holders` are the requests'
        blocks."""
        expected = [0] * self.num_blocks
        for blocks in holders:
            for block in blocks:
                expected[block] += 1
        if expected != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if expected[b] != self.ref_counts[b]][:5]
            raise AssertionError(f"KV ref counts disagree with holders at blocks {bad}")
        zero = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        if set(self.evictable) != zero or len(self.evictable) != len(zero):
            raise AssertionError("evictable queue does not hold exactly the unreferenced blocks")
        for block_hash, block in self.cached.items():
            if self.block_hashes[block] != block_hash:
                raise AssertionError(f"prefix index points at block {block} with another hash")
        if sum(h is not None for h in self.block_hashes) != len(self.cached):
            raise AssertionError("blocks carry hashes that the prefix index does not know")
        stats = self.counts()
        if stats[0] + stats[1] + stats[2] != self.num_blocks:
            raise AssertionError("free + cached + in use != total")

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, in use)."""
        used = sum(1 for r in self.ref_counts if r > 0)
        cached = sum(1 for b in self.evictable if self.block_hashes[b] is not None)
        return len(self.evictable) - cached, cached, used


class KVCacheManager:
    """Blocks of each request; prefix reuse at admission, hashes registered as blocks fill.

    `recompute_last_hit`: a prefix hit gives up its last block, which the request computes again.
    For KV whose entry at position t also depends on token t + 1 (an MTP layer's cache: its input
    at t is the embedding of token t + 1), the entry at a cached block's last position belongs to
    whatever token followed the block in the request that computed it, which the block's hash
    does not cover; recomputing the last block rewrites that entry, and every earlier block's
    last entry depends only on tokens its successor's hash covers.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        recompute_last_hit: bool = False,
    ) -> None:
        self.block_size = block_size
        self.recompute_last_hit = recompute_last_hit
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    def find_cached_prefix(
        self, request_id: str, token_ids: list[int], cache_salt: str | None = None
    ) -> list[int]:
        """Cached blocks matching the longest prefix under `cache_salt` (blocks cached with
        another salt never match: `block_hash`); always leaves >= 1 token to compute."""
        self.prefix_queries += 1
        if not self.pool.enable_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = hash_full_blocks(
            token_ids[: max_blocks * self.block_size], self.block_size, cache_salt=cache_salt
        )
        hits: list[int] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.recompute_last_hit and hits:
            hits.pop()
        self.req_hashes[request_id] = hashes[: len(hits)]
        return hits

    def allocate(
        self, request_id: str, num_tokens: int, cached_prefix: list[int] | None = None
    ) -> list[int] | None:
        """Ensure the request holds blocks for `num_tokens` tokens; None (and no change) if out of
        blocks."""
        held = self.req_blocks.get(request_id, [])
        prefix = cached_prefix or []
        needed = -(-num_tokens // self.block_size) - len(held) - len(prefix)
        evictable_prefix = sum(1 for b in prefix if self.pool.ref_counts[b] == 0)
        if needed > self.pool.num_available - evictable_prefix:
            return None
        if prefix:
            self.pool.touch(prefix)
            self.prefix_hits += len(prefix) * self.block_size
        new_blocks = self.pool.allocate(max(needed, 0))
        blocks = self.req_blocks.setdefault(request_id, [])
        blocks.extend(prefix)
        blocks.extend(new_blocks)
        return list(blocks)

    def cache_blocks(
        self,
        request_id: str,
        token_ids: list[int],
        num_computed: int,
        cache_salt: str | None = None,
    ) -> None:
        """Register the hashes of blocks that are full of computed tokens (chained from
        `cache_salt`'s root: the request's salt, the same in every call)."""
        if not self.pool.enable_caching:
            return
        hashes = self.req_hashes.setdefault(request_id, [])
        num_full = num_computed // self.block_size
        if num_full <= len(hashes):
            return
        parent = hashes[-1] if hashes else None
        new = hash_full_blocks(
            token_ids[: num_full * self.block_size],
            self.block_size,
            len(hashes),
            parent,
            cache_salt,
        )
        blocks = self.req_blocks[request_id]
        for index, block_hash in enumerate(new, start=len(hashes)):
            self.pool.set_hash(blocks[index], block_hash)
        hashes.extend(new)

    def free(self, request_id: str) -> None:
        """Return all blocks of a request; the tail goes first in the eviction order."""
        blocks = self.req_blocks.pop(request_id, [])
        self.req_hashes.pop(request_id, None)
        self.pool.release(list(reversed(blocks)))

    def take_events(self) -> KVCacheEvents:
        """The pool's hash changes since the last call (`BlockPool.take_events`); always empty with
        caching off."""
        return self.pool.take_events()

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for a prompt whose KV another rank computes (None and no change if short)."""
        return self.allocate(request_id, num_tokens)

    def block_tables(self, request_id: str) -> dict[str, list[int]]:
        """The request's block tables by name (by logical block index): one, `kv`."""
        return {"kv": self.blocks_of(request_id)}

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the pool holds now: a snapshot for the prefix index."""
        return self.pool.cached_hashes()

    def check_integrity(self) -> None:
        self.pool.check_integrity(list(self.req_blocks.values()))

    def stats(self) -> KVCacheStats:
        free, cached, used = self.pool.counts()
        return KVCacheStats(
            self.pool.num_blocks, free, cached, used, self.prefix_queries, self.prefix_hits
        )
