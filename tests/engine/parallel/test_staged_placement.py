"""Staged expert placements (EPLB on the ranks): background staging, a switch at one step boundary.

- single rank: staging runs in a thread while steps go on (held open by a gate), the switch happens
  inside the first `step()` after it finished, only the changed slots are staged (counted), the MTP
  layer keeps its placement, the load ring restarts, greedy tokens equal a run without the switch;
  version rules; a newer request cancels a running one;
- the DP-sync rule (`agreed_version`) on its own;
- DEP2 in processes (gloo on loopback): ranks staging at different steps switch in the same step,
  with experts moving between ranks (read from the checkpoint) and within one (copied); one rank
  staged → no switch; different versions staged → no switch.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.llm import run_lockstep
from pdmesh_engine.parallel.dep import DEPConfig, agreed_version, init_dep, shutdown_dep
from pdmesh_engine.parallel.placement import CheckpointTensors, expert_tensor_name

ENGINE = dict(num_blocks=64, block_size=16, num_threads=1)
PROMPTS = [[(13 * i + 7 * j) % 900 + 4 for j in range(5 + 6 * i)] for i in range(4)]
MAX_TOKENS = [24, 18, 30, 12]
TIMEOUT_S = 120.0
REDUNDANT = 2  # DEP2: 8 experts + 2 redundant slots = 5 slots per rank


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("eplb") / "skewed",
        preset="tiny",
        seed=3,
        verbose=False,
        expert_skew=1.2,
    )


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    """Greedy tokens of every prompt on the plain engine, no placement change."""
    llm = LLM(model_dir, EngineConfig(**ENGINE))
    return [o.token_ids for o in llm.generate(PROMPTS, [greedy(i) for i in range(len(PROMPTS))])]


def target_rows(engine: EngineCore) -> list[list[int]]:
    return [moe.slot_experts for moe in engine.runner.model.moe_layers]


def changed_rows(engine: EngineCore) -> tuple[list[list[int]], int]:
    """Layer 0: experts 0 and 3 trade slots; layer 1: slots 1, 2, 5 rotate; the rest unchanged."""
    rows = target_rows(engine)
    rows[0][0], rows[0][3] = rows[0][3], rows[0][0]
    if len(rows) > 1:
        rows[1][1], rows[1][2], rows[1][5] = rows[1][2], rows[1][5], rows[1][1]
    return rows, 2 + (3 if len(rows) > 1 else 0)


def gate_staging(engine: EngineCore) -> threading.Event:
    """Hold the staging thread at its first layer until the returned event is set."""
    release = threading.Event()
    original = engine.stager._stage_layer

    def gated(*args):
        if not release.wait(TIMEOUT_S):
            raise TimeoutError("the test never released the staging gate")
        return original(*args)

    engine.stager._stage_layer = gated
    return release


def collect(outputs, into: dict[str, list[int]]) -> None:
    for output in outputs:
        into.setdefault(output.request_id, []).extend(output.new_token_ids)


# ----- single rank -----
def test_single_rank_stages_in_background_and_switches_at_a_step_boundary(
    model_dir: Path, reference: list[list[int]]
) -> None:
    engine = EngineCore(model_dir, EngineConfig(**ENGINE))
    mtp_before = [m.block.mlp.slot_experts for m in engine.runner.model.mtp]
    ids = [engine.add_request(p, greedy(i)) for i, p in enumerate(PROMPTS)]
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        collect(engine.step(), tokens)
    rows, num_changed = changed_rows(engine)
    release = gate_staging(engine)
    assert engine.stage_placement(1, rows)
    produced = sum(len(t) for t in tokens.values())
    for _ in range(4):  # staging is held open: steps go on, nothing switches
        collect(engine.step(), tokens)
        assert (
            engine.stager.is_staging
            and engine.placement_version == 0
            and engine.staged_version == 0
        )
    assert sum(len(t) for t in tokens.values()) > produced
    release.set()
    assert engine.stager.wait(TIMEOUT_S)
    assert (engine.placement_version, engine.staged_version) == (0, 1)  # staged, not yet switched
    assert engine.expert_load_window()[0] == 7
    collect(engine.step(), tokens)  # the switch happens inside this step, before its forward
    assert engine.placement_version == 1
    steps, window, counts = engine.expert_load_window()
    # the ring restarted at the switch
    assert (steps, window) == (1, engine.config.expert_load_window)
    assert [sum(layer) for layer in counts] == [sum(layer) for layer in counts[:1]] * len(counts)
    assert target_rows(engine) == rows
    stats = engine.last_staging
    assert (
        stats.version,
        stats.num_changed_slots,
        stats.num_copied,
        stats.num_from_checkpoint,
    ) == (1, num_changed, num_changed, 0)  # one rank holds every expert: all copies, no reads
    assert [m.block.mlp.slot_experts for m in engine.runner.model.mtp] == mtp_before
    moe, width = engine.runner.model.moe_layers[0], engine.runner.model.moe_layers[0].w2.shape[2]
    gate = CheckpointTensors(model_dir)(
        expert_tensor_name(engine.model_config.moe_layer_ids[0], rows[0][0], "gate_proj")
    )
    # slot 0 now computes expert 3
    assert torch.equal(moe.w13.data[0, :width], gate.to(moe.w13.dtype))
    while engine.has_unfinished:
        collect(engine.step(), tokens)
    assert [tokens[i] for i in ids] == reference


def test_stage_placement_version_and_shape_rules(model_dir: Path) -> None:
    engine = EngineCore(model_dir, EngineConfig(**ENGINE))
    rows, _ = changed_rows(engine)
    assert not engine.stage_placement(0, rows)  # not newer than the running version
    assert not engine.stage_placement(1, rows[:-1])  # one row short
    assert not engine.stage_placement(1, [r + [0] for r in rows])  # a slot too many
    with pytest.raises(ValueError, match="no slot"):
        engine.stage_placement(1, [[0] * len(r) for r in rows])
    assert engine.stage_placement(2, rows)
    assert not engine.stage_placement(2, rows)  # already staging / staged
    assert engine.stager.wait(TIMEOUT_S) and engine.staged_version == 2
    assert not engine.stage_placement(1, rows)
    back = target_rows(engine)  # v3: the initial rows again, replaces v2
    assert engine.stage_placement(3, back)
    assert engine.stager.wait(TIMEOUT_S) and engine.staged_version == 3
    engine.step()  # no request: the switch still happens
    assert engine.placement_version == 3 and target_rows(engine) == back
    assert engine.last_staging.num_changed_slots == 0  # v3 was staged against v0's slots


def test_a_newer_request_cancels_a_running_stage(model_dir: Path) -> None:
    engine = EngineCore(model_dir, EngineConfig(**ENGINE))
    rows, _ = changed_rows(engine)
    release = gate_staging(engine)
    assert engine.stage_placement(1, rows)
    assert engine.stager.is_staging
    # v1 is cancelled; v2 waits for its thread
    assert engine.stage_placement(2, target_rows(engine))
    release.set()
    assert engine.stager.wait(TIMEOUT_S)
    assert engine.staged_version == 2 and engine.last_staging.version == 2
    engine.step()
    assert engine.placement_version == 2 and target_rows(engine) == [
        m.slot_experts for m in engine.runner.model.moe_layers
    ]


def test_agreed_version_needs_every_rank_on_the_same_version() -> None:
    def sums(versions: list[int]) -> tuple[int, int, int, int]:
        return (
            sum(v > 0 for v in versions),
            sum(versions),
            sum(v * v for v in versions),
            len(versions),
        )

    assert agreed_version(*sums([4, 4, 4])) == 4
    assert agreed_version(*sums([4, 4, 0])) == 0  # one rank has nothing ready
    assert agreed_version(*sums([1, 3, 2])) == 0  # sum == 3 * 2, but the versions differ
    assert agreed_version(*sums([1, 3])) == 0
    assert agreed_version(*sums([0, 0])) == 0
    assert agreed_version(*sums([7])) == 7


# ----- DEP2 in processes -----
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dep_rows(num_layers: int) -> list[list[int]]:
    """Initial [0..7, 0, 1]; experts 0 and 7 trade slots across ranks, slot 9 (rank 1) takes expert
    3."""
    row = [7, 1, 2, 3, 4, 5, 6, 0, 0, 3]
    return [list(row) for _ in range(num_layers)]


# rank -> {step index: version staged at that boundary}
SCENARIOS: dict[str, dict[int, dict[int, int]]] = {
    "staggered": {0: {2: 1}, 1: {7: 1}},
    "one_rank": {0: {2: 1}, 1: {}},
    "different": {0: {2: 1}, 1: {3: 2}},
}


def _dep_worker(rank: int, world: int, port: int, model_dir: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)
    context = init_dep(
        DEPConfig(
            rank, world, master_port=port, timeout_s=TIMEOUT_S, num_redundant_experts=REDUNDANT
        )
    )
    results = {
        name: _run_scenario(rank, world, model_dir, context, plan[rank])
        for name, plan in SCENARIOS.items()
    }
    torch.save(results, out_dir / f"staged-{rank}.pt")
    shutdown_dep()


def _run_scenario(rank: int, world: int, model_dir: Path, context, plan: dict[int, int]) -> dict:
    engine = EngineCore(model_dir, EngineConfig(**ENGINE), dep=context)
    mine = [i for i in range(len(PROMPTS)) if i % world == rank]
    ids = {i: engine.add_request(PROMPTS[i], greedy(i), f"p{i}") for i in mine}
    rows = dep_rows(len(engine.runner.model.moe_layers))
    versions: list[int] = []

    def before_step(index: int) -> None:
        if index in plan:
            assert engine.stage_placement(plan[index], rows)
            assert engine.stager.wait(TIMEOUT_S)  # ready from this step on (deterministic)

    records = []
    outputs = run_lockstep(
        engine,
        before_step,
        lambda _, r: (records.append(r), versions.append(engine.placement_version)),
        max_steps=500,
    )
    tokens = {
        i: [t for o in outputs if o.request_id == ids[i] for t in o.new_token_ids] for i in ids
    }
    return dict(
        tokens=tokens,
        switched=[(k, r.switched_to) for k, r in enumerate(records) if r.switched_to],
        versions=versions,
        staged=engine.staged_version,
        running=engine.placement_version,
        stats=engine.last_staging,
        rows=target_rows(engine),
        window=engine.expert_load_window()[0],
        forwards=[r.ran_forward for r in records],
    )


@pytest.fixture(scope="module")
def dep2(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("staged-dep2")
    mp.spawn(_dep_worker, args=(2, _free_port(), model_dir, out_dir), nprocs=2, join=True)
    return [torch.load(out_dir / f"staged-{rank}.pt", weights_only=False) for rank in range(2)]


def test_dep2_ranks_staging_at_different_steps_switch_in_the_same_step(
    dep2: list[dict], reference: list[list[int]]
) -> None:
    runs = [result["staggered"] for result in dep2]
    # the step the later rank staged before
    assert runs[0]["switched"] == runs[1]["switched"] == [(7, 1)]
    for run in runs:
        assert run["versions"][:7] == [0] * 7 and set(run["versions"][7:]) == {1}
        assert run["running"] == run["staged"] == 1
        assert run["rows"] == dep_rows(len(run["rows"]))
        assert run["window"] == sum(run["forwards"][7:]) > 0  # the ring restarted at the switch
        for i, tokens in run["tokens"].items():
            assert tokens == reference[i]
    first, second = runs[0]["stats"], runs[1]["stats"]
    layers = len(runs[0]["rows"])
    # rank 0 (slots 0-4): slot 0 takes expert 7, held by rank 1 only -> read from the checkpoint
    assert (first.num_changed_slots, first.num_copied, first.num_from_checkpoint) == (
        layers,
        0,
        layers,
    )
    # rank 1 (slots 5-9): slot 7 takes expert 0 (also in its slot 8: a copy), slot 9 expert 3 (a
    # read)
    assert (second.num_changed_slots, second.num_copied, second.num_from_checkpoint) == (
        2 * layers,
        layers,
        layers,
    )


@pytest.mark.parametrize("scenario", ["one_rank", "different"])
def test_dep2_no_switch_unless_every_rank_staged_the_same_version(
    dep2: list[dict], reference: list[list[int]], scenario: str
) -> None:
    runs = [result[scenario] for result in dep2]
    for run in runs:
        assert run["switched"] == [] and run["running"] == 0 and set(run["versions"]) == {0}
        for i, tokens in run["tokens"].items():
            assert tokens == reference[i]
    assert runs[0]["staged"] == 1
    assert runs[1]["staged"] == (0 if scenario == "one_rank" else 2)
