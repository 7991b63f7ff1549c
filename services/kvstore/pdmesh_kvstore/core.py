"""The kvstore's policies over hand-off records, pure (no gRPC, Redis or clock): opening a record,
the compare-and-set guard, legal moves and how long a record lives. The record and its state machine
are `pdmesh_service.handoff` (decode and prefill share them).
"""

from __future__ import annotations

from dataclasses import replace

from pdmesh_service.errors import FailedPrecondition, InvalidArgument
from pdmesh_service.handoff import (
    DEFAULT_GRACE_MS,
    MAX_LEASE_MS,
    TERMINAL,
    Handoff,
    HandoffState,
    check_transition,
)

__all__ = [
    "DEFAULT_GRACE_MS",
    "MAX_LEASE_MS",
    "TERMINAL",
    "Handoff",
    "HandoffState",
    "advance",
    "check_expected",
    "open_handoff",
    "ttl_ms",
]


def open_handoff(
    request_id: str, decode_instance: str, num_blocks: int, lease_ms: int, now_ms: int
) -> Handoff:
    """A new RESERVED hand-off; InvalidArgument for an empty id or instance, no blocks or a lease of
    0."""
    if not request_id:
        raise InvalidArgument("request_id must not be empty")
    if not decode_instance:
        raise InvalidArgument("decode_instance must not be empty")
    if num_blocks < 1:
        raise InvalidArgument(f"num_blocks must be >= 1, got {num_blocks}")
    if not 0 < lease_ms <= MAX_LEASE_MS:
        raise InvalidArgument(f"lease_ms must be in (0, {MAX_LEASE_MS}], got {lease_ms}")
    return Handoff(
        request_id, HandoffState.RESERVED, decode_instance, "", num_blocks, lease_ms, now_ms
    )


def check_expected(handoff: Handoff, expected: HandoffState | None) -> None:
    """Compare-and-set guard: FailedPrecondition unless the record is in `expected` (None: any
    state)."""
    if expected is not None and handoff.state != expected:
        raise FailedPrecondition(
            f"the hand-off of request {handoff.request_id!r} is {handoff.state.name}, "
            f"not {expected.name}"
        )


def advance(handoff: Handoff, new: HandoffState, prefill_instance: str, now_ms: int) -> Handoff:
    """The hand-off moved to `new` (FailedPrecondition if illegal); a non-empty prefill_instance is
    recorded. Moving to the current state returns `handoff` itself (idempotent: nothing changes, not
    even updated_ms)."""
    if new == handoff.state:
        return handoff
    check_transition(handoff.state, new)
    return replace(
        handoff,
        state=new,
        prefill_instance=prefill_instance or handoff.prefill_instance,
        updated_ms=now_ms,
    )


def ttl_ms(handoff: Handoff, retention_ms: int, grace_ms: int = DEFAULT_GRACE_MS) -> int:
    """How long the record lives from its last change: the lease plus a grace period while live (the
    state machine, not Redis expiry, ends a reservation: decode moves it to EXPIRED), the retention
    once final."""
    return retention_ms if handoff.state.terminal else handoff.lease_ms + grace_ms
