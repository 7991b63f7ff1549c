"""The controller's policy core, pure: reports + placement in, Rebalance | Skip out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pdmesh_eplb.controller import (
    ModelView,
    Policy,
    Rebalance,
    Skip,
    decide,
    logical_loads,
    window_of,
)
from pdmesh_eplb.planner import window_balancedness
from pdmesh_service.eplb_protocol import LoadReport, Placement, identity_placement

E, S, R, L = 8, 4, 4, 2  # experts, redundant slots, ranks, MoE layers; P = 12, 3 slots per rank
POLICY = Policy(window_steps=100, step_interval=300, min_gain=0.01, move_budget=0.5)


def _zipf_loads(num_layers: int = L, num_experts: int = E, seed: int = 0) -> np.ndarray:
    """[L, E] skewed logical loads, a different ranking per layer."""
    rng = np.random.default_rng(seed)
    base = 1000.0 / np.arange(1, num_experts + 1) ** 1.2
    return np.stack([rng.permutation(base) for _ in range(num_layers)])


def _slot_counts(loads: np.ndarray, p2l: np.ndarray) -> np.ndarray:
    """[L, P] counts that map back to `loads`: an expert's tokens split evenly over its replicas."""
    rows = np.arange(len(p2l))[:, None]
    replicas = np.zeros(loads.shape, dtype=np.int64)
    np.add.at(replicas, (rows, p2l), 1)
    return np.rint(loads[rows, p2l] / replicas[rows, p2l]).astype(np.int64)


def _reports(
    loads: np.ndarray,
    placement: Placement | None = None,
    *,
    num_ranks: int = R,
    version: int = 0,
    model: str = "target",
    **kw: Any,
) -> tuple[LoadReport, ...]:
    """What each rank reports: every rank routed 1/num_ranks of the tokens (rank 0 takes the
    remainder)."""
    num_logical = loads.shape[1]
    p2l = (
        np.asarray(placement.physical_to_logical)
        if placement is not None
        else np.tile(np.arange(num_logical + S) % num_logical, (len(loads), 1))
    )
    total = _slot_counts(loads, p2l)
    share = total // num_ranks
    fields: dict[str, Any] = dict(step=1000, window_steps=100, switch_step=0)
    fields.update(kw)
    return tuple(
        LoadReport(
            "decode-1",
            model,
            rank,
            num_ranks,
            running_version=version,
            staged_version=version,
            slot_counts=(total - share * (num_ranks - 1) if rank == 0 else share).tolist(),
            num_logical=num_logical,
            **fields,
        )
        for rank in range(num_ranks)
    )


def _view(reports: tuple[LoadReport, ...], placement: Placement | None = None) -> ModelView:
    return ModelView("decode-1", reports[0].model if reports else "target", reports, placement)


def test_logical_loads_sum_slots_through_the_placement() -> None:
    p2l = np.array([[0, 1, 0, 2], [2, 2, 1, 0]])
    counts = np.array([[5, 1, 3, 7], [1, 2, 3, 4]])
    assert logical_loads(counts, p2l, 3).tolist() == [[8, 1, 7], [4, 3, 3]]


def test_window_sums_the_ranks_and_recovers_the_logical_loads() -> None:
    loads = _zipf_loads()
    window = window_of(_view(_reports(loads)))
    assert not isinstance(window, Skip)
    assert window.num_ranks == R and window.num_redundant == S and window.num_ranks_reporting == R
    assert np.allclose(window.loads, loads, atol=E)  # rounding of the even split only
    assert window.placement == identity_placement("decode-1", "target", R, L, E + S, E)


def test_a_skewed_window_due_for_its_interval_gets_a_better_placement() -> None:
    loads = _zipf_loads()
    decision = decide(_view(_reports(loads)), POLICY, "interval")
    assert isinstance(decision, Rebalance)
    p2l = decision.plan.physical_to_logical
    assert decision.version == 1 and decision.reason == "interval"
    assert decision.balancedness_after == pytest.approx(
        window_balancedness(loads, p2l, R), abs=0.01
    )
    assert decision.gain >= POLICY.min_gain and decision.balancedness_after > 0.8
    assert 0 < decision.num_slots_moved <= L * int(POLICY.move_budget * (E + S))
    assert all(set(row) == set(range(E)) for row in p2l.tolist())  # every expert kept
    placement = decision.placement(created_ms=7)
    assert placement.version == 1 and placement.physical_to_logical == p2l.tolist()
    record = decision.record(created_ms=7, plan_ms=2.5)
    assert record.num_bytes_moved == 0 and record.num_slots_moved == decision.num_slots_moved


def test_bytes_moved_follow_the_reported_expert_size() -> None:
    decision = decide(_view(_reports(_zipf_loads(), expert_bytes=3000)), POLICY, "manual")
    assert isinstance(decision, Rebalance)
    assert decision.record(0, 0.0).num_bytes_moved == 3000 * decision.num_slots_moved


def test_a_balanced_window_is_not_churned_unless_forced() -> None:
    # identity replicates experts 0..S-1: twice their load puts 120 tokens on every slot
    even = np.tile(np.where(np.arange(E) < S, 240.0, 120.0), (L, 1))
    skip = decide(_view(_reports(even)), POLICY, "interval")
    assert isinstance(skip, Skip) and "no move improves" in skip.reason
    slight = even + np.arange(E)  # some gain exists, below the minimum
    view = _view(_reports(slight))
    skip = decide(view, Policy(window_steps=100, step_interval=300, min_gain=0.5), "manual")
    assert isinstance(skip, Skip) and "below the minimum" in skip.reason
    forced = decide(
        view, Policy(window_steps=100, step_interval=300, min_gain=0.5), "manual", force=True
    )
    assert isinstance(forced, Rebalance) and forced.gain > 0


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(window_steps=99), "window holds 99"),
        (dict(step=1000, switch_step=800), "ran 200 of 300"),
    ],
)
def test_periodic_rebalance_waits_for_the_window_and_the_interval(
    kw: dict[str, Any], words: str
) -> None:
    view = _view(_reports(_zipf_loads(), **kw))
    skip = decide(view, POLICY, "interval")
    assert isinstance(skip, Skip) and words in skip.reason
    manual = decide(view, POLICY, "manual")  # waits for the window, not for the interval
    assert isinstance(manual, Skip) if "window" in words else isinstance(manual, Rebalance)
    assert isinstance(decide(view, POLICY, "manual", force=True), Rebalance)


def test_off_stops_periodic_but_not_manual_rebalances() -> None:
    view = _view(_reports(_zipf_loads()))
    skip = decide(view, POLICY, "interval", is_enabled=False)
    assert isinstance(skip, Skip) and "off" in skip.reason
    assert isinstance(decide(view, POLICY, "manual", is_enabled=False), Rebalance)


def _version_one(loads: np.ndarray) -> Placement:
    first = decide(_view(_reports(loads)), POLICY, "manual")
    assert isinstance(first, Rebalance)
    return first.placement(created_ms=1)


def test_ranks_behind_the_published_version_are_skipped_until_they_catch_up() -> None:
    loads = _zipf_loads()
    placement = _version_one(loads)
    old = _reports(loads)  # all still on version 0
    skip = decide(_view(old, placement), POLICY, "manual")
    assert isinstance(skip, Skip) and "waiting for the ranks to switch to version 1" in skip.reason
    new = _reports(loads, placement, version=1)
    mixed = (new[0], *old[1:])
    window = window_of(_view(mixed, placement))
    assert not isinstance(window, Skip) and window.num_ranks_reporting == 1
    # counts recorded under version 1 map back through version 1's placement
    assert np.allclose(window_of(_view(new, placement)).loads, loads, atol=E)  # type: ignore[union-attr]


def test_a_rank_ahead_of_redis_blocks_planning() -> None:
    skip = decide(_view(_reports(_zipf_loads(), version=3)), POLICY, "manual", force=True)
    assert isinstance(skip, Skip) and "newer than the published 0" in skip.reason


def test_reports_that_disagree_on_the_shape_are_not_planned() -> None:
    a = _reports(_zipf_loads())
    b = _reports(_zipf_loads(num_layers=3))
    skip = decide(_view((a[0], b[1])), POLICY, "manual")
    assert isinstance(skip, Skip) and "different shapes" in skip.reason
    assert isinstance(decide(_view(()), POLICY, "manual"), Skip)


def test_two_models_of_different_shapes_plan_independently() -> None:
    target = decide(_view(_reports(_zipf_loads(3, 16, seed=1))), POLICY, "manual")
    draft = decide(_view(_reports(_zipf_loads(1, 8, seed=2), model="draft")), POLICY, "manual")
    assert isinstance(target, Rebalance) and isinstance(draft, Rebalance)
    assert target.plan.physical_to_logical.shape == (3, 16 + S)
    assert draft.plan.physical_to_logical.shape == (1, 8 + S)


@pytest.mark.parametrize(
    "bad",
    [
        dict(window_steps=0),
        dict(step_interval=0),
        dict(min_gain=-0.1),
        dict(move_budget=0.0),
        dict(move_budget=1.5),
    ],
)
def test_policy_rejects_nonsense(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Policy(**bad)
