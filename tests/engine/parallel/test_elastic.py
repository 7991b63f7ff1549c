"""Elastic DEP across real rank processes: one rank dies mid-decode (os._exit inside its step), the
survivors re-form a real gloo group without it (new size, new ranks, experts re-split from memory
and the checkpoint) and finish their requests with the plain engine's greedy tokens; then a rank
joins the re-formed group and it grows back.

The pure parts (the placement over the survivors, the membership protocol on a directory) are
tested in-process.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.llm import run_lockstep
from pdmesh_engine.parallel.dep import DEPConfig, init_dep, shutdown_dep
from pdmesh_engine.parallel.elastic import (
    ElasticConfig,
    ElasticGroup,
    num_physical_for,
    reform_placement,
)
from pdmesh_engine.parallel.membership import (
    FileCoordStore,
    Gather,
    MembershipStore,
    NotAMember,
)
from pdmesh_service.redis_server import free_port

ENGINE = dict(num_blocks=64, block_size=16, num_threads=1)
NUM_PROMPTS, WORLD, VICTIM, DIE_AT = 8, 4, 2, 6
TIMEOUT_S = 60.0


def prompt(i: int) -> list[int]:
    return [(17 * i + 5 * j) % 900 + 4 for j in range(6 + 3 * i)]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


# ----- pure -----
def test_reform_placement_keeps_held_experts_and_covers_the_lost() -> None:
    row = list(range(8))  # 4 ranks x 2 slots
    new = reform_placement(row, [0, 1, 2, 3], [0, 1, 3], 8, num_physical_for(8, 3))
    assert len(new) == 9 and set(new) == set(range(8))
    assert new[0:2] == [0, 1] and new[3:5] == [2, 3] and new[6:8] == [6, 7]  # kept in place
    assert {new[2], new[5]} == {4, 5}  # the lost rank's experts, one per survivor with room
    # a redundant replica of a lost expert on a survivor: kept, so nothing to load for it
    row = [0, 1, 2, 4, 3, 5, 6, 7]
    new = reform_placement(row, [0, 1, 2, 3], [0, 1, 3], 8, 9)
    assert new[3:5] == [2, 4]
    # growth: the joiner holds nothing, takes what has no replica, then replicas
    back = reform_placement(new, [0, 1, 3], [0, 1, 2, 3], 8, 8)
    assert sorted(back) == list(range(8))


def test_membership_gathers_the_survivors(tmp_path: Path) -> None:
    store = MembershipStore(FileCoordStore(tmp_path), "inst")
    records: dict[int, object] = {}

    def survivor(member: int) -> None:
        how = Gather(1, member, (0, 1, 2, 3), settle_s=0.3, wait_s=5.0)
        records[member] = store.gather(how, lambda members: ("127.0.0.1", 1234, {"n": members}))

    threads = [threading.Thread(target=survivor, args=(m,)) for m in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r.members for r in records.values()} == {(1, 2, 3)}  # type: ignore[attr-defined]
    assert store.current().plan == {"n": [1, 2, 3]}  # type: ignore[union-attr]
    late = Gather(1, 0, (0, 1, 2, 3), settle_s=0.3, wait_s=5.0)
    with pytest.raises(NotAMember):
        store.gather(late, lambda members: ("", 0, {}))
    store.ask_to_join(0)
    assert store.pending_joins((1, 2, 3)) == [0]


# ----- ranks -----
def _rank(
    rank: int, world: int, port: int, model_dir: Path, out_dir: Path, coord: Path, join: bool
) -> None:
    torch.set_num_threads(1)
    context = init_dep(
        DEPConfig(rank, world, master_port=port, timeout_s=TIMEOUT_S, dp_sync="all_to_all")
    )
    context.elastic = ElasticGroup(
        ElasticConfig(rank, world, MembershipStore(FileCoordStore(coord), "t"), settle_s=1.0),
        context,
    )
    engine = EngineCore(model_dir, EngineConfig(**ENGINE), dep=context)
    mine = [i for i in range(NUM_PROMPTS) if i % world == rank]
    ids = {i: engine.add_request(prompt(i), greedy(i), f"p{i}") for i in mine}
    sizes: list[int] = []

    def before(index: int) -> None:
        if rank == VICTIM and index == DIE_AT:
            os._exit(1)  # dies with its requests running: like kill -9
        if join and rank == 0 and index == DIE_AT + 4:
            (out_dir / "grow").touch()  # the parent starts a joiner now; the group waits for it
            store = MembershipStore(FileCoordStore(coord), "t")
            while not store.pending_joins(context.elastic.members):
                time.sleep(0.05)

    def after(index: int, record) -> None:
        sizes.append(context.elastic.size)

    start = time.perf_counter()
    outputs = run_lockstep(engine, before, after, max_steps=2000)
    tokens = {
        i: [t for o in outputs if o.request_id == ids[i] for t in o.new_token_ids] for i in ids
    }
    engine.check_integrity()
    torch.save(
        dict(
            tokens=tokens,
            sizes=sizes,
            pause_s=context.elastic.last_pause_s,
            reforms=context.elastic.num_reforms,
            members=context.elastic.members,
            seconds=time.perf_counter() - start,
            slots=len(engine.runner.model.moe_layers[0].local_slots),
        ),
        out_dir / f"rank-{rank}.pt",
    )
    shutdown_dep()


def _joiner(member: int, world: int, model_dir: Path, out_dir: Path, coord: Path) -> None:
    """A restarted rank: builds its engine, asks to join, runs until the group has no work."""
    from pdmesh_engine.parallel.elastic import join_elastic

    torch.set_num_threads(1)
    config = DEPConfig(member, world, timeout_s=TIMEOUT_S, dp_sync="all_to_all")
    elastic = ElasticConfig(member, world, MembershipStore(FileCoordStore(coord), "t"))
    context, finish = join_elastic(config, elastic)
    engine = EngineCore(model_dir, EngineConfig(**ENGINE), dep=context)
    finish(engine)
    ids = {i: engine.add_request(prompt(i), greedy(i), f"j{i}") for i in (NUM_PROMPTS,)}
    outputs = run_lockstep(engine, max_steps=2000)
    tokens = {
        i: [t for o in outputs if o.request_id == ids[i] for t in o.new_token_ids] for i in ids
    }
    torch.save(dict(tokens=tokens, members=context.elastic.members), out_dir / "joiner.pt")
    shutdown_dep()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("el") / "tiny", preset="tiny", seed=0, verbose=False)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[int, list[int]]:
    llm = LLM(model_dir, EngineConfig(**ENGINE))
    outs = llm.generate([prompt(i) for i in range(NUM_PROMPTS + 1)], [greedy(i) for i in range(9)])
    return {i: o.token_ids for i, o in enumerate(outs)}


def _run(model_dir: Path, tmp_path: Path, join: bool) -> dict[int, dict]:
    coord, port = tmp_path / "coord", free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(r, WORLD, port, model_dir, tmp_path, coord, join))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    joiner = None
    deadline = time.monotonic() + 150
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if join and joiner is None and (tmp_path / "grow").exists():
            joiner = ctx.Process(target=_joiner, args=(VICTIM, WORLD, model_dir, tmp_path, coord))
            joiner.start()
        time.sleep(0.05)
    for p in [*procs, *([joiner] if joiner else [])]:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert procs[VICTIM].exitcode == 1
    assert all(p.exitcode == 0 for r, p in enumerate(procs) if r != VICTIM)
    out = {
        r: torch.load(tmp_path / f"rank-{r}.pt", weights_only=False)
        for r in range(WORLD)
        if r != VICTIM
    }
    if join:
        assert joiner is not None and joiner.exitcode == 0
        out[-1] = torch.load(tmp_path / "joiner.pt", weights_only=False)
    return out


def test_survivors_finish_with_the_reference_tokens(
    model_dir: Path, reference: dict, tmp_path: Path
) -> None:
    results = _run(model_dir, tmp_path, join=False)
    for rank, result in results.items():
        for i, tokens in result["tokens"].items():
            assert tokens == reference[i], (rank, i)
        assert result["members"] == (0, 1, 3) and result["reforms"] == 1
        assert result["sizes"][0] == WORLD and result["sizes"][-1] == WORLD - 1
        assert result["slots"] == num_physical_for(8, 3) // 3
        print(f"rank {rank}: re-form pause {result['pause_s'] * 1000:.0f} ms")
    lost = [i for i in range(NUM_PROMPTS) if i % WORLD == VICTIM]
    assert all(i not in r["tokens"] for r in results.values() for i in lost)  # migrate elsewhere


def test_a_restarted_rank_joins_the_group(model_dir: Path, reference: dict, tmp_path: Path) -> None:
    results = _run(model_dir, tmp_path, join=True)
    for rank, result in results.items():
        for i, tokens in result["tokens"].items():
            assert tokens == reference[i], (rank, i)
        assert result["members"] == (0, 1, 2, 3)
    assert max(results[0]["sizes"]) == WORLD and WORLD - 1 in results[0]["sizes"]
    assert results[0]["sizes"][-1] == WORLD
