"""The KV hand-off record and its state machine, shared by decode, prefill and the kvstore; pure (no
gRPC, Redis, NIXL or clock).

One hand-off per request: decode opens it RESERVED when it holds blocks; prefill moves it to
TRANSFERRING (compare-and-set from RESERVED) right before its WRITE, and may not write otherwise;
decode marks it READY once the KV is in its blocks and CONSUMED when it admits the request. EXPIRED
and CANCELLED end it early. Terminal states (CONSUMED, EXPIRED, CANCELLED) never change again; only
a new `open_handoff` under the same id (a retry) replaces a terminal record.

    RESERVED     → TRANSFERRING | READY | CANCELLED | EXPIRED
    TRANSFERRING → READY | CANCELLED | EXPIRED
    READY        → CONSUMED | CANCELLED | EXPIRED

The graph has no cycle, so "the state is still S" proves no transition happened since S was read
(the store's compare-and-set relies on it). A move to the state the record is already in is a no-op.
`HandoffState` values are the `kvstore.v1.HandoffState` numbers.

A caller's compare-and-set move (`kvstore_client.move_handoff`) ends in one `MoveOutcome`:
`Moved` (from which state), `AlreadyFinal`, `Elsewhere` (live, in a state it did not expect),
`Missing` or `Unknown`; `may_be_written` and `kv_may_still_arrive` turn the state found into
decode's decisions on its blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pdmesh_service.errors import FailedPrecondition, InvalidArgument

MAX_LEASE_MS = 2**32 - 1  # the wire field is a uint32
DEFAULT_GRACE_MS = 30_000  # a live record outlives its lease by this much (see `ttl_ms`)


class HandoffState(enum.IntEnum):
    RESERVED = 1
    TRANSFERRING = 2
    READY = 3
    CONSUMED = 4
    EXPIRED = 5
    CANCELLED = 6

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({HandoffState.CONSUMED, HandoffState.EXPIRED, HandoffState.CANCELLED})
TRANSITIONS: dict[HandoffState, frozenset[HandoffState]] = {
    HandoffState.RESERVED: frozenset(
        {
            HandoffState.TRANSFERRING,
            HandoffState.READY,
            HandoffState.CANCELLED,
            HandoffState.EXPIRED,
        }
    ),
    HandoffState.TRANSFERRING: frozenset(
        {HandoffState.READY, HandoffState.CANCELLED, HandoffState.EXPIRED}
    ),
    HandoffState.READY: frozenset(
        {HandoffState.CONSUMED, HandoffState.CANCELLED, HandoffState.EXPIRED}
    ),
    HandoffState.CONSUMED: frozenset(),
    HandoffState.EXPIRED: frozenset(),
    HandoffState.CANCELLED: frozenset(),
}


def parse_state(value: int | str | HandoffState) -> HandoffState:
    """A state from its number or name ("READY" or "HANDOFF_STATE_READY"); InvalidArgument
    otherwise."""
    try:
        if isinstance(value, str):
            return HandoffState[value.removeprefix("HANDOFF_STATE_")]
        return HandoffState(int(value))
    except (KeyError, ValueError):
        raise InvalidArgument(f"unknown hand-off state {value!r}") from None


def check_transition(old: HandoffState, new: HandoffState) -> None:
    """FailedPrecondition unless `old → new` is in TRANSITIONS."""
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(s.name for s in sorted(TRANSITIONS[old])) or "nothing (final)"
        raise FailedPrecondition(
            f"hand-off cannot go from {old.name} to {new.name} (allowed: {allowed})"
        )


@dataclass(frozen=True)
class Handoff:
    request_id: str
    state: HandoffState
    decode_instance: str
    prefill_instance: str = ""
    num_blocks: int = 0
    lease_ms: int = 0
    updated_ms: int = 0  # wall clock, ms since the Unix epoch

    def to_fields(self) -> dict[str, str]:
        """The Redis hash form (all strings)."""
        return {
            "request_id": self.request_id,
            "state": self.state.name,
            "decode_instance": self.decode_instance,
            "prefill_instance": self.prefill_instance,
            "num_blocks": str(self.num_blocks),
            "lease_ms": str(self.lease_ms),
            "updated_ms": str(self.updated_ms),
        }

    @classmethod
    def from_fields(cls, fields: dict[Any, Any]) -> Handoff:
        """From a Redis hash (bytes or str keys and values)."""
        f = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()
        }
        return cls(
            request_id=f["request_id"],
            state=HandoffState[f["state"]],
            decode_instance=f["decode_instance"],
            prefill_instance=f.get("prefill_instance", ""),
            num_blocks=int(f.get("num_blocks", 0)),
            lease_ms=int(f.get("lease_ms", 0)),
            updated_ms=int(f.get("updated_ms", 0)),
        )

    def message_fields(self) -> dict[str, Any]:
        """Keyword arguments of `kvstore_pb2.Handoff` (its enum takes the same numbers)."""
        return {
            "request_id": self.request_id,
            "state": int(self.state),
            "decode_instance": self.decode_instance,
            "prefill_instance": self.prefill_instance,
            "num_blocks": self.num_blocks,
            "lease_ms": self.lease_ms,
            "updated_ms": self.updated_ms,
        }

    @classmethod
    def from_message(cls, msg: Any) -> Handoff:
        """From a `kvstore_pb2.Handoff` (read by attribute, so this module needs no protobuf)."""
        return cls(
            request_id=msg.request_id,
            state=parse_state(msg.state),
            decode_instance=msg.decode_instance,
            prefill_instance=msg.prefill_instance,
            num_blocks=msg.num_blocks,
            lease_ms=msg.lease_ms,
            updated_ms=msg.updated_ms,
        )


# ----- outcomes of a compare-and-set move (`pdmesh_service.kvstore_client.move_handoff`) -----
@dataclass(frozen=True)
class Moved:
    """This call moved the record from `from_state` to the state it asked for."""

    from_state: HandoffState


@dataclass(frozen=True)
class AlreadyFinal:
    """The record was already final in `state` (someone else ended it); nothing changed."""

    state: HandoffState


@dataclass(frozen=True)
class Elsewhere:
    """The record is live in `state`, which the caller did not expect; nothing changed."""

    state: HandoffState


@dataclass(frozen=True)
class Missing:
    """No record: never opened, or it lapsed (its TTL passed)."""


@dataclass(frozen=True)
class Unknown:
    """No answer: the kvstore stayed unreachable past the retry budget, the record kept changing,
    or a retried attempt may have made the move itself. Callers must assume the worst."""

    reason: str


MoveOutcome = Moved | AlreadyFinal | Elsewhere | Missing | Unknown


def state_found(outcome: MoveOutcome) -> HandoffState | None:
    """The state the record was in when the move was tried: where it moved from, or where it was
    found; None when unknown (no answer, or no record)."""
    if isinstance(outcome, Moved):
        return outcome.from_state
    if isinstance(outcome, (AlreadyFinal, Elsewhere)):
        return outcome.state
    return None


def after_failed_move(
    found: Handoff,
    to: HandoffState,
    expected: tuple[HandoffState, ...],
    prefill_instance: str,
    maybe_applied: bool,
) -> MoveOutcome | None:
    """What a compare-and-set that failed (FailedPrecondition) means, given the record read right
    after it: None to try again from `found.state` (one of `expected`), else the outcome.

    `maybe_applied`: an earlier attempt of this move failed in transit (timeout, connection lost)
    and may have applied. Finding the record in `to` is then ambiguous, unless the move records our
    prefill instance and only one state could have led there (a claim RESERVED → TRANSFERRING)."""
    state = found.state
    if maybe_applied and state == to:
        if prefill_instance and len(expected) == 1 and found.prefill_instance == prefill_instance:
            return Moved(expected[0])
        return Unknown(f"the hand-off is {state.name}: a retried attempt may have moved it there")
    if state.terminal:
        return AlreadyFinal(state)
    if state in expected:
        return None
    return Elsewhere(state)


def may_be_written(ended_from: HandoffState | None) -> bool:
    """Whether a KV WRITE may still land in the blocks of a reservation whose hand-off was ended
    from `ended_from` (None: unknown, e.g. the kvstore was unreachable or the record is gone).

    RESERVED: no prefill rank claimed it, and none can any more. TRANSFERRING: a WRITE may be in
    flight. READY: the WRITE landed. Already final: the party that ended it guarantees no WRITE of
    its is in flight (prefill only cancels a hand-off when it posted no WRITE or its WRITE
    ended)."""
    return ended_from is None or ended_from == HandoffState.TRANSFERRING


def kv_may_still_arrive(found: HandoffState | None) -> bool:
    """Whether the KV of a reservation whose lease ran out may still arrive, from the state its
    hand-off was found in when decode tried RESERVED → EXPIRED (RESERVED: that move succeeded;
    None: unknown).

    TRANSFERRING or READY: a prefill rank claimed it, so its WRITE is in flight or landed. Unknown:
    assume so (the blocks must stay out of the pool anyway). RESERVED or a final state: no WRITE can
    land any more."""
    return found is None or found in (HandoffState.TRANSFERRING, HandoffState.READY)
