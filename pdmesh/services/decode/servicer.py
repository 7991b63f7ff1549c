"""The Decode gRPC service: pb → engine loop → pb. Domain errors become status codes in the interceptor.

Contracts: Reserve opens the kvstore hand-off (RESERVED) and returns where the KV must be written;
Decode waits for the KV (the NIXL notification may come before or after the call, the lease bounds
the wait) and streams the tokens after the first; a Decode or Generate call that ends before its
request finished (client gone, cancelled) aborts the request, which frees its blocks. Hand-off
state changes seen by the engine thread (READY, CONSUMED, EXPIRED, CANCELLED) go to the kvstore in
order, best effort.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.kvstore.v1 import kvstore_pb2

from pdmesh.services.common.errors import FailedPrecondition, InvalidArgument, MeshError, NotFound, Unavailable
from pdmesh.services.common.logging import get_logger
from pdmesh.services.decode.core import check_first_token
from pdmesh.services.decode.receiver import KVReceiver
from pdmesh.services.worker.convert import chunk_from_steps, sampling_from_pb, worker_status_pb
from pdmesh.services.worker.engine_loop import EngineLoop, RequestStream

log = get_logger(__name__)
EVENT_STATES = {"ready": kvstore_pb2.HANDOFF_STATE_READY, "consumed": kvstore_pb2.HANDOFF_STATE_CONSUMED,
                "expired": kvstore_pb2.HANDOFF_STATE_EXPIRED, "cancelled": kvstore_pb2.HANDOFF_STATE_CANCELLED}


def require_id(request_id: str) -> str:
    if not request_id:
        raise InvalidArgument("request_id is empty")
    return request_id


class HandoffReporter:
    """Sends hand-off state changes to the kvstore one at a time, in order; failures are logged."""

    def __init__(self, kvstore: Any) -> None:
        self.kvstore = kvstore
        self._queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    def report(self, request_id: str, state: int) -> None:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        self._queue.put_nowait((request_id, state))

    async def _run(self) -> None:
        while True:
            request_id, state = await self._queue.get()
            try:
                await self.kvstore.update_handoff(request_id, state)
            except (FailedPrecondition, NotFound) as e:   # already final (CANCELLED by prefill too), or lapsed
                log.info("hand-off not updated", request_id=request_id,
                         state=kvstore_pb2.HandoffState.Name(state), reason=str(e))
            except Exception as e:  # noqa: BLE001 - bookkeeping only: never fails a request
                log.warning("hand-off update failed", request_id=request_id,
                            state=kvstore_pb2.HandoffState.Name(state), error=str(e))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


async def stream_chunks(engine: EngineLoop, stream: RequestStream, context: grpc.aio.ServicerContext,
                        num_cached_tokens: int | None = None) -> AsyncIterator[decode_pb2.TokenChunk]:
    """The stream as TokenChunks; if the call ends before the request finished, abort it."""
    context.add_done_callback(lambda _: None if stream.finished else engine.abort_soon(stream.request_id))
    async for steps in stream:
        chunk = chunk_from_steps(steps)
        if num_cached_tokens is not None:
            chunk.num_cached_tokens = num_cached_tokens
        yield chunk


async def abort_if_cancelled(engine: EngineLoop, request_id: str, pending: Any) -> Any:
    """Await `pending`; a cancelled caller (client gone) aborts the request it started."""
    try:
        return await pending
    except asyncio.CancelledError:
        engine.abort_soon(request_id)
        raise


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: EngineLoop, receiver: KVReceiver, kvstore: Any, instance_id: str, agent_name: str,
                 layout: common_pb2.KVLayout, default_lease_ms: int) -> None:
        self.engine, self.receiver, self.kvstore, self.instance_id = engine, receiver, kvstore, instance_id
        self.agent_name, self.layout, self.default_lease_ms = agent_name, layout, default_lease_ms
        self.handoffs = HandoffReporter(kvstore)

    async def close(self) -> None:
        await self.handoffs.close()

    def on_event(self, kind: str, request_id: str) -> None:
        """Engine-thread events (run on the event loop) → kvstore hand-off states."""
        self.handoffs.report(request_id, EVENT_STATES[kind])

    async def Reserve(self, request: decode_pb2.ReserveRequest, context) -> decode_pb2.ReserveResponse:
        request_id, lease_ms = require_id(request.request_id), request.lease_ms or self.default_lease_ms
        blocks = await abort_if_cancelled(self.engine, request_id, self.receiver.reserve(
            list(request.prompt_token_ids), sampling_from_pb(request.sampling), request_id,
            lease_ms / 1000.0))
        await self._open_handoff(request_id, len(blocks), lease_ms)
        return decode_pb2.ReserveResponse(target=common_pb2.KVTarget(
            agent_name=self.agent_name, layout=self.layout, block_ids=blocks, instance_id=self.instance_id))

    async def _open_handoff(self, request_id: str, num_blocks: int, lease_ms: int) -> None:
        try:
            await self.kvstore.open_handoff(request_id, self.instance_id, num_blocks, lease_ms)
        except BaseException as e:
            self.engine.abort_soon(request_id)
            if isinstance(e, (MeshError, asyncio.CancelledError)):
                raise
            raise Unavailable(f"cannot record the hand-off in the kvstore: {e}") from e

    async def Decode(self, request: decode_pb2.DecodeRequest, context) -> AsyncIterator[decode_pb2.TokenChunk]:
        request_id = require_id(request.request_id)
        first = check_first_token(request.first_token.token_id if request.HasField("first_token") else None,
                                  self.engine.vocab_size)
        stream = await abort_if_cancelled(self.engine, request_id, self.receiver.admit(request_id, first))
        async for chunk in stream_chunks(self.engine, stream, context, request.num_cached_tokens):
            yield chunk

    async def Generate(self, request: decode_pb2.GenerateRequest, context) -> AsyncIterator[decode_pb2.TokenChunk]:
        request_id = require_id(request.request_id)
        stream = await abort_if_cancelled(self.engine, request_id, self.engine.generate(
            list(request.prompt_token_ids), sampling_from_pb(request.sampling), request_id))
        async for chunk in stream_chunks(self.engine, stream, context):
            yield chunk

    async def Cancel(self, request: decode_pb2.CancelRequest, context) -> decode_pb2.CancelResponse:
        return decode_pb2.CancelResponse(found=await self.engine.abort(require_id(request.request_id)))

    async def Status(self, request: decode_pb2.StatusRequest, context) -> decode_pb2.WorkerStatus:
        return worker_status_pb(self.instance_id, await self.engine.status(request.check_integrity))
