"""The pure prefix index: batches in sequence, gaps refused, snapshots, drops, longest prefix."""

from __future__ import annotations

import random
import time

from pdmesh_engine.block_hash import hash_full_blocks
from pdmesh_kvstore.prefix_index import PrefixIndex, ranks_to_drop


def chain(n: int, start: int = 0) -> list[bytes]:
    """n chained block hashes (block size 1) of the tokens start, start+1, ..."""
    return hash_full_blocks(list(range(start, start + n)), 1)


def slow_longest_prefix(index: PrefixIndex, hashes: list[bytes]) -> dict[str, int]:
    """The definition: per rank, the number of leading hashes it holds."""
    matched = {}
    for rank_id in index.ranks():
        held = index.rank_states[rank_id].hashes
        count = 0
        while count < len(hashes) and hashes[count] in held:
            count += 1
        if count:
            matched[rank_id] = count
    return matched


def test_batches_apply_in_sequence_and_a_gap_is_refused_unchanged() -> None:
    index = PrefixIndex()
    hashes = chain(6)
    assert not index.apply("a", 1, hashes[:2], [])  # unknown rank: snapshot first
    assert index.ranks() == []
    index.snapshot("a", 7, hashes[:2])
    assert index.apply("a", 8, hashes[2:4], [])
    assert index.longest_prefix(hashes) == {"a": 4}
    assert not index.apply("a", 10, hashes[4:], [])  # batch 9 was lost
    assert not index.apply("a", 8, hashes[4:], [])  # a repeat is a gap too
    assert index.longest_prefix(hashes) == {"a": 4} and index.seq("a") == 8
    assert index.apply("a", 9, [], [hashes[1]])
    assert index.longest_prefix(hashes) == {"a": 1}


def test_snapshot_replaces_what_the_rank_held() -> None:
    index = PrefixIndex()
    old, new = chain(4), chain(3, start=50)
    index.snapshot("a", 1, old)
    index.snapshot("b", 1, old[:2])
    index.snapshot("a", 1, new)
    assert index.longest_prefix(old) == {"b": 2}
    assert index.longest_prefix(new) == {"a": 3}
    assert index.num_hashes("a") == 3 and old[3] not in index.holders


def test_drop_forgets_the_rank_and_its_bit_is_reused_cleanly() -> None:
    index = PrefixIndex()
    hashes = chain(5)
    index.snapshot("a", 1, hashes)
    index.snapshot("b", 1, hashes[:3])
    index.drop("a")
    index.drop("missing")
    assert index.ranks() == ["b"] and index.longest_prefix(hashes) == {"b": 3}
    index.snapshot("c", 1, hashes[:1])  # takes a's bit: none of a's hashes may stick to it
    assert index.longest_prefix(hashes) == {"b": 3, "c": 1}
    index.drop("b")
    index.drop("c")
    assert index.holders == {} and index.longest_prefix(hashes) == {}


def test_a_rank_missing_a_middle_block_matches_only_up_to_it() -> None:
    index = PrefixIndex()
    hashes = chain(600)  # spans several lookup chunks
    index.snapshot("a", 1, hashes[:100] + hashes[101:])
    index.snapshot("b", 1, hashes)
    index.snapshot("c", 1, hashes[1:])  # no first block: no prefix
    assert index.longest_prefix(hashes) == {"a": 100, "b": 600}
    assert index.longest_prefix([]) == {}
    assert index.longest_prefix(chain(3, start=9999)) == {}


def test_longest_prefix_equals_the_definition_on_random_states() -> None:
    rng = random.Random(3)
    prompts = [chain(rng.randrange(1, 700), start=1000 * p) for p in range(4)]
    for trial in range(30):
        index = PrefixIndex()
        for r in range(rng.randrange(1, 12)):
            prompt = rng.choice(prompts)
            held = [h for h in prompt if rng.random() < 0.97]
            index.snapshot(f"r{r}", 1, held)
            if rng.random() < 0.3:
                index.drop(f"r{rng.randrange(r + 1)}")
        for prompt in prompts:
            assert index.longest_prefix(prompt) == slow_longest_prefix(index, prompt), trial


def test_ranks_to_drop_are_the_indexed_ranks_gone_from_the_registry() -> None:
    assert ranks_to_drop(["a", "b-r0", "b-r1"], ["b-r0", "c"]) == {"a", "b-r1"}
    assert ranks_to_drop([], ["a"]) == set()


def bench_longest_prefix(
    num_ranks: int = 16, blocks_per_rank: int = 2048, prompt_blocks: int = 4096
) -> float:
    """Seconds per `longest_prefix` of a `prompt_blocks` prompt over `num_ranks` ranks holding
    `blocks_per_rank` blocks each (rank r holds the prompt's first 256*(r+1) blocks, capped, and
    the rest of its share elsewhere)."""
    index = PrefixIndex()
    prompt = chain(prompt_blocks)
    for r in range(num_ranks):
        shared = min(256 * (r + 1), blocks_per_rank)
        own = chain(blocks_per_rank - shared, start=10**6 * (r + 1))
        index.snapshot(f"r{r}", 1, prompt[:shared] + own)
    runs = 200
    start = time.perf_counter()
    for _ in range(runs):
        matched = index.longest_prefix(prompt)
    elapsed = (time.perf_counter() - start) / runs
    assert matched == slow_longest_prefix(index, prompt)
    return elapsed


def test_bench_longest_prefix_gives_the_definitions_answer() -> None:
    elapsed = bench_longest_prefix()
    print(f"longest_prefix: 4096 blocks, 16 ranks x 2048 blocks: {elapsed * 1e6:.0f} us")


if __name__ == "__main__":
    print(f"{bench_longest_prefix() * 1e6:.0f} us per lookup")
