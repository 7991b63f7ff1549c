"""Async client of the kvstore (grpc.aio), used by the decode and prefill workers.

gRPC status codes come back as the domain errors of `pdmesh_service.errors` (NOT_FOUND →
NotFound, FAILED_PRECONDITION → FailedPrecondition, ...; UNAVAILABLE and DEADLINE_EXCEEDED too), so
callers handle one kind of error whether the cause was local or remote. Agent metadata is cached per
name for `agent_cache_s`; `forget_agent` drops an entry at once (e.g. after a failed transfer).
"""
from __future__ import annotations

import time

import grpc

from pdmesh_service.errors import (Aborted, DeadlineExceeded, FailedPrecondition, InvalidArgument,
                                           MeshError, NotFound, ResourceExhausted, Unavailable)
from pdmesh_service.grpc_server import channel, request_metadata
from pdmesh_service.handoff import Handoff, HandoffState, parse_state
from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

_ERRORS: dict[grpc.StatusCode, type[MeshError]] = {
    grpc.StatusCode[cls.grpc_code]: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, Aborted, ResourceExhausted, Unavailable,
                DeadlineExceeded)}


def domain_error(error: grpc.aio.AioRpcError) -> MeshError:
    """The domain error a status code stands for (MeshError for the rest)."""
    cls = _ERRORS.get(error.code(), MeshError)
    return cls(f"kvstore: {error.details() or error.code().name}")


class KVStoreClient:
    def __init__(self, address: str, timeout_s: float = 5.0, agent_cache_s: float = 30.0) -> None:
        self.address, self.timeout_s, self.agent_cache_s = address, timeout_s, agent_cache_s
        self._channel = channel(address)
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._agents: dict[str, tuple[float, bytes]] = {}      # name -> (monotonic time fetched, metadata)

    async def _call(self, method, request, request_id: str = ""):
        try:
            return await method(request, timeout=self.timeout_s,
                                metadata=request_metadata(request_id) if request_id else None)
        except grpc.aio.AioRpcError as e:
            raise domain_error(e) from None

    async def register_agent(self, name: str, metadata: bytes, instance_id: str) -> None:
        await self._call(self._stub.RegisterAgent,
                         kvstore_pb2.AgentInfo(agent_name=name, metadata=metadata, instance_id=instance_id))
        self._agents.pop(name, None)

    async def get_agent(self, name: str) -> bytes:
        """The agent's NIXL metadata; NotFound if it never registered."""
        cached = self._agents.get(name)
        if cached is not None and time.monotonic() - cached[0] < self.agent_cache_s:
            return cached[1]
        info = await self._call(self._stub.GetAgent, kvstore_pb2.GetAgentRequest(agent_name=name))
        self._agents[name] = (time.monotonic(), info.metadata)
        return info.metadata

    def forget_agent(self, name: str) -> None:
        self._agents.pop(name, None)

    async def open_handoff(self, request_id: str, decode_instance: str, num_blocks: int, lease_ms: int) -> Handoff:
        request = kvstore_pb2.OpenHandoffRequest(request_id=request_id, decode_instance=decode_instance,
                                                 num_blocks=num_blocks, lease_ms=lease_ms)
        return Handoff.from_message(await self._call(self._stub.OpenHandoff, request, request_id))

    async def update_handoff(self, request_id: str, state: HandoffState | int | str, prefill_instance: str = "",
                             expected: HandoffState | int | str | None = None) -> Handoff:
        """`state`: a HandoffState, its proto number (kvstore_pb2.HANDOFF_STATE_*) or its name. With `expected`
        a compare-and-set: FailedPrecondition unless the record is in that state now."""
        request = kvstore_pb2.UpdateHandoffRequest(request_id=request_id, state=int(parse_state(state)),
                                                   prefill_instance=prefill_instance)
        if expected is not None:
            request.expected_state = int(parse_state(expected))
        return Handoff.from_message(await self._call(self._stub.UpdateHandoff, request, request_id))

    async def get_handoff(self, request_id: str) -> Handoff:
        request = kvstore_pb2.GetHandoffRequest(request_id=request_id)
        return Handoff.from_message(await self._call(self._stub.GetHandoff, request, request_id))

    async def close(self) -> None:
        await self._channel.close()
