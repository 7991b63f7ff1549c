"""Property tests of the EPLB records on the wire and in Redis: every valid placement, rebalance
record, load report and summary survives eplb.proto (`pdmesh_eplb.convert`) and its JSON form
(`eplb_protocol`) unchanged, and a malformed one is a ValueError at construction."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh_eplb.convert import placement_to_pb, record_to_pb, status_to_pb
from pdmesh_service.eplb_protocol import EplbSummary, LoadReport, Placement, RebalanceRecord

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
NAMES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=":"), min_size=1)
COUNT = st.integers(0, 2**53)  # exact in JSON readers that use doubles too
MS = st.integers(0, 2**53)
FRACTION = st.floats(0, 1)


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """(L, P, R, E): P slots split evenly over R ranks, E logical experts <= P."""
    num_ranks = draw(st.integers(1, 4))
    num_slots = num_ranks * draw(st.integers(1, 4))
    return draw(st.integers(1, 3)), num_slots, num_ranks, draw(st.integers(1, num_slots))


@st.composite
def placements(draw: st.DrawFn) -> Placement:
    layers, slots, ranks, logical = draw(shapes())
    rows = draw(
        st.lists(
            st.lists(st.integers(0, logical - 1), min_size=slots, max_size=slots),
            min_size=layers,
            max_size=layers,
        )
    )
    return Placement(draw(NAMES), draw(NAMES), draw(COUNT), ranks, rows, draw(MS))


RECORDS = st.builds(
    RebalanceRecord,
    version=COUNT,
    created_ms=MS,
    reason=st.sampled_from(["interval", "manual"]),
    num_slots_moved=COUNT,
    num_bytes_moved=COUNT,
    balancedness_before=FRACTION,
    balancedness_after=FRACTION,
    plan_ms=st.floats(0, 1e9),
)


@st.composite
def load_reports(draw: st.DrawFn, shape: tuple[int, int, int, int] | None = None) -> LoadReport:
    layers, slots, ranks, logical = shape or draw(shapes())
    counts = draw(
        st.lists(st.lists(COUNT, min_size=slots, max_size=slots), min_size=layers, max_size=layers)
    )
    switch_step = draw(COUNT)
    running = draw(COUNT)
    return LoadReport(
        instance=draw(NAMES),
        model=draw(st.sampled_from(["target", "draft"])),
        rank=draw(st.integers(0, ranks - 1)),
        dp_size=ranks,
        step=switch_step + draw(COUNT),
        window_steps=draw(COUNT),
        running_version=running,
        staged_version=running + draw(st.integers(0, 2)),
        slot_counts=counts,
        num_logical=logical,
        switch_step=switch_step,
        expert_bytes=draw(COUNT),
        num_nodes=draw(st.integers(1, 8)),
        created_ms=draw(MS),
    )


def _record_of(pb) -> RebalanceRecord:
    return RebalanceRecord(
        **{f.name: getattr(pb, f.name) for f in dataclasses.fields(RebalanceRecord)}
    )


@PROPERTY
@given(placements(), st.lists(RECORDS, max_size=3))
def test_placements_survive_the_wire_and_json(placement: Placement, history) -> None:
    pb = placement_to_pb(placement, history)
    back = Placement(
        pb.instance,
        pb.model,
        pb.version,
        pb.num_ranks,
        [list(layer.logical) for layer in pb.layers],
        pb.created_ms,
    )
    assert back == placement
    assert [_record_of(r) for r in pb.history] == history
    assert Placement.from_json(placement.to_json()) == placement


@PROPERTY
@given(RECORDS)
def test_rebalance_records_survive_the_wire_and_json(record: RebalanceRecord) -> None:
    assert _record_of(record_to_pb(record)) == record
    assert RebalanceRecord.from_json(record.to_json()) == record


@PROPERTY
@given(load_reports())
def test_load_reports_survive_json_with_unknown_keys(report: LoadReport) -> None:
    assert LoadReport.from_json(report.to_json()) == report
    newer = {**json.loads(report.to_json()), "num_gpus": 8, "extra": {"a": [1]}}
    assert LoadReport.from_json(json.dumps(newer)) == report


@PROPERTY
@given(shapes().flatmap(lambda s: st.lists(load_reports(s), min_size=1, max_size=3)))
def test_summaries_reach_the_wire_with_their_shape(reports: list[LoadReport]) -> None:
    first = reports[0]
    summary = EplbSummary(first.instance, first.model, 3, tuple(reports), 0.5, None, None)
    pb = status_to_pb(summary)
    assert (pb.num_layers, pb.num_slots, pb.num_logical, pb.num_ranks) == (
        first.num_layers,
        first.num_slots,
        first.num_logical,
        first.dp_size,
    )
    assert [(r.rank, r.running_version, r.staged_version, r.step) for r in pb.ranks] == [
        (r.rank, r.running_version, r.staged_version, r.step) for r in reports
    ]
    assert pb.has_balancedness and pb.balancedness == 0.5 and not pb.HasField("last_rebalance")
    empty = status_to_pb(EplbSummary("i", "target", 0, (), None, None, True))
    assert not empty.has_balancedness and empty.enabled and empty.num_slots == 0


@PROPERTY
@given(placements(), st.integers(-3, 3), st.integers(0, 2))
def test_a_malformed_placement_is_a_value_error(placement: Placement, version, drop) -> None:
    """Negative versions, ragged rows and slots that do not split over the ranks are refused."""
    rows = [list(r) for r in placement.physical_to_logical]
    rows[-1] = rows[-1][: len(rows[-1]) - drop]
    widths = {len(r) for r in rows}
    width = len(rows[0])
    valid = version >= 0 and len(widths) == 1 and width > 0 and width % placement.num_ranks == 0
    if valid:
        made = Placement("i", "m", version, placement.num_ranks, rows)
        assert made.physical_to_logical == rows
    else:
        with pytest.raises(ValueError):
            Placement("i", "m", version, placement.num_ranks, rows)
