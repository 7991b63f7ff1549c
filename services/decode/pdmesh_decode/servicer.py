"""The Decode gRPC service: pb → engine loop → pb. Domain errors become status codes in the interceptor.

Contracts: Reserve opens the kvstore hand-off (RESERVED), then starts the lease (`publish`), and returns
where the KV must be written; Decode waits for the KV (the NIXL notification may come before or after
the call; the lease bounds the wait, or the quarantine cap once a prefill rank claimed the hand-off),
sends the initial metadata `ADMITTED_METADATA` once the request is admitted (the gateway waits for it
before it shows the first token to its client), and streams the tokens after the first; a Decode or
Generate call that ends before its request finished (client gone, cancelled) aborts the request, which
frees its blocks. A reservation that ends early is ended in the kvstore by compare-and-set and its blocks
freed or quarantined (`handoff.HandoffEnder`); Cancel answers once that is decided. READY and CONSUMED go to the
kvstore in order, best effort (`handoff.HandoffReporter`).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc

from pdmesh_service.errors import MeshError, Unavailable, require_id
from pdmesh_service.grpc_server import ADMITTED_METADATA
from pdmesh_service.logging import get_logger
from pdmesh_decode.core import check_first_token
from pdmesh_decode.handoff import HandoffEnder, HandoffReporter
from pdmesh_decode.receiver import KVReceiver
from pdmesh_service.handoff import HandoffState
from pdmesh_service.worker.convert import chunk_from_steps, sampling_from_pb, worker_status_pb
from pdmesh_service.worker.engine_loop import EngineLoop, RequestStream

log = get_logger(__name__)
S = HandoffState
REPORTS = {"ready": (S.READY, S.TRANSFERRING), "consumed": (S.CONSUMED, S.READY)}    # event → (state, from)


async def stream_chunks(engine: EngineLoop, stream: RequestStream, context: grpc.aio.ServicerContext,
                        num_cached_tokens: int | None = None,
                        admitted: bool = False) -> AsyncIterator[decode_pb2.TokenChunk]:
    """The stream as TokenChunks (after the `ADMITTED_METADATA` initial metadata if `admitted`); if the call
    ends before the request finished, abort it."""
    context.add_done_callback(lambda _: None if stream.finished else engine.abort_soon(stream.request_id))
    if admitted:
        await context.send_initial_metadata(((ADMITTED_METADATA, "1"),))
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
        self.ender = HandoffEnder(kvstore, receiver.settle, receiver.decide)

    async def close(self) -> None:
        await self.handoffs.close()
        await self.ender.close()

    def on_event(self, kind: str, request_id: str) -> None:
        """Engine-thread events (run on the event loop) → kvstore hand-off states."""
        if kind == "cancelled":
            self.ender.start(request_id, S.CANCELLED)
        elif kind == "expired":
            self.ender.expire(request_id)
        elif kind == "lapsed":
            self.ender.lapse(request_id)
        else:
            self.handoffs.report(request_id, *REPORTS[kind])

    async def Reserve(self, request: decode_pb2.ReserveRequest, context) -> decode_pb2.ReserveResponse:
        request_id, lease_ms = require_id(request.request_id), request.lease_ms or self.default_lease_ms
        blocks = await abort_if_cancelled(self.engine, request_id, self.receiver.reserve(
            list(request.prompt_token_ids), sampling_from_pb(request.sampling), request_id))
        await self._open_handoff(request_id, len(blocks), lease_ms)
        await self._publish(request_id, lease_ms)
        return decode_pb2.ReserveResponse(target=common_pb2.KVTarget(
            agent_name=self.agent_name, layout=self.layout, block_ids=blocks, instance_id=self.instance_id))

    async def _publish(self, request_id: str, lease_ms: int) -> None:
        """Start the lease; if the reservation was aborted meanwhile, cancel the record just opened."""
        if await abort_if_cancelled(self.engine, request_id, self.receiver.publish(request_id, lease_ms / 1000.0)):
            return
        try:
            await self.kvstore.update_handoff(request_id, S.CANCELLED, expected=S.RESERVED)
        except Exception as e:  # noqa: BLE001 - bookkeeping only: the record lapses by itself
            log.warning("hand-off not cancelled", request_id=request_id, error=str(e))
        raise Unavailable(f"the reservation of request {request_id} was aborted while it was being made")

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
        async for chunk in stream_chunks(self.engine, stream, context, request.num_cached_tokens, admitted=True):
            yield chunk

    async def Generate(self, request: decode_pb2.GenerateRequest, context) -> AsyncIterator[decode_pb2.TokenChunk]:
        request_id = require_id(request.request_id)
        stream = await abort_if_cancelled(self.engine, request_id, self.engine.generate(
            list(request.prompt_token_ids), sampling_from_pb(request.sampling), request_id))
        async for chunk in stream_chunks(self.engine, stream, context):
            yield chunk

    async def Cancel(self, request: decode_pb2.CancelRequest, context) -> decode_pb2.CancelResponse:
        request_id = require_id(request.request_id)
        found = await self.engine.abort(request_id)
        await self.ender.settled(request_id)   # its end was queued before the abort's answer: it is known here
        return decode_pb2.CancelResponse(found=found)

    async def Status(self, request: decode_pb2.StatusRequest, context) -> decode_pb2.WorkerStatus:
        return worker_status_pb(self.instance_id, await self.engine.status(request.check_integrity))
