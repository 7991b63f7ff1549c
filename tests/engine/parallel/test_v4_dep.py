"""DeepSeek-V4 under DEP across real rank processes (torch.multiprocessing spawn, gloo on loopback),
against the plain engine; and V4's MoE over a non-trivial placement in one process.

Children compute and `torch.save` what they saw into a temporary directory; the test process
asserts.
- engines: DEP1 / DEP2 / DEP4 greedy tokens == the plain engine's for prompts of mixed lengths
  (chunked prefill, past the window and the compression windows), uneven across ranks (ranks
  finishing early and a late arrival: dummy forwards into V4's two scratch blocks), with redundant
  slots, and with a staged placement switched in mid-run (experts moving between ranks, read from
  the checkpoint); lockstep forward counts, expert load records (hash and top-k layers), the
  expert weights each rank holds;
- one process: permuted and replicated slots give the identity placement's logits; the expert
  reader a placement switch uses returns the loaded weights in both checkpoint layouts (hf, and
  the release's FP8 / MXFP4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import load_results, spawn

from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.llm import run_lockstep
from pdmesh_engine.model.deepseek_v4.config import HASH_MOE, TOPK_MOE, V4Config
from pdmesh_engine.model.deepseek_v4.runtime import load_model
from pdmesh_engine.model.moe import ExpertPlacement, LocalDispatcher
from pdmesh_engine.model_runner import ModelRunner
from pdmesh_engine.parallel.dep import DEPConfig, init_dep, shutdown_dep
from pdmesh_engine.parallel.placement import CheckpointTensors

# chunks of at most 32 tokens; prompts up to 90 tokens cross the window (16), CSA (4) and HCA
# (16) windows and the window pool's release of blocks behind the span
ENGINE = dict(
    num_blocks=64, num_threads=1, dtype="float32", max_num_batched_tokens=32, max_num_seqs=8
)
PROMPT_LENS = [5, 37, 70, 9, 52, 3, 21, 90]
MAX_TOKENS = [4, 12, 6, 16, 3, 10, 8, 14]
LATE = {4: 10}  # prompt index -> step at which it arrives (on rank 0, idle by then)
# staged placement: experts 0 and 7 trade slots in every layer (on different ranks under DEP2)
SWAP_AT, SWAP = (5, (0, 7))
TIMEOUT_S = 120.0
MTP = dict(speculative_method="mtp", num_speculative_tokens=2)


def prompt(i: int) -> list[int]:
    return [(31 * i + 7 * j) % 1000 + 4 for j in range(PROMPT_LENS[i])]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


# ----- children -----
def _engine_worker(
    rank: int,
    world: int,
    port: int,
    model_dir: Path,
    out_dir: Path,
    scenarios: list[tuple[str, int, bool, dict]],
) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, redundant, swap, overrides in scenarios:
        context = init_dep(
            DEPConfig(
                rank, world, master_port=port, timeout_s=TIMEOUT_S, num_redundant_experts=redundant
            )
        )
        results[name] = _run_engine(rank, world, model_dir, context, swap, overrides)
    torch.save(results, out_dir / f"engine{world}-{rank}.pt")
    shutdown_dep()


def _run_engine(
    rank: int, world: int, model_dir: Path, context, swap: bool, overrides: dict
) -> dict:
    engine = EngineCore(model_dir, EngineConfig(**{**ENGINE, **overrides}), dep=context)
    forwards = [0]
    engine.runner.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    mine = [i for i in range(len(PROMPT_LENS)) if i % world == rank]
    ids = {i: engine.add_request(prompt(i), greedy(i), f"p{i}") for i in mine if i not in LATE}
    records = []

    def before_step(index: int) -> None:
        for i in mine:
            if LATE.get(i) == index:
                ids[i] = engine.add_request(prompt(i), greedy(i), f"p{i}")
        if swap and index == SWAP_AT:  # every rank stages it at once: switched in this step
            rows = [moe.slot_experts for moe in engine.runner.model.moe_layers]
            a, b = SWAP
            for row in rows:
                row[a], row[b] = b, a
            assert engine.stage_placement(1, rows)
            assert engine.stager.wait(TIMEOUT_S)

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
        scratch=(engine.runner.scratch_block, engine.runner.scratch_window_block),
        pools=(engine.kv.full.pool.num_blocks, engine.kv.window.num_blocks),
        spec=engine.spec_decode_stats(),
        **(_swapped_slot(engine, model_dir) if swap else {}),
    )


def _swapped_slot(engine: EngineCore, model_dir: Path) -> dict:
    """Whether the swapped slot this rank owns holds its new expert's weights (layer 1)."""
    moe = engine.runner.model.moe_layers[1]
    local = moe.local_slots
    a, b = SWAP
    slot = a if a in local else b
    expert = moe.slot_experts[slot]
    gate = CheckpointTensors(model_dir)(f"model.layers.1.ffn.experts.{expert}.w1.weight")
    width = moe.w2.shape[2]
    return dict(
        swapped_expert=expert,
        slot_holds_new=bool(torch.equal(moe.w13[slot - local.start, :width], gate)),
    )


def _load_check(engine: EngineCore, records: list) -> dict:
    """Per forward step since the last placement switch and per MoE layer: tokens routed by this
    rank vs its scheduled tokens x top_k."""
    recorder = engine.runner.expert_load
    start, steps = recorder.restart_step, recorder.step
    sums = recorder.counts[start:steps].sum(-1)  # [forwards, layers]
    local = torch.tensor([r.local_tokens for r in records if r.ran_forward][start:steps])
    expected = (local * engine.model_config.num_experts_per_tok)[:, None].expand_as(sums)
    return dict(sums=sums, expected=expected, num_physical=recorder.counts.shape[-1])


# ----- fixtures -----
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("v4dep") / "tiny", "tiny", seed=0, arch="deepseek_v4", verbose=False
    )


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict:
    """The plain single-process engine, all prompts at once."""
    llm = LLM(model_dir, EngineConfig(**ENGINE))
    outs = llm.generate(
        [prompt(i) for i in range(len(PROMPT_LENS))], [greedy(i) for i in range(len(PROMPT_LENS))]
    )
    return dict(
        tokens={i: o.token_ids for i, o in enumerate(outs)},
        expert_bytes=llm.engine.runner.expert_weight_bytes(),
        config=llm.engine.model_config,
    )


def _run_dep(world: int, model_dir: Path, out_dir: Path, scenarios: list) -> list[dict]:
    spawn(_engine_worker, world, model_dir, out_dir, scenarios)
    return load_results(out_dir, f"engine{world}", world)


@pytest.fixture(scope="module")
def dep1(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run_dep(1, model_dir, tmp_path_factory.mktemp("v4dep1"), [("base", 0, False, {})])


@pytest.fixture(scope="module")
def dep2(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    scenarios = [("base", 0, False, {}), ("redundant", 2, False, {}), ("swap", 0, True, {})]
    return _run_dep(2, model_dir, tmp_path_factory.mktemp("v4dep2"), scenarios)


@pytest.fixture(scope="module")
def dep4(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    scenarios = [("base", 0, False, {}), ("redundant", 4, False, {})]
    return _run_dep(4, model_dir, tmp_path_factory.mktemp("v4dep4"), scenarios)


@pytest.fixture(scope="module")
def mtp_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny V4 in the release format, which holds the `mtp.0.*` layer."""
    return init_model(
        tmp_path_factory.mktemp("v4dep-mtp") / "tiny",
        "tiny",
        seed=0,
        arch="deepseek_v4",
        format="official",
        verbose=False,
    )


@pytest.fixture(scope="module")
def dep2_mtp(mtp_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    scenarios = [("mtp", 2, False, MTP)]
    return _run_dep(2, mtp_model_dir, tmp_path_factory.mktemp("v4dep2-mtp"), scenarios)


# ----- tests -----
def test_tiny_v4_has_hash_and_top_k_layers(reference: dict) -> None:
    config = reference["config"]
    assert isinstance(config, V4Config)
    assert {HASH_MOE, TOPK_MOE} <= set(config.mlp_layer_types)
    assert max(PROMPT_LENS) > ENGINE["max_num_batched_tokens"] > config.window_span


def test_dep1_greedy_equals_the_plain_engine(dep1: list[dict], reference: dict) -> None:
    tokens = dep1[0]["base"]["tokens"]
    assert tokens == reference["tokens"]


@pytest.mark.parametrize("scenario", ["base", "redundant", "swap"])
def test_dep2_greedy_equals_dep1(
    dep2: list[dict], dep1: list[dict], reference: dict, scenario: str
) -> None:
    for rank, result in enumerate(dep2):
        tokens = result[scenario]["tokens"]
        assert sorted(tokens) == [i for i in range(8) if i % 2 == rank]
        for i, ids in tokens.items():
            assert ids == dep1[0]["base"]["tokens"][i] == reference["tokens"][i], (
                f"rank {rank} prompt {i} ({scenario})"
            )


@pytest.mark.parametrize("scenario", ["base", "redundant"])
def test_dep4_greedy_equals_dep1(
    dep4: list[dict], dep1: list[dict], reference: dict, scenario: str
) -> None:
    for rank, result in enumerate(dep4):
        tokens = result[scenario]["tokens"]
        assert sorted(tokens) == [i for i in range(8) if i % 4 == rank]
        for i, ids in tokens.items():
            assert ids == dep1[0]["base"]["tokens"][i] == reference["tokens"][i], (
                f"rank {rank} prompt {i} ({scenario})"
            )


def test_staged_placement_switches_every_rank_in_one_step(dep2: list[dict]) -> None:
    switched = [
        [step for step, rec in enumerate(r["swap"]["records"]) if rec.switched_to] for r in dep2
    ]
    assert switched[0] == switched[1] and len(switched[0]) == 1, switched
    assert switched[0][0] == SWAP_AT
    for result in dep2:
        swap = result["swap"]
        assert swap["slot_holds_new"], swap["swapped_expert"]
        assert swap["swapped_expert"] in SWAP


@pytest.mark.parametrize("world", [2, 4])
def test_lockstep_equal_forwards_dummies_and_scratch_blocks(
    world: int, dep2: list[dict], dep4: list[dict], reference: dict
) -> None:
    results = dep2 if world == 2 else dep4
    layers = reference["config"].num_hidden_layers
    for scenario in results[0]:
        forwards = [r[scenario]["forwards"] for r in results]
        assert len(set(forwards)) == 1 and forwards[0] >= max(MAX_TOKENS), forwards
        for r in results:
            counters, records = r[scenario]["counters"], r[scenario]["records"]
            assert counters.forwards == r[scenario]["forwards"]
            assert counters.forwards == sum(rec.ran_forward for rec in records)
            assert not records[-1].ran_forward and records[-1].num_unfinished == 0
            assert r[scenario]["stats"]["calls"] == layers * counters.forwards
            # each pool's last block is the scratch, kept from the KV manager (the pools differ
            # in size: one block id would not do for both)
            (full, window), pools = r[scenario]["scratch"], r[scenario]["pools"]
            assert (full, window) == pools and window != full
        assert results[0][scenario]["counters"].dummies > 0  # rank 0 idles before its late prompt
        assert results[-1][scenario]["counters"].dummies == 0  # the busiest rank never waits


def test_expert_load_counts_tokens_times_top_k(dep2: list[dict], dep4: list[dict]) -> None:
    for results in (dep2, dep4):
        for r in results:
            for scenario, result in r.items():
                loads = result["loads"]
                assert torch.equal(loads["sums"], loads["expected"]), scenario
                assert loads["sums"].sum() > 0
        assert results[0]["redundant"]["loads"]["num_physical"] == 8 + len(results)


def test_expert_weight_bytes_split_across_ranks(
    dep2: list[dict], dep4: list[dict], reference: dict
) -> None:
    config = reference["config"]
    experts = config.n_routed_experts
    per_slot = reference["expert_bytes"] // experts
    # every layer is MoE, fp32
    assert per_slot == config.num_hidden_layers * 3 * config.moe_intermediate_size * (
        config.hidden_size * 4
    )
    for results in (dep2, dep4):
        world = len(results)
        for r in results:
            assert r["base"]["expert_bytes"] == reference["expert_bytes"] // world
            assert r["redundant"]["expert_bytes"] == per_slot * (experts + world) // world


def _logits(model_dir: Path, placement: ExpertPlacement | None) -> torch.Tensor:
    """Logits of every position of one 40-token prompt (3 blocks of 16) on a fresh runner."""
    config = V4Config.from_dir(model_dir)
    kwargs = None
    if placement is not None:
        n = config.num_hidden_layers
        kwargs = dict(
            placements=[placement] * n,
            local_slots=[range(placement.num_physical)] * n,
            dispatcher=LocalDispatcher(),
        )
    runner = ModelRunner(model_dir, config, EngineConfig(**ENGINE), model_kwargs=kwargs)
    tokens = prompt(2)[:40]
    batch = ForwardBatch.build([tokens], [0], [[1, 2, 3]], 16, [True], runner.device, [[1, 2, 3]])
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch, runner.kv_caches))


def test_permuted_and_replicated_slots_give_the_identity_logits(model_dir: Path) -> None:
    experts = 8
    # slots hold the experts in reverse, then replicas of 0, 5 and 7
    placement = ExpertPlacement.from_slots([*reversed(range(experts)), 0, 5, 7], experts)
    assert not placement.is_identity and placement.num_physical == experts + 3
    reference = _logits(model_dir, None)
    placed = _logits(model_dir, placement)
    torch.testing.assert_close(placed, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(placed.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("layout", ["hf", "official"])
def test_expert_source_reads_the_loaded_weights(
    model_dir: Path, tmp_path: Path, layout: str
) -> None:
    if layout == "official":
        model_dir = init_model(
            tmp_path / "official", "tiny", seed=0, arch="deepseek_v4", verbose=False, format=layout
        )
    config = V4Config.from_dir(model_dir)
    model = load_model(model_dir, config, torch.device("cpu"), torch.float32)
    source = model.expert_source(CheckpointTensors(model_dir))
    width = config.moe_intermediate_size
    for layer in (0, config.num_hidden_layers - 1):
        moe = model.moe_layers[layer]
        for expert in (0, 5):
            assert torch.equal(source(layer, expert, "gate_proj"), moe.w13[expert, :width])
            assert torch.equal(source(layer, expert, "up_proj"), moe.w13[expert, width:])
            assert torch.equal(source(layer, expert, "down_proj"), moe.w2[expert])


def test_dep2_with_mtp_speculation_equals_the_plain_engine_without(
    mtp_model_dir: Path, dep2_mtp: list[dict]
) -> None:
    """Each rank drafts with its own MTP layer (all of its experts local), verifies under lockstep
    (ranks verifying different numbers of drafts, or none), and emits the tokens the plain engine
    without speculation emits."""
    llm = LLM(mtp_model_dir, EngineConfig(**ENGINE))
    outs = llm.generate(
        [prompt(i) for i in range(len(PROMPT_LENS))], [greedy(i) for i in range(len(PROMPT_LENS))]
    )
    seen = {}
    for rank in dep2_mtp:
        seen |= rank["mtp"]["tokens"]
        assert rank["mtp"]["spec"] is not None and rank["mtp"]["spec"].num_draft_tokens > 0
    assert sorted(seen) == list(range(len(PROMPT_LENS)))
    for i, tokens in seen.items():
        assert tokens == outs[i].token_ids, i
