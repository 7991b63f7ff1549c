"""DEP across real rank processes (torch.multiprocessing spawn, gloo on loopback), against the plain
engine.

Children compute and `torch.save` what they saw into a temporary directory; the test process
asserts.
- dispatcher alone: AllToAllDispatcher on 2 and 3 ranks (a rank with 0 tokens) == fused_moe on all
  weights;
- engines: DEP2 / DEP4 greedy tokens == DEP1 (`LLM`), ranks finishing early (dummy forwards) and a
  late arrival, with redundant slots, and with a mid-run placement swap; lockstep forward counts,
  expert load records and expert weight bytes per rank.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import load_results, spawn

from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.llm import run_lockstep
from pdmesh_engine.model.moe import ExpertPlacement
from pdmesh_engine.parallel.dep import DEPConfig, init_dep, shutdown_dep, slots_of_rank
from pdmesh_engine.parallel.dispatch import AllToAllDispatcher
from pdmesh_engine.parallel.placement import CheckpointTensors, apply_placement, expert_tensor_name
from pdmesh_kernels.moe import fused_moe

ENGINE = dict(num_blocks=64, block_size=16, num_threads=1)
PROMPT_LENS = [5, 17, 33, 9, 40, 3, 21, 12]
MAX_TOKENS = [4, 12, 6, 16, 3, 10, 8, 14]
LATE = {4: 10}  # prompt index -> step at which it arrives (on rank 0, idle by then)
# placement swap: experts 0 and 7 trade slots (they live on different ranks)
SWAP_AT, SWAP = (5, (0, 7))
TIMEOUT_S = 120.0


def prompt(i: int) -> list[int]:
    return [(31 * i + 7 * j) % 1000 + 4 for j in range(PROMPT_LENS[i])]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


# ----- children -----
def _dispatch_worker(rank: int, world: int, port: int, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    result = {}
    for members in ([0, 1], [0, 1, 2]):
        group = dist.new_group(members)  # collective: every rank creates every group
        if rank in members:
            result[len(members)] = _dispatch_case(rank, len(members), group)
    torch.save(result, out_dir / f"dispatch-{rank}.pt")
    dist.destroy_process_group()


def _dispatch_case(rank: int, world: int, group: dist.ProcessGroup) -> dict:
    per_rank, hidden, width, top_k = 3, 16, 8, 3
    num_slots = per_rank * world
    shared = torch.Generator().manual_seed(1234)  # the same full weights on every rank
    w13 = 0.3 * torch.randn(num_slots, 2 * width, hidden, generator=shared)
    w2 = 0.3 * torch.randn(num_slots, hidden, width, generator=shared)
    gen = torch.Generator().manual_seed(100 * world + rank)
    tokens = [0, 7, 11][rank]  # rank 0 has no tokens
    x = torch.randn(tokens, hidden, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    slot_ids = (
        torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(tokens)])
        if tokens
        else torch.zeros(0, top_k, dtype=torch.int64)
    )
    dispatcher = AllToAllDispatcher(group)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    out = dispatcher(x, weights, slot_ids, w13[mine].contiguous(), w2[mine].contiguous())
    distinct = sum(len({s // per_rank for s in row}) for row in slot_ids.tolist())
    return dict(
        out=out,
        ref=fused_moe(x, w13, w2, weights, slot_ids),
        rows_sent=dispatcher.stats.rows_sent,
        distinct_dest=distinct,
        calls=dispatcher.stats.calls,
    )


def _engine_worker(
    rank: int,
    world: int,
    port: int,
    model_dir: Path,
    out_dir: Path,
    scenarios: list[tuple[str, int, bool]],
) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, redundant, swap in scenarios:
        context = init_dep(
            DEPConfig(
                rank, world, master_port=port, timeout_s=TIMEOUT_S, num_redundant_experts=redundant
            )
        )
        results[name] = _run_engine(rank, world, model_dir, context, swap)
    torch.save(results, out_dir / f"engine{world}-{rank}.pt")
    shutdown_dep()


def _run_engine(rank: int, world: int, model_dir: Path, context, swap: bool) -> dict:
    engine = EngineCore(model_dir, EngineConfig(**ENGINE), dep=context)
    forwards = [0]
    engine.runner.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    mine = [i for i in range(len(PROMPT_LENS)) if i % world == rank]
    ids = {i: engine.add_request(prompt(i), greedy(i), f"p{i}") for i in mine if i not in LATE}
    records = []
    swapped = {}

    def before_step(index: int) -> None:
        for i in mine:
            if LATE.get(i) == index:
                ids[i] = engine.add_request(prompt(i), greedy(i), f"p{i}")
        if swap and index == SWAP_AT:
            swapped.update(_swap_experts(engine, model_dir))

    outputs = run_lockstep(
        engine, before_step, lambda _, record: records.append(record), max_steps=500
    )
    tokens = {
        i: [t for o in outputs if o.request_id == ids[i] for t in o.new_token_ids] for i in ids
    }
    engine.check_integrity()
    return dict(
        tokens=tokens,
        records=records,
        forwards=forwards[0],
        counters=engine.lockstep.counters,
        expert_bytes=engine.runner.expert_weight_bytes(),
        loads=_load_check(engine, records),
        stats=engine.runner.dispatch_stats().as_dict(),
        **swapped,
    )


def _swap_experts(engine: EngineCore, model_dir: Path) -> dict:
    model = engine.runner.model
    a, b = SWAP
    slots = model.moe_layers[0].placement.physical_to_logical.tolist()
    slots[a], slots[b] = b, a
    placement = ExpertPlacement.from_slots(slots, engine.model_config.n_routed_experts)
    reloaded = apply_placement(
        model, [placement] * len(model.moe_layers), CheckpointTensors(model_dir)
    )
    moe = model.moe_layers[0]  # decoder layer 1 (layer 0 is dense)
    local = moe.local_slots
    slot = a if a in local else b  # the swapped slot this rank owns
    gate = CheckpointTensors(model_dir)(expert_tensor_name(1, slots[slot], "gate_proj"))
    width = moe.w2.shape[2]
    return dict(
        reloaded=reloaded,
        slot_holds_new=bool(torch.equal(moe.w13[slot - local.start, :width], gate)),
    )


def _load_check(engine: EngineCore, records: list) -> dict:
    """Per forward step and MoE layer: tokens routed by this rank vs its scheduled tokens x
    top_k."""
    recorder = engine.runner.expert_load
    steps = recorder.step
    sums = recorder.counts[:steps].sum(-1)  # [forwards, layers]
    local = torch.tensor([r.local_tokens for r in records if r.ran_forward])
    expected = (local * engine.model_config.num_experts_per_tok)[:, None].expand_as(sums)
    return dict(
        sums=sums,
        expected=expected,
        num_physical=recorder.counts.shape[-1],
        replica_load=int(recorder.counts[:steps, :, engine.model_config.n_routed_experts :].sum()),
    )


# ----- tests -----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("dep") / "tiny", preset="tiny", seed=0, verbose=False)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict:
    """DEP1: the plain engine, all prompts at once."""
    llm = LLM(model_dir, EngineConfig(**ENGINE))
    outs = llm.generate(
        [prompt(i) for i in range(len(PROMPT_LENS))], [greedy(i) for i in range(len(PROMPT_LENS))]
    )
    return dict(
        tokens={i: o.token_ids for i, o in enumerate(outs)},
        expert_bytes=llm.engine.runner.expert_weight_bytes(),
        config=llm.engine.model_config,
    )


@pytest.fixture(scope="module")
def dep2(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("dep2")
    spawn(
        _engine_worker,
        2,
        model_dir,
        out_dir,
        [("base", 0, False), ("redundant", 2, False), ("swap", 0, True)],
    )
    return load_results(out_dir, "engine2", 2)


@pytest.fixture(scope="module")
def dep4(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("dep4")
    spawn(_engine_worker, 4, model_dir, out_dir, [("base", 0, False), ("redundant", 4, False)])
    return load_results(out_dir, "engine4", 4)


def test_dispatcher_matches_fused_moe_on_2_and_3_ranks(tmp_path: Path) -> None:
    spawn(_dispatch_worker, 3, tmp_path)
    results = load_results(tmp_path, "dispatch", 3)
    for world in (2, 3):
        for rank in range(world):
            case = results[rank][world]
            torch.testing.assert_close(case["out"], case["ref"], rtol=1e-5, atol=1e-5)
            # each token once per destination rank
            assert case["rows_sent"] == case["distinct_dest"]
            assert case["calls"] == 1
        assert results[0][world]["out"].shape == (0, 16)
    assert 2 not in results[2]


@pytest.mark.parametrize("scenario", ["base", "redundant", "swap"])
def test_dep2_greedy_equals_dep1(dep2: list[dict], reference: dict, scenario: str) -> None:
    for rank, result in enumerate(dep2):
        tokens = result[scenario]["tokens"]
        assert sorted(tokens) == [i for i in range(8) if i % 2 == rank]
        for i, ids in tokens.items():
            assert ids == reference["tokens"][i], f"rank {rank} prompt {i} ({scenario})"


@pytest.mark.parametrize("scenario", ["base", "redundant"])
def test_dep4_greedy_equals_dep1(dep4: list[dict], reference: dict, scenario: str) -> None:
    for rank, result in enumerate(dep4):
        tokens = result[scenario]["tokens"]
        assert sorted(tokens) == [i for i in range(8) if i % 4 == rank]
        for i, ids in tokens.items():
            assert ids == reference["tokens"][i], f"rank {rank} prompt {i} ({scenario})"


def test_placement_swap_reloads_only_the_moved_slots(dep2: list[dict]) -> None:
    for result in dep2:
        swap = result["swap"]
        assert swap["reloaded"] == 4  # one slot per rank in 3 MoE layers + the MTP layer
        assert swap["slot_holds_new"]


@pytest.mark.parametrize("world", [2, 4])
def test_lockstep_equal_forwards_dummies_and_idle_end(
    world: int, dep2: list[dict], dep4: list[dict]
) -> None:
    results = dep2 if world == 2 else dep4
    for scenario in results[0]:
        forwards = [r[scenario]["forwards"] for r in results]
        assert len(set(forwards)) == 1 and forwards[0] >= max(MAX_TOKENS), forwards
        for r in results:
            counters, records = r[scenario]["counters"], r[scenario]["records"]
            assert (
                counters.forwards
                == r[scenario]["forwards"]
                == sum(rec.ran_forward for rec in records)
            )
            # ended without a forward
            assert not records[-1].ran_forward and records[-1].num_unfinished == 0
            assert counters.idle == 1 and counters.steps == len(records)
            stats = r[scenario]["stats"]
            assert stats["calls"] == 3 * counters.forwards  # 3 MoE layers each
            assert min(stats["dispatch_s"], stats["compute_s"], stats["combine_s"]) > 0
        assert results[0][scenario]["counters"].dummies > 0  # rank 0 idles before its late prompt
        assert results[-1][scenario]["counters"].dummies == 0  # the busiest rank never waits


def test_expert_load_counts_tokens_times_top_k(dep2: list[dict], dep4: list[dict]) -> None:
    for results in (dep2, dep4):
        for r in results:
            for scenario, result in r.items():
                loads = result["loads"]
                assert torch.equal(loads["sums"], loads["expected"]), scenario
                assert loads["sums"].sum() > 0
        # global slot ids
        assert results[0]["redundant"]["loads"]["num_physical"] == 8 + len(results)
        # replicas take tokens
        assert sum(r["redundant"]["loads"]["replica_load"] for r in results) > 0
        assert all(r["base"]["loads"]["replica_load"] == 0 for r in results)


def test_expert_weight_bytes_split_across_ranks(
    dep2: list[dict], dep4: list[dict], reference: dict
) -> None:
    config = reference["config"]
    experts = config.n_routed_experts
    per_slot = reference["expert_bytes"] // experts
    # 3 MoE + MTP, fp32
    assert per_slot == 4 * 3 * config.moe_intermediate_size * config.hidden_size * 4
    for results in (dep2, dep4):
        world = len(results)
        for r in results:
            assert r["base"]["expert_bytes"] == reference["expert_bytes"] // world
            assert r["redundant"]["expert_bytes"] == per_slot * (experts + world) // world


def test_dep_config_and_slot_split_errors() -> None:
    assert slots_of_rank(8, 4, 4, 3) == range(9, 12)
    with pytest.raises(ValueError, match="do not split evenly across 3 DEP ranks"):
        slots_of_rank(8, 0, 3, 0)
    with pytest.raises(ValueError, match="rank"):
        DEPConfig(rank=2, size=2)
    with pytest.raises(ValueError, match="num_redundant_experts"):
        DEPConfig(rank=0, size=2, num_redundant_experts=-1)
    with pytest.raises(ValueError, match="dp_sync"):
        DEPConfig(rank=0, size=2, dp_sync="ring")
