"""The speculative proposer's KV crosses a prefill → decode hand-off with the target's, in ONE NIXL
WRITE, between two engines of one process (real NIXL agents, loopback).

The prefill engine runs each prompt (its proposer computes the prompt's MTP or draft-model KV, fed
the first sampled token), its agent writes the prompt's blocks of both pools into the decode
engine's reserved blocks, and decode continues from the first token. Greedy output must equal
speculation off; with the target as its own draft every draft must be accepted, which holds only if
the proposer's KV arrived (the control run wipes it after the WRITE: acceptance drops).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.config import ModelConfig

BS = 8
BASE = dict(num_blocks=64, block_size=BS, device="cpu", num_threads=1)
PARAMS = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
# one partial block, several blocks, an exact multiple of the block size
PROMPTS = [[(7 + 13 * i + 31 * k) % 900 + 4 for i in range(n)] for k, n in enumerate([5, 21, 16])]


@pytest.fixture(scope="module")
def reference(spec_models: dict[str, Path]) -> list[list[int]]:
    """Greedy tokens offline, speculation off."""
    llm = LLM(spec_models["tiny"], EngineConfig(**BASE))
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def spec(spec_models: dict[str, Path], method: str, k: int) -> dict[str, object]:
    if method == "mtp":
        return dict(speculative_method="mtp", num_speculative_tokens=k)
    draft = spec_models["draft" if method == "draft" else "tiny"]
    return dict(speculative_method="draft_model", num_speculative_tokens=k, draft_model=str(draft))


def bytes_per_block(config: ModelConfig, num_layers: int) -> int:
    """What one block of a pool holds, from the checkpoint's config: the MLA latent + rope key of
    every token of the block, in every layer (fp32 on CPU)."""
    return num_layers * BS * config.kv_cache_dim * torch.tensor([], dtype=torch.float32).itemsize


def hand_off(
    prefill: EngineCore, decode: EngineCore, wipe_draft: bool = False
) -> tuple[dict[str, list[int]], list[tuple[int, int, int]]]:
    """Each prompt prefilled on `prefill`, pushed into `decode` (one WRITE each), decoded there.
    Returns (tokens per request incl. the first, (blocks, bytes, draft bytes) per WRITE)."""
    from pdmesh_engine.transfer.agent import KVTransferAgent

    sender = KVTransferAgent("spec-prefill", prefill.kv_memory(), progress_thread=False)
    receiver = KVTransferAgent("spec-decode", decode.kv_memory())
    writes: list[tuple[int, int, int]] = []
    first: dict[str, int] = {}
    try:
        sender.connect("spec-decode", receiver.metadata())
        for i, prompt in enumerate(PROMPTS):
            prefill.add_request(
                prompt, SamplingParams(max_tokens=1, temperature=0.0), f"p{i}", True
            )
        while prefill.has_unfinished:
            for out in prefill.step():
                first[out.request_id] = out.new_token_ids[0]
        for i, prompt in enumerate(PROMPTS):
            targets = decode.reserve(prompt, PARAMS, f"r{i}")
            assert targets is not None
            n = -(-len(prompt) // BS)
            transfer = sender.write_handoff(
                f"r{i}",
                prefill.kv_tables(f"p{i}"),
                "spec-decode",
                receiver.groups,
                targets,
                len(prompt),
            )
            assert sender.wait(transfer, timeout_s=30) == "DONE"
            writes.append((n, transfer.nbytes, transfer.draft_nbytes))
            deadline = time.monotonic() + 30
            while f"r{i}" not in (got := receiver.notifications()):
                assert not got and time.monotonic() < deadline, got
                time.sleep(0.001)
            assert prefill.release_held(f"p{i}")
            if wipe_draft and decode.draft_kv_caches is not None:
                decode.draft_kv_caches[:, targets["draft"][:n]] = 0.0
        for i in range(len(PROMPTS)):
            assert decode.kv_arrived(f"r{i}", first[f"p{i}"]) is None
        tokens = {f"r{i}": [first[f"p{i}"]] for i in range(len(PROMPTS))}
        while decode.has_unfinished:
            for out in decode.step():
                tokens[out.request_id].extend(out.new_token_ids)
    finally:
        sender.close()
        receiver.close()
    for engine in (prefill, decode):
        engine.check_integrity()
        assert engine.kv_stats().num_used == 0
    return tokens, writes


@pytest.mark.parametrize(
    ("method", "k"), [("mtp", 1), ("mtp", 2), ("mtp", 3), ("self", 2), ("draft", 1), ("draft", 3)]
)
def test_proposer_kv_crosses_the_handoff_in_the_same_write(
    spec_models: dict[str, Path], reference: list[list[int]], method: str, k: int
) -> None:
    config = EngineConfig(**BASE, **spec(spec_models, method, k))
    prefill, decode = (
        EngineCore(spec_models["tiny"], config),
        EngineCore(spec_models["tiny"], config),
    )
    tokens, writes = hand_off(prefill, decode)
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference
    target = ModelConfig.from_dir(spec_models["tiny"])
    if method == "mtp":
        draft_bpb = bytes_per_block(target, 1)  # the one MTP layer, the target's latent width
    else:
        draft = ModelConfig.from_dir(spec_models["draft" if method == "draft" else "tiny"])
        draft_bpb = bytes_per_block(draft, draft.num_hidden_layers)
    target_bpb = bytes_per_block(target, target.num_hidden_layers)
    assert draft_bpb > 0 and target_bpb > 0
    # blocks x bytes per block of each pool, exactly: 1, 3 and 2 blocks of 8 tokens
    assert writes == [(n, n * (target_bpb + draft_bpb), n * draft_bpb) for n in (1, 3, 2)]
    stats = decode.spec_decode_stats()
    assert stats is not None and stats.num_verify_steps > 0
    if method == "self":
        assert stats.acceptance_rate == 1.0


def test_acceptance_needs_the_proposer_kv_of_the_handoff(spec_models: dict[str, Path]) -> None:
    """The control: self-drafting after a hand-off whose proposer KV is wiped on arrival accepts
    fewer drafts (while the output stays exact: verification does not read the proposer's KV)."""
    config = EngineConfig(**BASE, **spec(spec_models, "self", 3))
    rates = []
    for wipe in (False, True):
        prefill, decode = (
            EngineCore(spec_models["tiny"], config),
            EngineCore(spec_models["tiny"], config),
        )
        hand_off(prefill, decode, wipe_draft=wipe)
        stats = decode.spec_decode_stats()
        assert stats is not None
        rates.append(stats.acceptance_rate)
    assert rates[0] == 1.0 and rates[1] < 0.9


def test_pools_must_match_on_both_sides(spec_models: dict[str, Path]) -> None:
    """An agent with a proposer pool cannot write to one without, nor the other way round."""
    from pdmesh_engine.transfer.agent import KVTransferAgent

    on = EngineCore(spec_models["tiny"], EngineConfig(**BASE, **spec(spec_models, "mtp", 1)))
    off = EngineCore(spec_models["tiny"], EngineConfig(**BASE))
    assert off.draft_kv_caches is None and off.speculative == ""
    assert on.speculative == "mtp"
    assert EngineCore(
        spec_models["tiny"], EngineConfig(**BASE, **spec(spec_models, "draft", 1))
    ).speculative == ("draft_model:draft")
    a = KVTransferAgent("spec-on", on.kv_caches, progress_thread=False, draft_kv=on.draft_kv_caches)
    b = KVTransferAgent("spec-off", off.kv_caches, progress_thread=False)
    try:
        a.connect("spec-off", b.metadata())
        b.connect("spec-on", a.metadata())
        with pytest.raises(ValueError, match="'spec-on' has a speculative proposer pool"):
            a.write("r", [0], "spec-off", b.layout, [0], None)
        with pytest.raises(ValueError, match="has no speculative proposer pool"):
            b.write("r", [0], "spec-on", a.layout, [0], a.draft_layout)
        assert a.num_transfers == b.num_transfers == 0
    finally:
        a.close()
        b.close()


def test_one_plan_holds_both_pools_regions_pool_after_pool() -> None:
    from pdmesh_engine.transfer.layout import PoolLayout, plan_write_pools

    target = PoolLayout(1 << 20, 3, 16, 8, 256, 16 * 256)
    draft = PoolLayout(1 << 24, 1, 16, 8, 128, 16 * 128)
    peer_target = PoolLayout(1 << 28, 3, 32, 8, 256, 32 * 256)
    peer_draft = PoolLayout(1 << 30, 1, 32, 8, 128, 32 * 128)
    plan = plan_write_pools(
        [(target, peer_target), (draft, peer_draft)], [2, 3, 7], [10, 11, 4]
    )  # runs (2→10, 2) and (7→4, 1)
    assert plan.pool_nbytes == (3 * 3 * 256, 3 * 1 * 128) and plan.nbytes == sum(plan.pool_nbytes)
    assert len(plan.local) == len(plan.remote) == 3 * 2 + 1 * 2
    assert plan.local[-2:] == [
        (draft.block_address(0, 2), 2 * 128, 0),
        (draft.block_address(0, 7), 128, 0),
    ]
    assert plan.remote[-1] == (peer_draft.block_address(0, 4), 128, 0)
    with pytest.raises(ValueError, match="incompatible KV pools: num_layers 1 != 3"):
        plan_write_pools([(target, peer_target), (draft, peer_target)], [2], [10])
    with pytest.raises(ValueError, match="remote block id 20 outside"):
        plan_write_pools(
            [
                (target, peer_target),
                (draft, replace(peer_draft, num_blocks=16, layer_stride_bytes=16 * 128)),
            ],
            [2],
            [20],
        )
