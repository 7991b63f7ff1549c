"""Reservation bookkeeping of a decode rank, pure (no gRPC, Redis, NIXL, torch or clock).

A reservation holds blocks for a prompt whose KV a prefill rank writes. Its lifecycle is a
`ReservationState`; the legal moves are `TRANSITIONS`:

    HELD      → PUBLISHED | ADMITTED | CANCELLED
    PUBLISHED → EXPIRING | EXTENDED | ADMITTED | CANCELLED
    EXPIRING  → EXTENDED | DROPPED | ADMITTED | CANCELLED
    EXTENDED  → LAPSING | ADMITTED | CANCELLED
    LAPSING   → DROPPED | ADMITTED | CANCELLED
    ADMITTED, DROPPED, CANCELLED: final (the reservation leaves the book)

- HELD: blocks held, hand-off not open yet: no prefill rank can know the blocks, no lease runs.
- PUBLISHED: the hand-off is open and the target handed out; the lease runs (`lease_s`).
- EXPIRING: the lease ran out before the KV; the kvstore is asked to move RESERVED → EXPIRED.
- EXTENDED: a prefill rank had claimed the hand-off (or the KV is in): it waits past its lease until
  the cap (`cap_s`), once.
- LAPSING: the cap passed too; the claimed record is ended EXPIRED, then the reservation is dropped.

What has arrived (`Arrived`: the KV notification, the Decode call with the first token) is not part
of the lifecycle: a live reservation is admitted as soon as both are in, in either order.
A KV notification whose digest does not match the blocks (`KV_REJECTED`) ends a live reservation
CANCELLED with REJECT: it fails closed, never admitted.

`decide(reservation, event, now)` is the whole policy: it returns a `Decision` (the reservation
after the event, a `LeaseAction` for the caller to carry out, and the deadline that action starts)
and raises FailedPrecondition for an event the state does not allow. `ReservationBook` applies
decisions to the live reservations and keeps their deadlines. Times are whatever monotonic clock the
caller passes in.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, replace

from pdmesh_engine.sampling import PromptError, check_token_ids
from pdmesh_service.errors import FailedPrecondition, InvalidArgument, NotFound


class ReservationState(enum.Enum):
    HELD = "held"
    PUBLISHED = "published"
    EXPIRING = "expiring"
    EXTENDED = "extended"
    LAPSING = "lapsing"
    ADMITTED = "admitted"
    DROPPED = "dropped"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return not TRANSITIONS[self]


# from every live state
_LIVE_ENDS = frozenset({ReservationState.ADMITTED, ReservationState.CANCELLED})
TRANSITIONS: dict[ReservationState, frozenset[ReservationState]] = {
    ReservationState.HELD: _LIVE_ENDS | {ReservationState.PUBLISHED},
    ReservationState.PUBLISHED: _LIVE_ENDS | {ReservationState.EXPIRING, ReservationState.EXTENDED},
    ReservationState.EXPIRING: _LIVE_ENDS | {ReservationState.EXTENDED, ReservationState.DROPPED},
    ReservationState.EXTENDED: _LIVE_ENDS | {ReservationState.LAPSING},
    ReservationState.LAPSING: _LIVE_ENDS | {ReservationState.DROPPED},
    ReservationState.ADMITTED: frozenset(),
    ReservationState.DROPPED: frozenset(),
    ReservationState.CANCELLED: frozenset(),
}


class ReservationEvent(enum.Enum):
    PUBLISHED = "published"  # the hand-off is open: the lease starts
    KV_ARRIVED = "kv_arrived"  # the NIXL notification: the KV is in the blocks
    DECODE_CALLED = "decode_called"  # the Decode call, with the first token (or None: recompute it)
    DEADLINE = "deadline"  # the lease (or the cap) ran out
    KV_MAY_ARRIVE = "kv_may_arrive"  # kvstore: a prefill rank claimed the hand-off (or no answer)
    # kvstore: none did, or the claimed record was ended: no WRITE can land
    KV_WONT_ARRIVE = "kv_wont_arrive"
    CANCELLED = "cancelled"  # aborted before admission (Cancel, the Decode caller went away)
    # the KV arrived but failed its digest check (`--kv-digest`): the hand-off fails closed
    KV_REJECTED = "kv_rejected"


class Arrived(enum.Flag):
    NOTHING = 0
    KV = enum.auto()
    CALL = enum.auto()
    BOTH = KV | CALL


class LeaseAction(enum.Enum):
    """What the caller does after an event (block ownership: who frees the blocks, and when)."""

    WAIT = "wait"  # keep the blocks until `Decision.until` (a lease or the cap starts)
    KEEP = "keep"  # nothing changes: one input arrived, the other is missing
    ADMIT = "admit"  # both are in: the engine takes the request (and its blocks); CONSUMED
    # move the record RESERVED → EXPIRED; the answer is KV_MAY/WONT_ARRIVE
    ASK_KVSTORE = "ask_kvstore"
    END_CLAIMED = "end_claimed"  # end the claimed record EXPIRED; then KV_WONT_ARRIVE
    DROP = "drop"  # free the blocks now; a waiting Decode call fails (DeadlineExceeded)
    FREE = "free"  # cancelled, nobody knew the blocks: free them now
    # cancelled, KV in (no WRITE can follow): free now, end the record
    END_AND_FREE = "end_and_free"
    # cancelled, a WRITE may land: end the record; the blocks stay out of the
    QUARANTINE = "quarantine"
    # pool until the WRITE lands, the record says none can, or `until`
    # the KV failed its digest check: a waiting Decode call fails (`KVDigestMismatch`); the blocks
    # stay out of the pool (never admitted, cached or reused) until the record is ended (or `until`)
    REJECT = "reject"


@dataclass(frozen=True)
class Reservation:
    request_id: str
    num_blocks: int
    num_prompt_tokens: int
    lease_s: float  # how long it waits for its KV once published
    cap_s: float  # how long past the lease once claimed; also the quarantine cap
    serial: int = 0  # tells it from an earlier reservation under the same id
    state: ReservationState = ReservationState.HELD
    arrived: Arrived = Arrived.NOTHING
    first_token_id: int | None = None  # from the Decode call (None: decode recomputes it)

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.num_prompt_tokens < 1:
            raise ValueError(
                f"a reservation needs blocks and a prompt, got {self.num_blocks}, "
                f"{self.num_prompt_tokens}"
            )
        if not (self.lease_s > 0 and self.cap_s > 0):
            raise ValueError(
                f"lease_s and cap_s must be positive, got {self.lease_s}, {self.cap_s}"
            )


@dataclass(frozen=True)
class Decision:
    reservation: Reservation  # after the event
    action: LeaseAction
    until: float | None = None  # the deadline WAIT or QUARANTINE starts


def check_move(old: ReservationState, new: ReservationState) -> None:
    """FailedPrecondition unless `old → new` is in TRANSITIONS."""
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(s.name for s in TRANSITIONS[old])) or "nothing (final)"
        raise FailedPrecondition(
            f"a reservation cannot go from {old.name} to {new.name} (allowed: {allowed})"
        )


def _moved(reservation: Reservation, state: ReservationState) -> Reservation:
    check_move(reservation.state, state)
    return replace(reservation, state=state)


def decide(
    reservation: Reservation, event: ReservationEvent, now: float, first_token_id: int | None = None
) -> Decision:
    """The reservation after `event` at `now` and what to do (`first_token_id`: DECODE_CALLED's
    token)."""
    if reservation.state.is_final:
        raise FailedPrecondition(
            f"reservation {reservation.request_id!r} is {reservation.state.name}"
        )
    if event is ReservationEvent.PUBLISHED:
        published = _moved(reservation, ReservationState.PUBLISHED)
        return Decision(published, LeaseAction.WAIT, now + reservation.lease_s)
    if event is ReservationEvent.KV_ARRIVED:
        return _arrived(reservation, Arrived.KV, reservation.first_token_id)
    if event is ReservationEvent.DECODE_CALLED:
        return _arrived(reservation, Arrived.CALL, first_token_id)
    if event is ReservationEvent.DEADLINE:
        return _deadline(reservation, now)
    if event is ReservationEvent.CANCELLED:
        return _cancelled(reservation, now)
    if event is ReservationEvent.KV_REJECTED:
        rejected = _moved(reservation, ReservationState.CANCELLED)
        return Decision(rejected, LeaseAction.REJECT, now + reservation.cap_s)
    return _kvstore_answered(reservation, event, now)


def _arrived(reservation: Reservation, what: Arrived, first_token_id: int | None) -> Decision:
    if what in reservation.arrived:
        if what is Arrived.KV:  # a repeated notification changes nothing
            return Decision(reservation, LeaseAction.KEEP)
        raise FailedPrecondition(f"request {reservation.request_id!r} is already being decoded")
    after = replace(reservation, arrived=reservation.arrived | what, first_token_id=first_token_id)
    if after.arrived == Arrived.BOTH:
        return Decision(_moved(after, ReservationState.ADMITTED), LeaseAction.ADMIT)
    return Decision(after, LeaseAction.KEEP)


def _deadline(reservation: Reservation, now: float) -> Decision:
    """The lease: the KV is in (only the call is missing) → wait until the cap; else ask the
    kvstore. The cap: end the claimed record, then drop."""
    if reservation.state is ReservationState.PUBLISHED:
        if Arrived.KV in reservation.arrived:
            extended = _moved(reservation, ReservationState.EXTENDED)
            return Decision(extended, LeaseAction.WAIT, now + reservation.cap_s)
        return Decision(_moved(reservation, ReservationState.EXPIRING), LeaseAction.ASK_KVSTORE)
    if reservation.state is ReservationState.EXTENDED:
        return Decision(_moved(reservation, ReservationState.LAPSING), LeaseAction.END_CLAIMED)
    raise FailedPrecondition(f"no lease runs for a {reservation.state.name} reservation")


def _kvstore_answered(reservation: Reservation, event: ReservationEvent, now: float) -> Decision:
    """EXPIRING asked whether a prefill rank claimed it; LAPSING ended the claimed record (→
    KV_WONT_ARRIVE)."""
    asked = {
        ReservationEvent.KV_MAY_ARRIVE: (ReservationState.EXPIRING,),
        ReservationEvent.KV_WONT_ARRIVE: (ReservationState.EXPIRING, ReservationState.LAPSING),
    }[event]
    if reservation.state not in asked:
        raise FailedPrecondition(
            f"{event.name} answers nothing a {reservation.state.name} reservation asked"
        )
    if event is ReservationEvent.KV_MAY_ARRIVE:
        extended = _moved(reservation, ReservationState.EXTENDED)
        return Decision(extended, LeaseAction.WAIT, now + reservation.cap_s)
    return Decision(_moved(reservation, ReservationState.DROPPED), LeaseAction.DROP)


def _cancelled(reservation: Reservation, now: float) -> Decision:
    after = _moved(reservation, ReservationState.CANCELLED)
    if reservation.state is ReservationState.HELD:
        return Decision(after, LeaseAction.FREE)
    if Arrived.KV in reservation.arrived:
        return Decision(after, LeaseAction.END_AND_FREE)
    return Decision(after, LeaseAction.QUARANTINE, now + reservation.cap_s)


class LeaseTable:
    """request id → deadline; `expired(now)` pops every entry whose deadline is at or before
    `now`."""

    def __init__(self) -> None:
        self._deadlines: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []  # may hold stale entries; `_deadlines` decides

    def add(self, request_id: str, deadline: float) -> None:
        self._deadlines[request_id] = deadline
        heapq.heappush(self._heap, (deadline, request_id))

    def remove(self, request_id: str) -> bool:
        return self._deadlines.pop(request_id, None) is not None

    def expired(self, now: float) -> list[str]:
        gone: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            deadline, request_id = heapq.heappop(self._heap)
            if self._deadlines.get(request_id) == deadline:
                del self._deadlines[request_id]
                gone.append(request_id)
        return gone

    def deadline(self, request_id: str) -> float | None:
        return self._deadlines.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self._deadlines)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._deadlines

    def __len__(self) -> int:
        return len(self._deadlines)


class ReservationBook:
    """The live reservations by request id; `leases` holds the deadline of each one that waits.
    Invariant: a deadline runs only in the states a WAIT leaves (PUBLISHED, EXTENDED), so DEADLINE
    is legal for every id `due` returns."""

    def __init__(self) -> None:
        self.leases = LeaseTable()
        self._items: dict[str, Reservation] = {}

    def add(self, reservation: Reservation) -> None:
        """Hold a new (HELD) reservation; FailedPrecondition if the id has a live one."""
        if reservation.request_id in self._items:
            raise FailedPrecondition(f"request {reservation.request_id!r} is already reserved")
        if reservation.state is not ReservationState.HELD:
            raise ValueError(f"a new reservation is HELD, got {reservation.state.name}")
        self._items[reservation.request_id] = reservation

    def apply(
        self,
        request_id: str,
        event: ReservationEvent,
        now: float,
        first_token_id: int | None = None,
    ) -> Decision:
        """`decide` on the live reservation of `request_id` and keep the result: a final one leaves
        the book, a WAIT starts its deadline, any other move stops the one that ran. NotFound for an
        unknown id."""
        reservation = self._items.get(request_id)
        if reservation is None:
            raise NotFound(
                f"no reservation for request {request_id!r} (never reserved, expired or aborted)"
            )
        decision = decide(reservation, event, now, first_token_id)
        after = decision.reservation
        if after.state.is_final:
            del self._items[request_id]
            self.leases.remove(request_id)
            return decision
        self._items[request_id] = after
        if decision.action is LeaseAction.WAIT and decision.until is not None:
            self.leases.add(request_id, decision.until)
        elif after.state is not reservation.state:
            self.leases.remove(request_id)
        return decision

    def due(self, now: float) -> list[str]:
        """Ids whose deadline passed at or before `now` (each then gets DEADLINE; no deadline runs
        meanwhile)."""
        return [r for r in self.leases.expired(now) if r in self._items]

    def pop(self, request_id: str) -> Reservation | None:
        """Forget a reservation without a decision (the engine failed: its blocks went with it)."""
        self.leases.remove(request_id)
        return self._items.pop(request_id, None)

    def get(self, request_id: str) -> Reservation | None:
        return self._items.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def __len__(self) -> int:
        return len(self._items)


class KVDigestMismatch(NotFound):
    """The hand-off's KV failed its digest check on arrival: the request was not admitted and its
    reservation is gone. NOT_FOUND before admission is what the gateway retries from the start
    as a lost hand-off (on a new reservation)."""


def check_first_token(token_id: int | None, vocab_size: int) -> int | None:
    """A first token from a prefill rank must be a token of this model (None: recompute it here)."""
    if token_id is not None:
        try:
            check_token_ids([token_id], vocab_size, "first_token ids")
        except PromptError as e:
            raise InvalidArgument(str(e)) from e
    return token_id
