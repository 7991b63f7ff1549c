"""The decode reservation core, pure: the transition table, each lease decision, and the book that
keeps them."""

from __future__ import annotations

import dataclasses

import pytest

from pdmesh_decode.core import (
    TRANSITIONS,
    Arrived,
    LeaseAction,
    Reservation,
    ReservationBook,
    ReservationEvent,
    ReservationState,
    check_move,
    decide,
)
from pdmesh_service.errors import FailedPrecondition, NotFound

State, Event, Action = ReservationState, ReservationEvent, LeaseAction
LEASE_S, CAP_S, NOW = 10.0, 30.0, 100.0


def reservation(
    state: ReservationState = State.PUBLISHED, arrived: Arrived = Arrived.NOTHING
) -> Reservation:
    return Reservation(
        "r",
        num_blocks=2,
        num_prompt_tokens=12,
        lease_s=LEASE_S,
        cap_s=CAP_S,
        serial=1,
        state=state,
        arrived=arrived,
    )


LIVE = [s for s in State if not s.is_final]


# ----- the table -----
def test_final_states_are_the_three_ends_and_every_live_state_can_admit_or_cancel() -> None:
    assert {s for s in State if s.is_final} == {State.ADMITTED, State.DROPPED, State.CANCELLED}
    for state in LIVE:
        assert {State.ADMITTED, State.CANCELLED} <= TRANSITIONS[state]


def test_the_graph_has_no_cycle() -> None:
    def reachable(state: ReservationState) -> set[ReservationState]:
        found: set[ReservationState] = set()
        todo = list(TRANSITIONS[state])
        while todo:
            s = todo.pop()
            if s not in found:
                found.add(s)
                todo.extend(TRANSITIONS[s])
        return found

    for state in State:
        assert state not in reachable(state), state


@pytest.mark.parametrize(
    "old,new",
    [
        (State.HELD, State.EXPIRING),
        (State.PUBLISHED, State.LAPSING),
        (State.EXTENDED, State.EXPIRING),
        (State.LAPSING, State.EXTENDED),
        (State.ADMITTED, State.CANCELLED),
        (State.DROPPED, State.PUBLISHED),
    ],
)
def test_illegal_moves_raise(old: ReservationState, new: ReservationState) -> None:
    with pytest.raises(FailedPrecondition, match=f"from {old.name} to {new.name}"):
        check_move(old, new)


@pytest.mark.parametrize(
    "state,event",
    [
        (State.PUBLISHED, Event.PUBLISHED),  # published twice
        (State.HELD, Event.DEADLINE),  # no lease runs before it is published
        (State.EXPIRING, Event.DEADLINE),  # nor while the kvstore is asked
        (State.PUBLISHED, Event.KV_MAY_ARRIVE),  # an answer nobody asked for
        (State.EXTENDED, Event.KV_WONT_ARRIVE),
        (State.LAPSING, Event.KV_MAY_ARRIVE),  # the cap passed: no second extension
    ],
)
def test_events_the_state_does_not_allow_raise(
    state: ReservationState, event: ReservationEvent
) -> None:
    with pytest.raises(FailedPrecondition):
        decide(reservation(state), event, NOW)


@pytest.mark.parametrize("state", [State.ADMITTED, State.DROPPED, State.CANCELLED])
def test_a_final_reservation_takes_no_event(state: ReservationState) -> None:
    for event in Event:
        with pytest.raises(FailedPrecondition):
            decide(reservation(state), event, NOW)


# ----- the decisions -----
def test_publishing_starts_the_lease() -> None:
    decision = decide(reservation(State.HELD), Event.PUBLISHED, NOW)
    assert (decision.reservation.state, decision.action, decision.until) == (
        State.PUBLISHED,
        Action.WAIT,
        NOW + LEASE_S,
    )


@pytest.mark.parametrize(
    "first,second",
    [(Event.KV_ARRIVED, Event.DECODE_CALLED), (Event.DECODE_CALLED, Event.KV_ARRIVED)],
)
@pytest.mark.parametrize("state", LIVE)
def test_admitted_once_both_the_kv_and_the_call_are_in_in_either_order(
    first: ReservationEvent, second: ReservationEvent, state: ReservationState
) -> None:
    one = decide(reservation(state), first, NOW, first_token_id=7)
    assert one.action is Action.KEEP and one.reservation.state is state
    both = decide(one.reservation, second, NOW, first_token_id=7)
    assert both.action is Action.ADMIT and both.reservation.state is State.ADMITTED
    assert both.reservation.first_token_id == 7 and both.reservation.arrived == Arrived.BOTH


def test_a_second_decode_call_raises_and_a_repeated_notification_changes_nothing() -> None:
    called = decide(reservation(), Event.DECODE_CALLED, NOW, first_token_id=3).reservation
    with pytest.raises(FailedPrecondition, match="already being decoded"):
        decide(called, Event.DECODE_CALLED, NOW, first_token_id=4)
    landed = reservation(arrived=Arrived.KV)
    assert decide(landed, Event.KV_ARRIVED, NOW) == decide(landed, Event.KV_ARRIVED, NOW)
    assert decide(landed, Event.KV_ARRIVED, NOW).reservation == landed


def test_lease_out_without_the_kv_asks_the_kvstore() -> None:
    decision = decide(reservation(), Event.DEADLINE, NOW)
    assert (decision.reservation.state, decision.action) == (State.EXPIRING, Action.ASK_KVSTORE)


def test_lease_out_with_the_kv_in_waits_for_the_call_until_the_cap() -> None:
    decision = decide(reservation(arrived=Arrived.KV), Event.DEADLINE, NOW)
    assert (decision.reservation.state, decision.action, decision.until) == (
        State.EXTENDED,
        Action.WAIT,
        NOW + CAP_S,
    )


def test_claimed_waits_until_the_cap_unclaimed_is_dropped() -> None:
    claimed = decide(reservation(State.EXPIRING), Event.KV_MAY_ARRIVE, NOW)
    assert (claimed.reservation.state, claimed.action, claimed.until) == (
        State.EXTENDED,
        Action.WAIT,
        NOW + CAP_S,
    )
    unclaimed = decide(reservation(State.EXPIRING), Event.KV_WONT_ARRIVE, NOW)
    assert (unclaimed.reservation.state, unclaimed.action) == (State.DROPPED, Action.DROP)


def test_the_cap_ends_the_claimed_record_then_drops() -> None:
    lapsing = decide(reservation(State.EXTENDED), Event.DEADLINE, NOW)
    assert (lapsing.reservation.state, lapsing.action) == (State.LAPSING, Action.END_CLAIMED)
    dropped = decide(lapsing.reservation, Event.KV_WONT_ARRIVE, NOW)
    assert (dropped.reservation.state, dropped.action) == (State.DROPPED, Action.DROP)


@pytest.mark.parametrize(
    "state,arrived,action",
    [
        (State.HELD, Arrived.NOTHING, Action.FREE),  # nobody knew the blocks
        (State.HELD, Arrived.CALL, Action.FREE),
        (
            State.PUBLISHED,
            Arrived.KV,
            Action.END_AND_FREE,
        ),  # the WRITE landed: nothing else can come
        (State.EXTENDED, Arrived.KV, Action.END_AND_FREE),
        (State.PUBLISHED, Arrived.NOTHING, Action.QUARANTINE),  # a WRITE may be in flight
        (State.PUBLISHED, Arrived.CALL, Action.QUARANTINE),
        (State.EXPIRING, Arrived.NOTHING, Action.QUARANTINE),
        (State.EXTENDED, Arrived.NOTHING, Action.QUARANTINE),
        (State.LAPSING, Arrived.NOTHING, Action.QUARANTINE),
    ],
)
def test_cancel_frees_or_quarantines(
    state: ReservationState, arrived: Arrived, action: LeaseAction
) -> None:
    decision = decide(reservation(state, arrived), Event.CANCELLED, NOW)
    assert decision.reservation.state is State.CANCELLED and decision.action is action
    assert decision.until == (NOW + CAP_S if action is Action.QUARANTINE else None)


def test_a_reservation_needs_blocks_a_prompt_and_positive_times() -> None:
    for bad in (dict(num_blocks=0), dict(num_prompt_tokens=0), dict(lease_s=0.0), dict(cap_s=-1.0)):
        with pytest.raises(ValueError):
            dataclasses.replace(reservation(), **bad)


# ----- the book -----
def test_the_book_keeps_one_deadline_per_waiting_reservation_and_forgets_final_ones() -> None:
    book = ReservationBook()
    book.add(reservation(State.HELD))
    with pytest.raises(FailedPrecondition, match="already reserved"):
        book.add(reservation(State.HELD))
    book.apply("r", Event.PUBLISHED, NOW)
    assert book.leases.deadline("r") == NOW + LEASE_S
    book.apply("r", Event.DECODE_CALLED, NOW + 1, first_token_id=5)
    assert book.leases.deadline("r") == NOW + LEASE_S  # KEEP: the lease goes on
    assert book.due(NOW + LEASE_S) == ["r"]
    book.apply("r", Event.DEADLINE, NOW + LEASE_S)  # EXPIRING: nothing runs while asked
    assert book.leases.deadline("r") is None
    book.apply("r", Event.KV_MAY_ARRIVE, NOW + LEASE_S)
    assert book.leases.deadline("r") == NOW + LEASE_S + CAP_S
    assert book.apply("r", Event.KV_ARRIVED, NOW + 12).action is Action.ADMIT
    assert "r" not in book and book.leases.deadline("r") is None and book.due(1e9) == []
    with pytest.raises(NotFound):
        book.apply("r", Event.KV_ARRIVED, NOW + 13)


def test_a_cancelled_reservation_leaves_the_book_and_its_id_can_be_reserved_again() -> None:
    book = ReservationBook()
    book.add(reservation(State.HELD))
    book.apply("r", Event.PUBLISHED, NOW)
    assert book.apply("r", Event.CANCELLED, NOW).action is Action.QUARANTINE
    assert "r" not in book and book.due(1e9) == []
    book.add(dataclasses.replace(reservation(State.HELD), serial=2))
    assert book.get("r").serial == 2
    with pytest.raises(ValueError, match="HELD"):
        book.add(dataclasses.replace(reservation(), request_id="published"))
