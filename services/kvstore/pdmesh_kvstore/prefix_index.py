"""The global prefix index, pure (no gRPC, Redis or clock): which instance rank holds which KV
blocks, fed by the ranks' KV events, asked for the longest cached prefix of a prompt.

Each rank publishes numbered batches (`apply`: seq = the previous one + 1) of the chained block
hashes its prefix cache stored and removed; a batch that does not follow the last one (the kvstore
restarted, a batch was lost, the rank is unknown) is refused and the rank sends a `snapshot` of
every hash it holds, which replaces what the index knew of it.

Representation: every known rank owns one bit; `holders[hash]` is the bitmask of the ranks holding
that hash (never 0: a hash nobody holds is absent), `rank_hashes[rank]` the set of its hashes. A
lookup ANDs the masks of the prompt's hashes in order (in C, `itertools.accumulate`), so rank r's
bit survives exactly the leading hashes it holds; each rank's count is then a binary search.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

BlockHash = bytes
CHUNK = 256  # hashes looked up per step of `longest_prefix` (it stops after a chunk nobody holds)


@dataclass(slots=True)
class _Rank:
    bit: int  # 1 << index
    seq: int  # last batch applied
    hashes: set[BlockHash] = field(default_factory=set)


class PrefixIndex:
    """Block hashes per instance rank (see the module docstring); not thread-safe (one event
    loop)."""

    def __init__(self) -> None:
        self.holders: dict[BlockHash, int] = {}
        self.rank_states: dict[str, _Rank] = {}
        self._free_bits: list[int] = []  # indexes of dropped ranks, reused first
        self._next_bit = 0

    # ----- updates -----
    def apply(
        self, rank_id: str, seq: int, stored: Iterable[BlockHash], removed: Iterable[BlockHash]
    ) -> bool:
        """Apply the rank's batch `seq` (its `stored` and `removed` are disjoint); False, changing
        nothing, unless it directly follows the last batch applied or snapshot taken: the rank must
        send a snapshot."""
        state = self.rank_states.get(rank_id)
        if state is None or seq != state.seq + 1:
            return False
        state.seq = seq
        for block_hash in removed:
            self._remove(state, block_hash)
        for block_hash in stored:
            self._add(state, block_hash)
        return True

    def snapshot(self, rank_id: str, seq: int, hashes: Iterable[BlockHash]) -> None:
        """Replace what the index holds of the rank by `hashes`, as of its batch `seq`."""
        self.drop(rank_id)
        state = _Rank(self._take_bit(), seq)
        self.rank_states[rank_id] = state
        for block_hash in hashes:
            self._add(state, block_hash)

    def drop(self, rank_id: str) -> None:
        """Forget the rank and its hashes (a no-op if unknown)."""
        state = self.rank_states.pop(rank_id, None)
        if state is None:
            return
        for block_hash in state.hashes:
            self._clear(block_hash, state.bit)
        self._free_bits.append(state.bit.bit_length() - 1)

    def _add(self, state: _Rank, block_hash: BlockHash) -> None:
        if block_hash not in state.hashes:
            state.hashes.add(block_hash)
            self.holders[block_hash] = self.holders.get(block_hash, 0) | state.bit

    def _remove(self, state: _Rank, block_hash: BlockHash) -> None:
        if block_hash in state.hashes:
            state.hashes.discard(block_hash)
            self._clear(block_hash, state.bit)

    def _clear(self, block_hash: BlockHash, bit: int) -> None:
        mask = self.holders[block_hash] & ~bit
        if mask:
            self.holders[block_hash] = mask
        else:
            del self.holders[block_hash]

    def _take_bit(self) -> int:
        if self._free_bits:
            return 1 << self._free_bits.pop()
        self._next_bit += 1
        return 1 << (self._next_bit - 1)

    # ----- queries -----
    def ranks(self) -> list[str]:
        """The ranks the index knows, sorted."""
        return sorted(self.rank_states)

    def seq(self, rank_id: str) -> int | None:
        """The last batch applied for the rank (None: unknown)."""
        state = self.rank_states.get(rank_id)
        return None if state is None else state.seq

    def num_hashes(self, rank_id: str) -> int:
        state = self.rank_states.get(rank_id)
        return 0 if state is None else len(state.hashes)

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each rank holding the first hash: how many leading hashes of `hashes` it holds
        (hashes are chained, so that is the prompt prefix it has cached). Ranks matching nothing
        are absent."""
        running: list[int] = []  # running[i]: ranks holding hashes[0..i]
        mask = -1  # all ranks
        for begin in range(0, len(hashes), CHUNK):
            masks = [self.holders.get(h, 0) for h in hashes[begin : begin + CHUNK]]
            steps = accumulate(masks, operator.and_, initial=mask)
            next(steps)  # `initial` itself
            running.extend(steps)
            mask = running[-1]
            if not mask:
                break
        matched: dict[str, int] = {}
        if not running or not running[0]:
            return matched
        for rank_id, state in self.rank_states.items():
            if running[0] & state.bit:
                matched[rank_id] = _num_leading(running, state.bit)
        return matched


def _num_leading(running: list[int], bit: int) -> int:
    """How many leading masks of `running` (each a subset of the one before) have `bit` set."""

    def is_cleared(mask: int) -> bool:
        return not mask & bit

    return bisect_left(running, True, key=is_cleared)


def ranks_to_drop(indexed: Iterable[str], live: Iterable[str]) -> set[str]:
    """The indexed ranks the registry no longer lists (they left or stopped heartbeating)."""
    return set(indexed) - set(live)
