"""The controller over an elastic DEP instance that re-formed with fewer ranks: it plans over the
live group (the newest reports' size), not the published version's shape, and ignores the lost
rank's lingering report."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pdmesh_eplb.controller import ModelView, Policy, Rebalance, decide, window_of
from pdmesh_service.eplb_protocol import LoadReport, Placement

E, L = 8, 2
POLICY = Policy(window_steps=10, step_interval=10, min_gain=0.0, move_budget=1.0)


def _report(rank: int, size: int, num_slots: int, version: int, created_ms: int) -> LoadReport:
    rng = np.random.default_rng(rank)
    counts = rng.integers(0, 50, size=(L, num_slots)).tolist()
    return LoadReport(
        "decode-1", "target", rank, size, 1000, 100, version, version, counts, E,
        switch_step=0, created_ms=created_ms,
    )  # fmt: skip


def test_a_reformed_group_is_planned_over_its_live_ranks() -> None:
    published = Placement("decode-1", "target", 3, 4, [[s % E for s in range(8)]] * L)
    stale = _report(3, 4, 8, 3, created_ms=1)  # the lost rank's last report
    live = tuple(_report(r, 3, 9, 3, created_ms=10 + r) for r in range(3))
    view = ModelView("decode-1", "target", (*live, stale), published)
    window = window_of(view)
    assert not hasattr(window, "reason"), window
    assert window.num_ranks == 3 and window.placement.version == 3  # type: ignore[union-attr]
    decision = decide(view, POLICY, "manual", force=True)
    assert isinstance(decision, Rebalance) and decision.version == 4
    assert len(decision.plan.physical_to_logical[0]) == 9


def test_a_group_of_the_published_shape_is_unchanged() -> None:
    published = Placement("decode-1", "target", 2, 4, [[s % E for s in range(8)]] * L)
    reports = tuple(_report(r, 4, 8, 2, created_ms=10) for r in range(4))
    window = window_of(ModelView("decode-1", "target", reports, published))
    assert window.placement == published  # type: ignore[union-attr]
    old = replace(reports[0], running_version=1)
    skip = window_of(ModelView("decode-1", "target", (old,), published))
    assert hasattr(skip, "reason")
