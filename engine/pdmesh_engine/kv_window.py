"""Two block pools behind one `KVCacheManager` interface: a model whose per-token state is read
only within a window (DeepSeek-V4: the sliding window's K=V and the compressors' rows) keeps it in
a `window` pool, beside the `full` pool of what the whole context keeps (V4: compressed entries).

Both pools hold blocks of the same `block_size` and are addressed by logical block index (block i
holds positions [i * B, (i + 1) * B)). A request holds every full block, and window blocks only
from the one holding position `start - span` on, where `start` is the first position the step
computes and `span` how far back a step reads (`V4Config.window_span`). A window block that falls
behind is released: into the prefix cache when it is full and hashed, else to the free list. Its
table entry becomes `NULL_BLOCK`, which is never handed out (gathers below the window may read it
and mask it).

Prefix hits (same chained block hashes in both pools, so the kvstore index keeps working on the
full chain): a hit of k full blocks also needs the window blocks covering positions
[k * B - span, k * B) in the window pool's cache; the hit is shortened until they are there.
`allocate` is all or none over both pools. Pure bookkeeping: no torch.
"""

from __future__ import annotations

from dataclasses import replace

from pdmesh_engine.block_hash import BlockHash
from pdmesh_engine.kv_cache import BlockPool, KVCacheEvents, KVCacheManager, KVCacheStats

NULL_BLOCK = 0  # the window pool's block 0: below-window table entries point at it


class WindowedKVManager:
    def __init__(
        self,
        num_full_blocks: int,
        num_window_blocks: int,
        block_size: int,
        span: int,
        enable_caching: bool = True,
        recompute_last_hit: bool = False,
    ) -> None:
        """`recompute_last_hit`: as `KVCacheManager`'s (a prefix hit gives up its last block; the
        window blocks it needs are those of the shortened hit)."""
        if num_window_blocks < 2:
            raise ValueError(f"the window pool needs >= 2 blocks, got {num_window_blocks}")
        self.full = KVCacheManager(num_full_blocks, block_size, enable_caching, recompute_last_hit)
        self.window = BlockPool(num_window_blocks, enable_caching)
        self.window.allocate(1)  # NULL_BLOCK, held for good
        self.block_size, self.span = block_size, span
        self.tables: dict[str, list[int]] = {}  # request -> window block per logical index
        self.next_start: dict[str, int] = {}  # request -> where its next step starts
        self._window_hits: dict[str, list[tuple[int, int]]] = {}  # request -> (index, block)

    # ----- what the scheduler calls (KVCacheManager's interface) -----
    @property
    def req_blocks(self) -> dict[str, list[int]]:
        return self.full.req_blocks

    @property
    def prefix_hits(self) -> int:
        return self.full.prefix_hits

    def find_cached_prefix(
        self, request_id: str, token_ids: list[int], cache_salt: str | None = None
    ) -> list[int]:
        """The longest full-pool hit whose window blocks are cached too (>= 1 token left); both
        pools key blocks by the full chain's hashes, salted with `cache_salt`."""
        hits = self.full.find_cached_prefix(request_id, token_ids, cache_salt)
        hashes = self.full.req_hashes.get(request_id, [])
        while hits:
            needed = self._window_lookup(hashes, len(hits))
            if needed is not None:
                self._window_hits[request_id] = needed
                break
            hits.pop()
        self.full.req_hashes[request_id] = hashes[: len(hits)]
        return hits

    def _window_lookup(self, hashes: list[BlockHash], k: int) -> list[tuple[int, int]] | None:
        """(index, block) of the cached window blocks a hit of k blocks needs; None if one is
        missing."""
        first = max(0, k * self.block_size - self.span) // self.block_size
        found = []
        for index in range(first, k):
            block = self.window.lookup(hashes[index])
            if block is None:
                return None
            found.append((index, block))
        return found

    def allocate(
        self, request_id: str, num_tokens: int, cached_prefix: list[int] | None = None
    ) -> list[int] | None:
        """Full blocks for `num_tokens` tokens and the window blocks from `start - span` on; None
        (and no change) if either pool is short."""
        table = self.tables.get(request_id, [])
        hits = self._window_hits.get(request_id, []) if cached_prefix else []
        start = len(cached_prefix) * self.block_size if cached_prefix else 0
        start = self.next_start.get(request_id, start)
        first = max(0, start - self.span) // self.block_size
        last = -(-num_tokens // self.block_size)  # one past the last logical block
        hit_index = {index for index, _ in hits}
        missing = [
            i
            for i in range(first, last)
            if (i >= len(table) or table[i] == NULL_BLOCK) and i not in hit_index
        ]
        evictable_hits = sum(1 for _, b in hits if self.window.ref_counts[b] == 0)
        if len(missing) > self.window.num_available - evictable_hits:
            return None
        blocks = self.full.allocate(request_id, num_tokens, cached_prefix)
        if blocks is None:
            return None
        self._window_hits.pop(request_id, None)
        table = self.tables.setdefault(request_id, [])
        table.extend([NULL_BLOCK] * (last - len(table)))
        if hits:
            self.window.touch([b for _, b in hits])
            for index, block in hits:
                table[index] = block
        for index, block in zip(missing, self.window.allocate(len(missing)), strict=True):
            table[index] = block
        behind = [b for b in table[:first] if b != NULL_BLOCK]
        table[:first] = [NULL_BLOCK] * first
        self.window.release(behind)
        self.next_start[request_id] = num_tokens
        return blocks

    def cache_blocks(
        self,
        request_id: str,
        token_ids: list[int],
        num_computed: int,
        cache_salt: str | None = None,
    ) -> None:
        self.full.cache_blocks(request_id, token_ids, num_computed, cache_salt)
        hashes = self.full.req_hashes.get(request_id, [])
        table = self.tables.get(request_id, [])
        for index, block_hash in enumerate(hashes[: len(table)]):
            if table[index] != NULL_BLOCK:
                self.window.set_hash(table[index], block_hash)

    def free(self, request_id: str) -> None:
        self.full.free(request_id)
        table = self.tables.pop(request_id, [])
        self.next_start.pop(request_id, None)
        self._window_hits.pop(request_id, None)
        self.window.release([b for b in reversed(table) if b != NULL_BLOCK])

    def take_events(self) -> KVCacheEvents:
        """The full pool's hash changes (the prefix index follows the full chain only)."""
        self.window.take_events()  # drained so that they do not pile up
        return self.full.take_events()

    def blocks_of(self, request_id: str) -> list[int]:
        return self.full.blocks_of(request_id)

    def cached_hashes(self) -> list[BlockHash]:
        """The full pool's hashes (the prefix index follows the full chain)."""
        return self.full.cached_hashes()

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Blocks for a prompt whose KV another rank computes: every full block, and the window
        blocks the next step reads (it may compute the last prompt token again)."""
        self.next_start[request_id] = max(0, num_tokens - 1)
        blocks = self.allocate(request_id, num_tokens)
        if blocks is None:
            del self.next_start[request_id]
        return blocks

    def block_tables(self, request_id: str) -> dict[str, list[int]]:
        """The request's block tables by name (by logical block index): `full` and `window`."""
        return {"full": self.blocks_of(request_id), "window": self.window_table(request_id)}

    def window_table(self, request_id: str) -> list[int]:
        """The request's window block per logical index (`NULL_BLOCK` behind the window)."""
        return self.tables.get(request_id, [])

    def check_integrity(self) -> None:
        self.full.check_integrity()
        holders = [[NULL_BLOCK]] + [
            [b for b in table if b != NULL_BLOCK] for table in self.tables.values()
        ]
        self.window.check_integrity(holders)
        if set(self.tables) != set(self.full.req_blocks):
            raise AssertionError("the window and full pools hold different requests")

    def stats(self) -> KVCacheStats:
        """The full pool's counts, with the window pool's beside them."""
        return replace(
            self.full.stats(), window_blocks=(self.window.num_blocks, *self.window_counts())
        )

    def window_counts(self) -> tuple[int, int, int]:
        """The window pool's (free, cached, in use), NULL_BLOCK counted in use."""
        return self.window.counts()
