"""Async client of the kvstore (grpc.aio), used by the decode and prefill workers.

gRPC status codes come back as the domain errors of `pdmesh_service.errors` (NOT_FOUND →
NotFound, FAILED_PRECONDITION → FailedPrecondition, ...; UNAVAILABLE and DEADLINE_EXCEEDED too), so
callers handle one kind of error whether the cause was local or remote. Agent metadata is cached per
name for `agent_cache_s`; `forget_agent` drops an entry at once (e.g. after a failed transfer).

Hand-off moves: `move_handoff` is THE compare-and-set loop on a hand-off record (decode and prefill
use it, directly or through `end_handoff`/`expire_handoff`). Each RPC in it is retried on transient
errors (UNAVAILABLE, DEADLINE_EXCEEDED) by tenacity, with exponential jittered waits, until one
`RetryPolicy.budget_s` for the whole move passes; the answer is a typed `handoff.MoveOutcome`, never
an exception for the expected cases.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import grpc
from google.protobuf.message import Message
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdmesh_service.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from pdmesh_service.grpc_server import NO_AUTH, MeshAuth, channel, request_metadata
from pdmesh_service.handoff import (
    AlreadyFinal,
    Elsewhere,
    Handoff,
    HandoffState,
    Missing,
    Moved,
    MoveOutcome,
    Unknown,
    after_failed_move,
    parse_state,
    state_found,
)

_ERRORS: dict[grpc.StatusCode, type[MeshError]] = {
    grpc.StatusCode[cls.grpc_code]: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        Aborted,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
    )
}


def _state_pb(state: HandoffState | int | str) -> kvstore_pb2.HandoffState:
    """The wire value of a state (the proto enum takes HandoffState's numbers). The generated stubs
    type the enum as a subclass of int, while its values are plain ints: the cast only retypes."""
    return cast(kvstore_pb2.HandoffState, int(parse_state(state)))


def domain_error(error: grpc.aio.AioRpcError) -> MeshError:
    """The domain error a status code stands for (MeshError for the rest)."""
    cls = _ERRORS.get(error.code(), MeshError)
    return cls(f"kvstore: {error.details() or error.code().name}")


class KVStoreClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        agent_cache_s: float = 30.0,
        auth: MeshAuth = NO_AUTH,
    ) -> None:
        """`auth`: the process's mesh credentials (`grpc_server.MeshAuth`), sent with every call."""
        self.address, self.timeout_s, self.agent_cache_s = address, timeout_s, agent_cache_s
        self._channel = channel(address, auth)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        # name -> (monotonic time fetched, metadata)
        self._agents: dict[str, tuple[float, bytes]] = {}

    async def _call(
        self, method: Callable[..., Awaitable[Any]], request: Message, request_id: str = ""
    ) -> Any:
        try:
            return await method(
                request,
                timeout=self.timeout_s,
                metadata=request_metadata(request_id) if request_id else None,
            )
        except grpc.aio.AioRpcError as e:
            raise domain_error(e) from None

    async def register_agent(self, name: str, metadata: bytes, instance_id: str) -> None:
        await self._call(
            self._stub.RegisterAgent,
            kvstore_pb2.AgentInfo(agent_name=name, metadata=metadata, instance_id=instance_id),
        )
        self._agents.pop(name, None)

    async def get_agent(self, name: str) -> bytes:
        """The agent's NIXL metadata; NotFound if it never registered."""
        cached = self._agents.get(name)
        if cached is not None and time.monotonic() - cached[0] < self.agent_cache_s:
            return cached[1]
        info = await self._call(self._stub.GetAgent, kvstore_pb2.GetAgentRequest(agent_name=name))
        metadata: bytes = info.metadata
        self._agents[name] = (time.monotonic(), metadata)
        return metadata

    def forget_agent(self, name: str) -> None:
        self._agents.pop(name, None)

    async def open_handoff(
        self, request_id: str, decode_instance: str, num_blocks: int, lease_ms: int
    ) -> Handoff:
        request = kvstore_pb2.OpenHandoffRequest(
            request_id=request_id,
            decode_instance=decode_instance,
            num_blocks=num_blocks,
            lease_ms=lease_ms,
        )
        return Handoff.from_message(await self._call(self._stub.OpenHandoff, request, request_id))

    async def update_handoff(
        self,
        request_id: str,
        state: HandoffState | int | str,
        prefill_instance: str = "",
        expected: HandoffState | int | str | None = None,
    ) -> Handoff:
        """`state`: a HandoffState, its proto number (kvstore_pb2.HANDOFF_STATE_*) or its name. With
        `expected` a compare-and-set: FailedPrecondition unless the record is in that state now."""
        request = kvstore_pb2.UpdateHandoffRequest(
            request_id=request_id, state=_state_pb(state), prefill_instance=prefill_instance
        )
        if expected is not None:
            request.expected_state = _state_pb(expected)
        return Handoff.from_message(await self._call(self._stub.UpdateHandoff, request, request_id))

    async def get_handoff(self, request_id: str) -> Handoff:
        request = kvstore_pb2.GetHandoffRequest(request_id=request_id)
        return Handoff.from_message(await self._call(self._stub.GetHandoff, request, request_id))

    async def publish_kv_events(
        self,
        rank_id: str,
        seq: int,
        stored: Sequence[bytes],
        removed: Sequence[bytes] = (),
        snapshot: bool = False,
    ) -> bool:
        """Send the rank's KV-event batch `seq` (with `snapshot`: every hash it holds, as `stored`)
        to the prefix index; True when the kvstore asks for a snapshot next (resync)."""
        request = kvstore_pb2.KVEvents(
            rank_id=rank_id, seq=seq, stored=stored, removed=removed, snapshot=snapshot
        )
        ack = await self._call(self._stub.PublishKVEvents, request)
        return bool(ack.resync)

    async def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per rank, how many leading blocks of `block_hashes` it holds (ranks holding none are
        absent)."""
        request = kvstore_pb2.LongestPrefixRequest(block_hashes=block_hashes)
        response = await self._call(self._stub.LongestPrefix, request)
        return dict(response.matched_blocks)

    async def close(self) -> None:
        await self._channel.close()


# ----- compare-and-set moves of a hand-off record -----
# retried; an update that failed so may have applied
TRANSIENT: tuple[type[MeshError], ...] = (Unavailable, DeadlineExceeded)
_MAX_MOVES = 4  # > the longest path in the state graph


class HandoffRecords(Protocol):
    """What a move needs of the kvstore (`KVStoreClient`, or a store in the same process)."""

    async def update_handoff(
        self,
        request_id: str,
        state: HandoffState,
        prefill_instance: str = "",
        expected: HandoffState | None = None,
    ) -> object: ...

    async def get_handoff(self, request_id: str) -> Handoff: ...


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of one hand-off move's RPCs on TRANSIENT errors: all of them within `budget_s` (from
    the move's start), the n-th wait random in [0, min(initial_wait_s * 2**n, max_wait_s)]."""

    budget_s: float = 3.0
    initial_wait_s: float = 0.02
    max_wait_s: float = 0.5

    def __post_init__(self) -> None:
        if self.budget_s < 0 or self.initial_wait_s <= 0 or self.max_wait_s < self.initial_wait_s:
            raise ValueError(f"need budget_s >= 0 and 0 < initial_wait_s <= max_wait_s, got {self}")


class _Attempts:
    """The RPCs of one move under its `RetryPolicy` (one deadline for all of them); `maybe_applied`
    turns True once an update failed in transit (it may have been applied anyway)."""

    def __init__(self, records: HandoffRecords, request_id: str, policy: RetryPolicy) -> None:
        self.records, self.request_id, self.policy = records, request_id, policy
        self.deadline = time.monotonic() + policy.budget_s
        self.maybe_applied = False

    def _retrying(self) -> AsyncRetrying:
        def out_of_time(_: RetryCallState) -> bool:
            return time.monotonic() >= self.deadline

        wait = wait_random_exponential(self.policy.initial_wait_s, self.policy.max_wait_s)
        return AsyncRetrying(
            retry=retry_if_exception_type(TRANSIENT), stop=out_of_time, wait=wait, reraise=True
        )

    async def update(self, to: HandoffState, prefill_instance: str, expected: HandoffState) -> None:
        retrying = self._retrying()
        try:
            await retrying(
                self.records.update_handoff,
                self.request_id,
                to,
                prefill_instance,
                expected=expected,
            )
        finally:
            self.maybe_applied |= retrying.statistics.get("attempt_number", 1) > 1

    async def get(self) -> Handoff:
        record: Handoff = await self._retrying()(self.records.get_handoff, self.request_id)
        return record


async def move_handoff(
    records: HandoffRecords,
    request_id: str,
    to: HandoffState,
    expected: tuple[HandoffState, ...],
    prefill_instance: str = "",
    policy: RetryPolicy = RetryPolicy(),
) -> MoveOutcome:
    """Move the hand-off to `to` by compare-and-set from whichever of the live states `expected`
    it is in (tried in that order; after a lost race, from the state read back).

    `Moved(s)`: this call moved it from s. `AlreadyFinal(s)`: it was final in s. `Elsewhere(s)`: it
    is live in s, not expected. `Missing()`: no record. `Unknown(reason)`: no answer within the
    budget, it kept changing, or a retried update may have applied (`handoff.after_failed_move`)."""
    if not expected or any(s.terminal for s in expected):
        raise ValueError(f"expected must be live states, got {[s.name for s in expected]}")
    attempts, state = _Attempts(records, request_id, policy), expected[0]
    try:
        for _ in range(_MAX_MOVES):
            try:
                await attempts.update(to, prefill_instance, state)
                return Moved(state)
            except FailedPrecondition:
                found = await attempts.get()  # not in `state` (any more): read where it is
            outcome = after_failed_move(
                found, to, expected, prefill_instance, attempts.maybe_applied
            )
            if outcome is not None:
                return outcome
            state = found.state
    except NotFound:
        return Missing()
    except Exception as e:  # noqa: BLE001 - transient past the budget, a broken channel: no answer
        return Unknown(f"kvstore: {type(e).__name__}: {e}")
    return Unknown(f"the hand-off of {request_id} kept changing")


LIVE = (HandoffState.RESERVED, HandoffState.TRANSFERRING, HandoffState.READY)


async def end_handoff(
    records: HandoffRecords,
    request_id: str,
    state: HandoffState,
    policy: RetryPolicy = RetryPolicy(),
) -> HandoffState | None:
    """Move a live hand-off to `state` (EXPIRED/CANCELLED), first from RESERVED, else from wherever
    it is. Returns the state it was ended from; for a record already final, that final state;
    None when unknown (kvstore unreachable, record gone, kept changing): assume the worst."""
    return state_found(await move_handoff(records, request_id, state, LIVE, policy=policy))


async def expire_handoff(
    records: HandoffRecords, request_id: str, policy: RetryPolicy = RetryPolicy()
) -> HandoffState | None:
    """Move a hand-off RESERVED → EXPIRED, and only from there (a prefill rank that claimed it
    keeps it). Returns RESERVED when this ended it, else the state found; None when unknown."""
    outcome = await move_handoff(
        records, request_id, HandoffState.EXPIRED, (HandoffState.RESERVED,), policy=policy
    )
    return state_found(outcome)


__all__ = [
    "LIVE",
    "TRANSIENT",
    "AlreadyFinal",
    "Elsewhere",
    "HandoffRecords",
    "KVStoreClient",
    "Missing",
    "MoveOutcome",
    "Moved",
    "RetryPolicy",
    "Unknown",
    "domain_error",
    "end_handoff",
    "expire_handoff",
    "move_handoff",
]
