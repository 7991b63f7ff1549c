"""Expert placement as data (slots, replicas, deterministic replica choice) and the expert-load
ring."""

from __future__ import annotations

import pytest
import torch

from pdmesh_engine.model.moe import ExpertLoadRecorder, ExpertPlacement


def test_initial_placement_repeats_experts_in_redundant_slots() -> None:
    placement = ExpertPlacement.initial(4, num_redundant=2)
    assert placement.physical_to_logical.tolist() == [0, 1, 2, 3, 0, 1]
    assert placement.replica_counts.tolist() == [2, 2, 1, 1]
    assert placement.replicas[0].tolist() == [0, 4]


def test_replica_choice_is_deterministic_and_spreads_tokens() -> None:
    placement = ExpertPlacement.initial(4, num_redundant=2)
    ids = torch.tensor([[0, 2]] * 6)
    slots = placement.choose_slots(ids)
    assert torch.equal(slots, placement.choose_slots(ids))
    assert set(slots[:, 0].tolist()) == {0, 4}  # expert 0 alternates between its replicas
    assert set(slots[:, 1].tolist()) == {2}  # expert 2 has one slot
    assert all(
        int(placement.physical_to_logical[s]) == e
        for row, ids_row in zip(slots, ids, strict=True)
        for s, e in zip(row.tolist(), ids_row.tolist(), strict=True)
    )


def test_placement_rejects_a_missing_expert_and_a_bad_slot() -> None:
    with pytest.raises(ValueError, match="no slot"):
        ExpertPlacement.from_slots([0, 0, 1], num_logical=3)
    with pytest.raises(ValueError, match="outside"):
        ExpertPlacement.from_slots([0, 1, 5], num_logical=3)


def test_load_ring_counts_each_step_and_wraps() -> None:
    recorder = ExpertLoadRecorder(num_layers=2, num_physical=4, window=3)
    for step in range(5):  # steps 0..4; the ring keeps 2, 3, 4
        recorder.record(0, torch.tensor([[step % 4, 1]]))
        recorder.record(1, torch.tensor([[3, 3], [0, 2]]))
        recorder.end_step()
    assert recorder.step == 5
    totals = recorder.window_totals()
    assert totals[0].tolist() == [1, 3, 1, 1]  # slots 2, 3, 0 once each, plus slot 1 three times
    assert totals[1].tolist() == [3, 0, 3, 6]
    assert int(recorder.counts[4 % 3, 0].sum()) == 2  # the latest row: one token, top-2


def test_load_ring_rejects_an_empty_window() -> None:
    with pytest.raises(ValueError, match="window"):
        ExpertLoadRecorder(1, 4, window=0)
