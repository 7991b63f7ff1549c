"""KV integrity of a hand-off (`pdmesh_engine.transfer.digest`): the digest covers exactly the bytes
the WRITE moves, both sides compute the same value from their own blocks, one flipped byte anywhere
changes it, `off` computes nothing, `sampled` is deterministic, and the fault hook flips exactly one
byte in flight without touching the sender's KV (real NIXL agents, one process, loopback)."""

from __future__ import annotations

import time

import pytest
import torch

from pdmesh_engine.transfer import digest as digest_mod
from pdmesh_engine.transfer.digest import (
    SAMPLE_EVERY,
    CorruptKV,
    Notice,
    RegionReader,
    corrupt_plan,
    decode_notification,
    digest_regions,
    encode_notification,
    is_digested,
    is_sampled,
)
from pdmesh_engine.transfer.layout import KVMemory, handoff_regions, plan_handoff

BS = 4  # tokens per block
NUM_TOKENS = 13  # 4 blocks, the last partial
# sender and receiver tables by KV group: runs that coalesce on one side only, a window group whose
# hand-off moves only the blocks of the last `span` positions
SENDER = {"kv": [3, 4, 5, 9, 1], "window": [0, 2, 3, 4]}
RECEIVER = {"kv": [7, 0, 1, 2, 6], "window": [5, 1, 6, 7]}


def memories(seed: int) -> list[KVMemory]:
    """A V3-like group with a proposer pool on the same ids, and a window group (V4-like)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 10, BS, 3, generator=g)
    draft = torch.randn(1, 10, BS, 5, generator=g).to(torch.bfloat16)
    window = torch.randn(3, 8, BS, 2, generator=g)
    return [
        KVMemory("kv", (kv, draft)),
        KVMemory("window", (window,), span=6),
    ]


def write_by_plan(sender: list[KVMemory], receiver: list[KVMemory]) -> None:
    """What the WRITE does: every local region's bytes into its remote region."""
    plan = plan_handoff(
        [m.group() for m in sender], SENDER, [m.group() for m in receiver], RECEIVER, NUM_TOKENS
    )
    src = RegionReader(t for m in sender for t in m.tensors)
    dst = RegionReader(t for m in receiver for t in m.tensors)
    for (a, n, _), (b, m, _) in zip(plan.local, plan.remote, strict=True):
        assert n == m
        dst.view(b, m).copy_(src.view(a, n))


def digests(sender: list[KVMemory], receiver: list[KVMemory]) -> tuple[int, int]:
    """(the sender's digest of the WRITE's local regions, the receiver's of its own blocks)."""
    groups = [m.group() for m in sender]
    plan = plan_handoff(groups, SENDER, [m.group() for m in receiver], RECEIVER, NUM_TOKENS)
    sent = digest_regions(RegionReader(t for m in sender for t in m.tensors), plan.local)
    mine = handoff_regions([m.group() for m in receiver], RECEIVER, NUM_TOKENS)
    return sent, digest_regions(RegionReader(t for m in receiver for t in m.tensors), mine)


def test_handoff_regions_cover_exactly_the_bytes_the_write_moves() -> None:
    sender, receiver = memories(0), memories(1)
    groups = [m.group() for m in sender]
    plan = plan_handoff(groups, SENDER, [m.group() for m in receiver], RECEIVER, NUM_TOKENS)
    local = handoff_regions(groups, SENDER, NUM_TOKENS)
    remote = handoff_regions([m.group() for m in receiver], RECEIVER, NUM_TOKENS)
    assert sum(n for _, n, _ in local) == sum(n for _, n, _ in remote) == plan.nbytes

    def byte_addresses(regions):
        return [a + i for a, n, _ in regions for i in range(n)]

    assert byte_addresses(local) == byte_addresses(plan.local)
    assert byte_addresses(remote) == byte_addresses(plan.remote)
    # the window group moves only its last blocks: 13 tokens, span 6 → logical blocks 1..3
    assert plan.group_nbytes["window"] == 3 * 3 * BS * 2 * 4


def test_both_sides_agree_after_the_write_and_not_before() -> None:
    sender, receiver = memories(0), memories(1)
    sent, found = digests(sender, receiver)
    assert sent != found
    write_by_plan(sender, receiver)
    sent, found = digests(sender, receiver)
    assert sent == found
    # bytes outside the hand-off do not count: an unrelated block of the receiver changes
    receiver[0].tensors[0][:, 8] += 1.0
    receiver[1].tensors[0][:, RECEIVER["window"][0]] += 1.0  # logical block 0: outside the span
    assert digests(sender, receiver) == (sent, sent)


def test_one_flipped_byte_anywhere_in_any_region_is_detected() -> None:
    sender, receiver = memories(0), memories(1)
    write_by_plan(sender, receiver)
    sent, _ = digests(sender, receiver)
    regions = handoff_regions([m.group() for m in receiver], RECEIVER, NUM_TOKENS)
    reader = RegionReader(t for m in receiver for t in m.tensors)
    num_checked = 0
    for address, nbytes, _ in regions:
        for offset in range(nbytes):
            byte = reader.view(address + offset, 1)
            original = int(byte[0])
            for flip in (0x01, 0x80):
                byte[0] = original ^ flip
                assert digest_regions(reader, regions) != sent, (address, offset, flip)
            byte[0] = original
            num_checked += 1
    assert digest_regions(reader, regions) == sent
    assert num_checked == sum(n for _, n, _ in regions)


def test_modes_and_sampling_are_deterministic() -> None:
    ids = [f"cmpl-{i}" for i in range(16_000)]
    picked = [i for i in ids if is_sampled(i)]
    assert picked == [i for i in ids if is_sampled(i)]  # the same every call
    assert abs(len(picked) - len(ids) / SAMPLE_EVERY) < 0.15 * len(ids) / SAMPLE_EVERY
    # pinned: xxh64 of the id (no per-process hash seed), so every rank and run picks the same
    assert [i for i in ids[:64] if is_sampled(i)] == PINNED_SAMPLED
    assert not any(is_digested("off", i) for i in ids[:100])
    assert all(is_digested("all", i) for i in ids[:100])
    assert [is_digested("sampled", i) for i in ids[:100]] == [is_sampled(i) for i in ids[:100]]
    with pytest.raises(ValueError, match="--kv-digest"):
        digest_mod.check_mode("some")


PINNED_SAMPLED = ["cmpl-15", "cmpl-17", "cmpl-19"]


def test_notifications_carry_the_digest() -> None:
    for request_id in ("r1", "cmpl-4f2a", "weird\x1fxxh3:id", "ünïcode"):
        for value in (None, 0, 2**64 - 1, 0x1234):
            assert decode_notification(encode_notification(request_id, value)) == Notice(
                request_id, value
            )
    assert decode_notification(b"plain-id") == Notice("plain-id")


def test_corrupt_plan_splits_around_one_byte() -> None:
    local = [(1000, 8, 0), (2000, 4, 0)]
    remote = [(5000, 8, 0), (6000, 4, 0)]
    for position in range(12):
        mine, theirs, source = corrupt_plan(local, remote, position, 99)
        assert [n for _, n, _ in mine] == [n for _, n, _ in theirs]
        assert sum(n for _, n, _ in mine) == 12
        flipped = [i for i, (a, n, _) in enumerate(mine) if a == 99]
        assert len(flipped) == 1 and mine[flipped[0]][1] == 1
        before = sum(n for _, n, _ in mine[: flipped[0]])
        assert before == position
        assert source == (1000 + position if position < 8 else 2000 + position - 8)
        # the remote byte is the one the position names
        assert theirs[flipped[0]][0] == (5000 + position if position < 8 else 6000 + position - 8)
    with pytest.raises(ValueError):
        corrupt_plan(local, remote, 12, 99)


def test_fault_draws_are_seeded_and_limited() -> None:
    def draws(hook: CorruptKV, n: int = 200) -> list[float | None]:
        return [hook.draw() for _ in range(n)]

    assert draws(CorruptKV(0.3, "s:1")) == draws(CorruptKV(0.3, "s:1"))
    assert draws(CorruptKV(0.3, "s:1")) != draws(CorruptKV(0.3, "s:2"))
    assert not any(draws(CorruptKV(0.0, 1)))
    limited = draws(CorruptKV(1.0, 1, limit=3))
    assert [d is not None for d in limited[:4]] == [True, True, True, False]
    assert all(d is None for d in limited[3:])
    with pytest.raises(ValueError):
        CorruptKV(1.5)


# ----- real NIXL agents ------------------------------------------------------------------------


@pytest.fixture
def agents():
    from pdmesh_engine.transfer.agent import KVTransferAgent

    sender_memory, receiver_memory = memories(0), memories(1)
    sender = KVTransferAgent("digest-prefill", sender_memory, progress_thread=False)
    receiver = KVTransferAgent("digest-decode", receiver_memory)
    sender.connect("digest-decode", receiver.metadata())
    try:
        yield sender, receiver, sender_memory, receiver_memory
    finally:
        sender.close()
        receiver.close()


def _push(sender, receiver, request_id: str, **kwargs) -> tuple[Notice, object]:
    transfer = sender.write_handoff(
        request_id, SENDER, "digest-decode", receiver.groups, RECEIVER, NUM_TOKENS, **kwargs
    )
    assert sender.wait(transfer, timeout_s=30) == "DONE"
    deadline = time.monotonic() + 30
    while not (got := receiver.arrivals()):
        assert time.monotonic() < deadline, "no notification"
        time.sleep(0.001)
    assert len(got) == 1 and got[0].request_id == request_id
    return got[0], transfer


def _snapshot(memory: list[KVMemory]) -> list[torch.Tensor]:
    return [t.clone() for m in memory for t in m.tensors]


def test_agent_sends_the_digest_and_the_receiver_finds_it(agents) -> None:
    sender, receiver, _, _ = agents
    notice, transfer = _push(sender, receiver, "r-clean", digest=True)
    assert notice.digest is not None and notice.digest == transfer.digest
    assert receiver.handoff_digest(RECEIVER, NUM_TOKENS) == notice.digest


def test_off_computes_nothing(agents, monkeypatch) -> None:
    from pdmesh_engine.transfer import agent as agent_mod

    calls: list[int] = []
    monkeypatch.setattr(
        agent_mod, "digest_regions", lambda *a: calls.append(1) or 0
    )  # counts any digest the agent would compute
    sender, receiver, _, _ = agents
    notice, transfer = _push(sender, receiver, "r-off", digest=is_digested("off", "r-off"))
    assert notice == Notice("r-off") and transfer.digest is None and calls == []


def test_fault_hook_flips_one_byte_in_flight_and_only_there(agents) -> None:
    sender, receiver, sender_memory, receiver_memory = agents
    before = _snapshot(sender_memory)
    _push(sender, receiver, "r-clean", digest=True)
    clean = _snapshot(receiver_memory)
    for i, at in enumerate((0.0, 0.37, 0.999999)):
        notice, transfer = _push(sender, receiver, f"r-bad{i}", digest=True, corrupt_at=at)
        assert transfer.corrupted_address is not None
        # the sender's KV is intact and its digest is that of the true bytes
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(sender_memory), strict=True))
        assert notice.digest == digest_regions(
            RegionReader(t for m in sender_memory for t in m.tensors),
            handoff_regions([m.group() for m in sender_memory], SENDER, NUM_TOKENS),
        )
        assert receiver.handoff_digest(RECEIVER, NUM_TOKENS) != notice.digest
        now = _snapshot(receiver_memory)
        diff = sum(
            int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
            for a, b in zip(clean, now, strict=True)
        )
        assert diff == 1, f"{diff} bytes differ after a corrupted WRITE"
        for t, c in zip((t for m in receiver_memory for t in m.tensors), clean, strict=True):
            t.copy_(c)  # back to the clean hand-off for the next position


# ----- real engines: both sides agree on every KV group of a family ------------------------------

ENGINE_PROMPTS = [
    [(7 + 13 * i + 31 * k) % 900 + 4 for i in range(n)] for k, n in enumerate([5, 37])
]


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory: pytest.TempPathFactory):
    from pdmesh.tools.model_init import init_model

    root = tmp_path_factory.mktemp("digest-v4")
    return init_model(root / "tiny-v4", "tiny", seed=3, arch="deepseek_v4", verbose=False)


@pytest.mark.parametrize("family", ["v3-mtp", "v4"])
def test_real_engines_agree_on_every_group(family: str, spec_models, v4_model) -> None:
    """Prefill's digest of its WRITE equals decode's of its reserved blocks (V3 with the MTP
    proposer's pool; V4's full and window groups), and the greedy output is the offline one."""
    from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams
    from pdmesh_engine.transfer.agent import KVTransferAgent

    if family == "v4":
        model, extra = v4_model, {"block_size": 16}
    else:
        model = spec_models["tiny"]
        extra = {"block_size": 8, "speculative_method": "mtp", "num_speculative_tokens": 1}
    config = EngineConfig(num_blocks=64, device="cpu", num_threads=1, **extra)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = LLM(model, EngineConfig(num_blocks=64, device="cpu", num_threads=1, **extra))
    expected = [o.token_ids for o in reference.generate(ENGINE_PROMPTS, params)]
    prefill, decode = EngineCore(model, config), EngineCore(model, config)
    sender = KVTransferAgent(f"dg-p-{family}", prefill.kv_memory(), progress_thread=False)
    receiver = KVTransferAgent(f"dg-d-{family}", decode.kv_memory())
    tokens: dict[str, list[int]] = {}
    try:
        sender.connect(f"dg-d-{family}", receiver.metadata())
        for i, prompt in enumerate(ENGINE_PROMPTS):
            prefill.add_request(
                prompt, SamplingParams(max_tokens=1, temperature=0.0), f"p{i}", True
            )
        while prefill.has_unfinished:
            for out in prefill.step():
                tokens[f"r{out.request_id[1:]}"] = list(out.new_token_ids)
        for i, prompt in enumerate(ENGINE_PROMPTS):
            targets = decode.reserve(prompt, params, f"r{i}")
            assert targets is not None
            transfer = sender.write_handoff(
                f"r{i}",
                prefill.kv_tables(f"p{i}"),
                f"dg-d-{family}",
                receiver.groups,
                targets,
                len(prompt),
                digest=True,
            )
            assert sender.wait(transfer, timeout_s=30) == "DONE"
            deadline = time.monotonic() + 30
            while not (got := receiver.arrivals()):
                assert time.monotonic() < deadline
                time.sleep(0.001)
            assert got == [Notice(f"r{i}", transfer.digest)]
            assert receiver.handoff_digest(decode.kv_tables(f"r{i}"), len(prompt)) == got[0].digest
            assert prefill.release_held(f"p{i}")
            assert decode.kv_arrived(f"r{i}", tokens[f"r{i}"][0]) is None
        while decode.has_unfinished:
            for out in decode.step():
                tokens[out.request_id].extend(out.new_token_ids)
    finally:
        sender.close()
        receiver.close()
    assert [tokens[f"r{i}"] for i in range(len(ENGINE_PROMPTS))] == expected
