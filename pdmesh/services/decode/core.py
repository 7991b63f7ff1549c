"""Reservation bookkeeping of a decode rank, pure (no gRPC, Redis, NIXL or clock).

A reservation is a lease: blocks are held for a prompt whose KV a prefill rank writes. It becomes
admissible once both the KV notification has arrived and the `Decode` call has brought the first
token, in either order; it expires at its deadline unless admitted before. Times are whatever
monotonic clock the caller passes in.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from pdmesh.services.common.errors import FailedPrecondition, InvalidArgument, NotFound


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

    @property
    def admissible(self) -> bool:
        return self.kv_ready and self.decode_called


class ReservationBook:
    """Reservations waiting for KV and/or the Decode call, each under a lease."""

    def __init__(self) -> None:
        self.leases = LeaseTable()
        self._items: dict[str, Reservation] = {}

    def add(self, reservation: Reservation, deadline: float) -> None:
        if reservation.request_id in self._items:
            raise FailedPrecondition(f"request {reservation.request_id!r} is already reserved")
        self._items[reservation.request_id] = reservation
        self.leases.add(reservation.request_id, deadline)

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

    def expire(self, now: float) -> list[Reservation]:
        return [self._items.pop(r) for r in self.leases.expired(now)]

    def request_ids(self) -> list[str]:
        return list(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def __len__(self) -> int:
        return len(self._items)


def check_first_token(token_id: int | None, vocab_size: int) -> int | None:
    """A first token from a prefill rank must be a token of this model (None: recompute it here)."""
    if token_id is not None and not 0 <= token_id < vocab_size:
        raise InvalidArgument(f"first_token {token_id} is outside the vocabulary [0, {vocab_size})")
    return token_id
