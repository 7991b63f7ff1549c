"""Reservation bookkeeping of a decode rank, pure (no gRPC, Redis, NIXL or clock).

A reservation is a lease: blocks are held for a prompt whose KV a prefill rank writes. It is published
once its kvstore hand-off is open (only then can a prefill rank know its blocks, and only then does its
lease run). It becomes admissible once both the KV notification has arrived and the `Decode` call has
brought the first token, in either order. When its lease runs out before that, it stays in the book
(`lapsed`) until the caller decides: end it (`pop`), or, when its KV may still arrive (a prefill rank
claimed the hand-off: `kv_may_still_arrive`), `extend` it once to a cap. Times are whatever monotonic
clock the caller passes in.

When a published reservation ends before its KV arrived, whether a WRITE may still land in its blocks
is decided by the hand-off state it was ended from (`may_be_written`): the kvstore record is the
authority, since a prefill rank only writes after moving it RESERVED → TRANSFERRING.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from pdmesh_service.errors import FailedPrecondition, InvalidArgument, NotFound
from pdmesh_service.handoff import HandoffState


class LeaseTable:
    """request id → deadline; `expired(now)` pops every lease whose deadline is at or before `now`."""

    def __init__(self) -> None:
        self._deadlines: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []      # may hold stale entries; `_deadlines` decides

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


@dataclass(slots=True)
class Reservation:
    request_id: str
    num_blocks: int
    num_prompt_tokens: int
    kv_ready: bool = False               # the NIXL notification arrived
    first_token_id: int | None = None    # set by the Decode call
    decode_called: bool = False
    published: bool = False              # its hand-off is open and its target handed out; the lease runs
    lapsed: bool = False                 # the lease ran out; the kvstore is asked whether a prefill claimed it
    extended: bool = False               # ... and one did: it waits for its KV until a cap (no second extension)

    @property
    def admissible(self) -> bool:
        return self.kv_ready and self.decode_called


class ReservationBook:
    """Reservations waiting for KV and/or the Decode call, each under a lease."""

    def __init__(self) -> None:
        self.leases = LeaseTable()
        self._items: dict[str, Reservation] = {}

    def add(self, reservation: Reservation, deadline: float | None = None) -> None:
        """Hold a reservation; its lease runs from `publish` (or from here if `deadline` is given)."""
        if reservation.request_id in self._items:
            raise FailedPrecondition(f"request {reservation.request_id!r} is already reserved")
        self._items[reservation.request_id] = reservation
        if deadline is not None:
            self.leases.add(reservation.request_id, deadline)

    def publish(self, request_id: str, deadline: float) -> bool:
        """Mark the reservation published and start its lease; False if it is gone (aborted meanwhile)."""
        reservation = self._items.get(request_id)
        if reservation is None:
            return False
        reservation.published = True
        self.leases.add(request_id, deadline)
        return True

    def kv_arrived(self, request_id: str) -> Reservation | None:
        """Mark the KV as present; None for an unknown (expired, aborted) request."""
        reservation = self._items.get(request_id)
        if reservation is not None:
            reservation.kv_ready = True
        return reservation

    def decode_called(self, request_id: str, first_token_id: int | None) -> Reservation:
        """Record the Decode call; raises NotFound (no such reservation) or FailedPrecondition (twice)."""
        reservation = self._items.get(request_id)
        if reservation is None:
            raise NotFound(f"no reservation for request {request_id!r} (never reserved, expired or aborted)")
        if reservation.decode_called:
            raise FailedPrecondition(f"request {request_id!r} is already being decoded")
        reservation.decode_called, reservation.first_token_id = True, first_token_id
        return reservation

    def pop(self, request_id: str) -> Reservation | None:
        """Remove a reservation (admitted or aborted) with its lease."""
        self.leases.remove(request_id)
        return self._items.pop(request_id, None)

    def lapsed(self, now: float) -> list[Reservation]:
        """Reservations whose lease (or extension) ran out at or before `now`; they stay in the book, with no
        lease running, until `pop`ped or `extend`ed."""
        return [self._items[r] for r in self.leases.expired(now) if r in self._items]

    def extend(self, request_id: str, deadline: float) -> Reservation | None:
        """Run a new lease to `deadline` (marks it `extended`); None if the reservation is gone."""
        reservation = self._items.get(request_id)
        if reservation is not None:
            reservation.lapsed, reservation.extended = False, True
            self.leases.add(request_id, deadline)
        return reservation

    def get(self, request_id: str) -> Reservation | None:
        return self._items.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def __len__(self) -> int:
        return len(self._items)


def may_be_written(ended_from: HandoffState | None) -> bool:
    """Whether a KV WRITE may still land in the blocks of a reservation whose hand-off was ended from
    `ended_from` (None: unknown, e.g. the kvstore was unreachable or the record is gone).

    RESERVED: no prefill rank claimed it, and none can any more. TRANSFERRING: a WRITE may be in flight.
    READY: the WRITE landed. Already final: the party that ended it guarantees no WRITE of its is in
    flight (prefill only cancels a hand-off when it posted no WRITE or its WRITE ended)."""
    return ended_from is None or ended_from == HandoffState.TRANSFERRING


def kv_may_still_arrive(found: HandoffState | None) -> bool:
    """Whether the KV of a reservation whose lease ran out may still arrive, from the state its hand-off was
    found in when decode tried RESERVED → EXPIRED (RESERVED: that move succeeded; None: unknown).

    TRANSFERRING or READY: a prefill rank claimed it, so its WRITE is in flight or landed (the request can
    still complete). Unknown: assume so (the blocks must stay out of the pool anyway). RESERVED or a final
    state: no WRITE can land any more."""
    return found is None or found in (HandoffState.TRANSFERRING, HandoffState.READY)


def check_first_token(token_id: int | None, vocab_size: int) -> int | None:
    """A first token from a prefill rank must be a token of this model (None: recompute it here)."""
    if token_id is not None and not 0 <= token_id < vocab_size:
        raise InvalidArgument(f"first_token {token_id} is outside the vocabulary [0, {vocab_size})")
    return token_id
