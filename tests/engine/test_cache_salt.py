"""Cache isolation by `SamplingParams.cache_salt`: the salt is the root of the block-hash chain, so
requests share cached blocks exactly when their salts are equal (None: today's hashes, unchanged).

From the hash functions up: `block_hash`, the prefix cache (`KVCacheManager`, the windowed pools),
the KV events the kvstore indexes, the scheduler, and an engine on a tiny checkpoint."""

from __future__ import annotations

import hashlib
import sys
from array import array
from pathlib import Path

import pytest

from pdmesh.tools.model_init import init_model
from pdmesh_engine import EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.block_hash import hash_block, hash_full_blocks, salt_root
from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_engine.kv_window import WindowedKVManager
from pdmesh_engine.request import Request
from pdmesh_engine.scheduler import SampledToken, Scheduler, SchedulerConfig

BS = 4
SALTS = ("tenant-a", "tenant-a", "tenant-b", None)  # the order requests come in below


def _unsalted_reference(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chain as it was before salts: blake2b-128 over the parent hash, then the block's token
    ids as little-endian int64, from no parent."""
    hashes: list[bytes] = []
    parent = b""
    for begin in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        packed = array("q", token_ids[begin : begin + block_size])
        if sys.byteorder == "big":
            packed.byteswap()
        h.update(packed.tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


# ----- the hash chain -----


def test_no_salt_keeps_the_hashes_as_they_were() -> None:
    tokens = list(range(7, 7 + 5 * BS + 3))
    assert hash_full_blocks(tokens, BS) == _unsalted_reference(tokens, BS)
    assert hash_full_blocks(tokens, BS, cache_salt=None) == _unsalted_reference(tokens, BS)
    assert salt_root(None) is None
    # pinned (computed before salts existed): old and new processes of a mesh agree on it
    assert hash_full_blocks(list(range(1, 9)), BS)[1].hex() == "8222aab65152a8711ac413a3333a672c"
    assert hash_block(None, [1, 2, 3, 4]) == hash_full_blocks([1, 2, 3, 4], BS)[0]


def test_a_salt_changes_the_chain_from_its_first_block_on() -> None:
    tokens = list(range(100, 100 + 4 * BS))
    plain = hash_full_blocks(tokens, BS)
    a = hash_full_blocks(tokens, BS, cache_salt="a")
    assert a == hash_full_blocks(tokens, BS, cache_salt="a")  # deterministic
    b = hash_full_blocks(tokens, BS, cache_salt="b")
    empty = hash_full_blocks(tokens, BS, cache_salt="")
    chains = [plain, a, b, empty]
    every_hash = [h for chain in chains for h in chain]
    assert len(set(every_hash)) == len(every_hash)  # no block shared between chains, at any index
    assert a[0] == hash_block(salt_root("a"), tokens[:BS])
    # the salt root is never the hash of a block (it is personalised apart), so a salted chain is
    # not the tail of an unsalted one either
    assert salt_root("a") not in plain and salt_root("a") != salt_root("b")
    assert len(salt_root("a") or b"") == 16
    assert hash_full_blocks(tokens, BS, cache_salt="\ud800 é 日本")  # any str hashes


def test_a_salted_chain_extends_incrementally() -> None:
    tokens = list(range(50, 50 + 5 * BS))
    full = hash_full_blocks(tokens, BS, cache_salt="s")
    rest = hash_full_blocks(tokens, BS, start_block=2, parent=full[1], cache_salt="s")
    assert full[:2] + rest == full
    # a parent already carries the salt: another one given with it changes nothing
    assert hash_full_blocks(tokens, BS, 2, full[1], cache_salt="other") == rest


# ----- the prefix cache and its events -----


def _run(kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None) -> list[int]:
    """Admit, compute and free one request; the blocks its prefix lookup hit."""
    hits = kv.find_cached_prefix(rid, tokens, salt)
    assert kv.allocate(rid, len(tokens), hits) is not None
    kv.cache_blocks(rid, tokens, len(tokens), salt)
    kv.check_integrity()
    kv.free(rid)
    return hits


def test_the_prefix_cache_is_shared_within_a_salt_only() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    tokens = list(range(200, 200 + 4 * BS + 1))
    hits = {f"r{i}": _run(kv, f"r{i}", tokens, salt) for i, salt in enumerate(SALTS)}
    assert hits["r0"] == [] and len(hits["r1"]) == 4  # A, then A again: all 4 blocks
    assert hits["r2"] == [] and hits["r3"] == []  # B and None: none of A's blocks
    # all three chains are cached side by side now, each found under its own salt only
    for salt in ("tenant-a", "tenant-b", None):
        assert len(kv.find_cached_prefix("probe", tokens, salt)) == 4
        kv.free("probe")
    assert kv.find_cached_prefix("probe", tokens, "tenant-c") == []


def test_kv_events_carry_the_salted_hashes() -> None:
    """What the kvstore indexes: a salted request's blocks under its salted hashes, so a lookup
    with another salt's hashes (the gateway's, for another tenant) finds no holder."""
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    tokens = list(range(300, 300 + 3 * BS + 1))
    _run(kv, "a", tokens, "tenant-a")
    events = kv.take_events()
    salted = hash_full_blocks(tokens[: 3 * BS], BS, cache_salt="tenant-a")
    assert events.stored == salted
    assert not set(events.stored) & set(hash_full_blocks(tokens[: 3 * BS], BS))
    assert sorted(kv.cached_hashes()) == sorted(salted)


def test_a_decode_rank_caches_received_kv_under_the_salt() -> None:
    """A decode rank caches the blocks whose KV arrived (`Scheduler.kv_arrived`) under the
    request's salt, as the prefill rank that computed them did."""
    scheduler = Scheduler(SchedulerConfig(4, 64, 256), KVCacheManager(64, BS))
    tokens = list(range(400, 400 + 3 * BS + 2))
    request = Request("r", tokens, SamplingParams(cache_salt="tenant-a"), eos_token_ids=(1,))
    assert scheduler.reserve(request) is not None
    scheduler.kv_arrived("r")
    assert scheduler.kv.take_events().stored == hash_full_blocks(
        tokens[: 3 * BS], BS, cache_salt="tenant-a"
    )


def test_windowed_pools_follow_the_salt() -> None:
    kv = WindowedKVManager(num_full_blocks=32, num_window_blocks=16, block_size=BS, span=5)
    tokens = list(range(500, 500 + 4 * BS + 1))
    assert kv.allocate("a", len(tokens)) is not None
    kv.cache_blocks("a", tokens, len(tokens), "tenant-a")
    kv.free("a")
    assert kv.find_cached_prefix("b", tokens, "tenant-b") == []
    assert kv.find_cached_prefix("n", tokens) == []
    hits = kv.find_cached_prefix("a2", tokens, "tenant-a")
    assert len(hits) == 4
    assert kv.allocate("a2", len(tokens), hits) is not None
    kv.check_integrity()
    kv.free("a2")
    assert kv.take_events().stored == hash_full_blocks(tokens[: 4 * BS], BS, cache_salt="tenant-a")


def test_the_scheduler_hits_the_cache_within_a_salt_only() -> None:
    scheduler = Scheduler(SchedulerConfig(4, 64, 256), KVCacheManager(64, BS))
    tokens = list(range(600, 600 + 5 * BS + 1))
    cached: dict[str, int] = {}
    for i, salt in enumerate(SALTS):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=2, ignore_eos=True, cache_salt=salt)
        scheduler.add_request(Request(rid, list(tokens), params, eos_token_ids=(1,)))
        while scheduler.has_unfinished:
            out = scheduler.schedule()
            sampled = {s.request_id: SampledToken(7) for s in out.scheduled if s.needs_sample}
            for step in scheduler.update_from_output(out, sampled):
                if step.finish_reason is not None:
                    cached[rid] = step.num_cached_tokens
            scheduler.check_integrity()
    assert cached == {"r0": 0, "r1": 5 * BS, "r2": 0, "r3": 0}


# ----- an engine on a tiny checkpoint -----


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("cache-salt") / "tiny", preset="tiny", seed=0, verbose=False
    )


def test_an_engine_shares_cached_blocks_within_a_salt_and_outputs_do_not_change(
    model_dir: Path,
) -> None:
    engine = EngineCore(model_dir, EngineConfig(block_size=BS, num_blocks=128))
    prompt = [(11 + 7 * i) % 900 + 4 for i in range(6 * BS + 1)]
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, salt in enumerate(SALTS):
        rid = f"r{i}"
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=salt)
        engine.add_request(prompt, params, request_id=rid)
        while engine.has_unfinished:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    cached[out.request_id] = out.num_cached_tokens
            engine.check_integrity()
    assert cached == {"r0": 0, "r1": 6 * BS, "r2": 0, "r3": 0}
    assert len(tokens["r0"]) == 6
    assert tokens["r1"] == tokens["r0"] and tokens["r2"] == tokens["r0"]
    assert tokens["r3"] == tokens["r0"]
    assert engine.kv_stats().num_used == 0
