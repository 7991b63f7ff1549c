"""Speculative decoding under DEP: two rank processes (torch.multiprocessing spawn, gloo on
loopback) against the plain engine with speculation off.

Children run every scenario (method, K, which rank gets which prompts) and `torch.save` what they
saw; the test process asserts.
- greedy tokens with speculation on equal speculation off, for MTP (K = 1, 2, 3) and the tiny-draft
  model (K = 1, 3), with the prompts split across the ranks (uneven lengths: a rank finishes early
  and keeps stepping dummies) and with rank 0 getting no request at all;
- the target as its own draft model (K = 2): every draft is accepted;
- lockstep: both ranks run the same number of target and proposer passes and the same number of
  expert dispatches (dummy passes pad the steps where a rank drafts less or has nothing to do);
- the draft model's expert loads land in a ring of its own, shaped like the draft (tokens through
  its MoE x its top-k), while the target's ring counts the verify forwards' tokens x the target's
  top-k.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import load_results, spawn

from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.llm import run_lockstep
from pdmesh_engine.parallel.dep import DEPConfig, init_dep, shutdown_dep

ENGINE = dict(num_blocks=96, block_size=16, num_threads=1)
PROMPT_LENS = [5, 17, 33, 9, 40, 3]
MAX_TOKENS = [4, 14, 6, 16, 3, 11]
TIMEOUT_S = 120.0
WORLD = 2
STAGE_AT = 2  # "self2": a new placement of the draft's experts is staged before this step
# name -> (method, K, layout): "split" gives prompt i to rank i % 2, "idle" all of them to rank 1
SCENARIOS = {
    "mtp1": ("mtp", 1, "split"),
    "mtp2": ("mtp", 2, "split"),
    "mtp3": ("mtp", 3, "split"),
    "mtp3-idle": ("mtp", 3, "idle"),
    "draft1": ("draft", 1, "split"),
    "draft3": ("draft", 3, "split"),
    "draft1-idle": ("draft", 1, "idle"),
    "self2": ("self", 2, "split"),
}


def prompt(i: int) -> list[int]:
    return [(29 * i + 13 * j) % 1000 + 4 for j in range(PROMPT_LENS[i])]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


def owner(layout: str, i: int) -> int:
    return i % WORLD if layout == "split" else WORLD - 1


def spec_fields(spec_models: dict[str, Path], method: str, k: int) -> dict:
    if method == "mtp":
        return dict(speculative_method="mtp", num_speculative_tokens=k)
    draft = spec_models["draft" if method == "draft" else "tiny"]
    return dict(speculative_method="draft_model", num_speculative_tokens=k, draft_model=str(draft))


# ----- children -----
def _worker(rank: int, world: int, port: int, spec_models: dict[str, Path], out_dir: Path) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, (method, k, layout) in SCENARIOS.items():
        context = init_dep(DEPConfig(rank, world, master_port=port, timeout_s=TIMEOUT_S))
        config = EngineConfig(**ENGINE, **spec_fields(spec_models, method, k))
        engine = EngineCore(spec_models["tiny"], config, dep=context)
        results[name] = _run(rank, engine, layout, stage_draft=name == "self2")
    torch.save(results, out_dir / f"spec-{rank}.pt")
    shutdown_dep()


def _run(rank: int, engine: EngineCore, layout: str, stage_draft: bool) -> dict:
    proposer = engine.runner.proposer
    assert proposer is not None
    scratch = engine.lockstep.scratch_block
    block_size = engine.kv_layout.block_size
    target_passes, draft_passes = [0], []  # draft: (tokens, wrote the scratch block) per pass

    def count_target(*_) -> None:
        target_passes[0] += 1

    def count_draft(_module, args) -> None:
        [batch] = [a for a in args if isinstance(a, ForwardBatch)]
        blocks = set(torch.div(batch.slot_mapping, block_size, rounding_mode="floor").tolist())
        draft_passes.append((int(batch.input_ids.numel()), blocks == {scratch}))

    engine.runner.model.register_forward_hook(count_target)
    drafting = getattr(proposer, "model", None)
    if engine.config.speculative_method == "mtp":
        drafting = engine.runner.model.mtp[0]
    drafting.register_forward_pre_hook(count_draft)
    ids = {
        i: engine.add_request(prompt(i), greedy(i), f"p{i}")
        for i in range(len(PROMPT_LENS))
        if owner(layout, i) == rank
    }
    records = []

    def before_step(index: int) -> None:
        if stage_draft and index == STAGE_AT:  # the draft's first and last experts trade slots
            layers = engine.expert_models["draft"].model.moe_layers
            last = layers[0].placement.num_physical - 1  # on the other rank
            row = [last, *range(1, last), 0]
            assert engine.stage_placement(1, [row] * len(layers), model="draft")
            assert engine.draft_stager.wait(TIMEOUT_S)  # ready now: the switch is in this step

    outputs = run_lockstep(
        engine, before_step, after_step=lambda _, r: records.append(r), max_steps=500
    )
    engine.check_integrity()
    tokens = {
        i: [t for o in outputs if o.request_id == ids[i] for t in o.new_token_ids] for i in ids
    }
    target_ring = engine.runner.expert_load
    draft_ring = engine.draft_expert_load
    draft = engine.expert_models.get("draft")
    return dict(
        tokens=tokens,
        records=records,
        counters=engine.lockstep.counters,
        target_passes=target_passes[0],
        draft_passes=draft_passes,
        dispatches=engine.runner.dispatch_stats().calls,
        stats=engine.spec_decode_stats(),
        target_counts=target_ring.counts[: target_ring.step].clone(),
        target_steps=target_ring.step,
        draft_counts=None if draft_ring is None else draft_ring.counts[: draft_ring.step].clone(),
        draft_steps=None if draft_ring is None else draft_ring.step,
        draft_window=None if draft is None else engine.expert_load_window("draft"),
        draft_num_experts=None if draft is None else draft.num_logical,
        draft_version=None if draft is None else draft.stager.running_version,
        draft_slots=None if draft is None else [m.w13.shape[0] for m in draft.model.moe_layers],
        draft_top_k=proposer.model.config.num_experts_per_tok,
        num_passes=proposer.num_passes,
    )


# ----- tests -----
@pytest.fixture(scope="module")
def reference(spec_models: dict[str, Path]) -> dict[int, list[int]]:
    """Speculation off, one rank, every prompt at once."""
    llm = LLM(spec_models["tiny"], EngineConfig(**ENGINE))
    outs = llm.generate(
        [prompt(i) for i in range(len(PROMPT_LENS))], [greedy(i) for i in range(len(PROMPT_LENS))]
    )
    return {i: o.token_ids for i, o in enumerate(outs)}


@pytest.fixture(scope="module")
def ranks(spec_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("dep-spec-out")
    spawn(_worker, WORLD, spec_models, out_dir)
    return load_results(out_dir, "spec", WORLD)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_dep2_greedy_with_speculation_equals_speculation_off(
    ranks: list[dict], reference: dict[int, list[int]], scenario: str
) -> None:
    _, _, layout = SCENARIOS[scenario]
    seen = {}
    for rank, result in enumerate(ranks):
        tokens = result[scenario]["tokens"]
        assert sorted(tokens) == [i for i in range(len(PROMPT_LENS)) if owner(layout, i) == rank]
        seen.update(tokens)
    assert seen == reference
    stats = [r[scenario]["stats"] for r in ranks]
    busy = [s for s, r in zip(stats, ranks, strict=True) if r[scenario]["tokens"]]
    assert all(s.num_verify_steps > 0 and s.num_draft_tokens > 0 for s in busy)
    if layout == "idle":
        assert stats[0].num_verify_steps == 0


def test_self_draft_under_dep2_accepts_every_draft(ranks: list[dict]) -> None:
    for result in ranks:
        stats = result["self2"]["stats"]
        assert stats.num_accepted_per_position == stats.num_drafts_per_position
        assert stats.num_drafts_per_position[1] > 0
        assert stats.acceptance_rate == 1.0


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_lockstep_runs_the_same_passes_on_every_rank(ranks: list[dict], scenario: str) -> None:
    method, k, _ = SCENARIOS[scenario]
    results = [r[scenario] for r in ranks]
    forwards = {r["counters"].forwards for r in results}
    assert len(forwards) == 1
    [steps] = forwards
    for r in results:
        assert r["target_passes"] == steps
        assert r["num_passes"] == (k if method == "mtp" else k + 1)
        assert len(r["draft_passes"]) == steps * r["num_passes"]
    assert len({r["dispatches"] for r in results}) == 1
    # some steps were padded: a rank idle, finished early, or drafting fewer than K
    assert any(scratch for r in results for _, scratch in r["draft_passes"])
    assert any(r["counters"].dummies for r in results)


@pytest.mark.parametrize("scenario", ["draft1", "draft3", "draft1-idle"])
def test_draft_expert_loads_have_their_own_ring(
    ranks: list[dict], spec_models: dict[str, Path], scenario: str
) -> None:
    from pdmesh_engine.config import ModelConfig

    target = ModelConfig.from_dir(spec_models["tiny"])
    draft = ModelConfig.from_dir(spec_models["draft"])
    for r in (rank[scenario] for rank in ranks):
        counts, target_counts = r["draft_counts"], r["target_counts"]
        assert counts.shape[1:] == (len(draft.moe_layer_ids), draft.n_routed_experts)
        assert target_counts.shape[1:] == (len(target.moe_layer_ids), target.n_routed_experts)
        assert r["draft_steps"] == r["target_steps"] == r["counters"].forwards
        real_tokens = sum(n for n, scratch in r["draft_passes"] if not scratch)
        per_layer = counts.sum(dim=(0, 2))
        assert per_layer.tolist() == [real_tokens * r["draft_top_k"]] * len(draft.moe_layer_ids)
        local = torch.tensor([rec.local_tokens for rec in r["records"] if rec.ran_forward])
        assert target_counts.sum(-1).tolist() == [
            [n * target.num_experts_per_tok] * len(target.moe_layer_ids) for n in local.tolist()
        ]
        window_steps, _, window = r["draft_window"]
        assert window_steps == r["draft_steps"]
        assert window == counts.sum(0).tolist()
        assert r["draft_num_experts"] == draft.n_routed_experts
        # each rank holds 1/2 of the draft's slots
        assert r["draft_slots"] == [draft.n_routed_experts // WORLD] * len(draft.moe_layer_ids)
    # the idle rank routed nothing through the draft; the busy one did
    sums = [int(rank[scenario]["draft_counts"].sum()) for rank in ranks]
    assert sums[1] > 0 and (sums[0] == 0) == scenario.endswith("idle")


def test_a_draft_placement_switches_on_every_rank_at_one_step(ranks: list[dict]) -> None:
    """The self-draft's first and last experts (on different ranks) trade slots mid-run: both ranks
    switch in the same step, the target's placement stays, and every draft is still accepted (the
    moved experts' weights came along)."""
    switched = [
        [k for k, rec in enumerate(rank["self2"]["records"]) if rec.draft_switched_to == 1]
        for rank in ranks
    ]
    assert switched == [[STAGE_AT]] * WORLD
    routed_after = 0
    for rank in ranks:
        result = rank["self2"]
        assert result["draft_version"] == 1
        assert not any(rec.switched_to for rec in result["records"])
        window_steps, _, counts = result["draft_window"]  # restarted at the switch
        assert window_steps == sum(rec.ran_forward for rec in result["records"][STAGE_AT:])
        routed_after += sum(map(sum, counts))
        stats = result["stats"]
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert routed_after > 0
