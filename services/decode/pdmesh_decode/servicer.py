"""The Decode gRPC service: pb → connector or engine loop → pb. Domain errors become status codes in
the interceptor; the hand-off protocol is `connector.DecodeConnector`'s.

Contracts: Reserve returns where the KV must be written once the hand-off is open and the lease
runs; Decode waits for the KV, sends the initial metadata `ADMITTED_METADATA` once the request is
admitted (the gateway waits for it before it shows the first token to its client), and streams the
tokens after the first; a Decode or Generate call that ends before its request finished (client
gone, cancelled) aborts the request, which frees its blocks; Cancel answers once a cancelled
reservation's record is ended and its blocks freed or quarantined.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pdmesh_decode.connector import DecodeConnector
from pdmesh_decode.core import check_first_token
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_service.errors import require_id
from pdmesh_service.grpc_server import ADMITTED_METADATA
from pdmesh_service.worker.convert import chunk_from_steps, sampling_from_pb, worker_status_pb
from pdmesh_service.worker.engine_loop import EngineLoop
from pdmesh_service.worker.stream import RequestStream


async def stream_chunks(
    engine: EngineLoop,
    stream: RequestStream,
    context: grpc.aio.ServicerContext,
    num_cached_tokens: int | None = None,
    admitted: bool = False,
) -> AsyncIterator[decode_pb2.TokenChunk]:
    """The stream as TokenChunks (after the `ADMITTED_METADATA` initial metadata if `admitted`); if
    the call ends before the request finished, abort it."""
    context.add_done_callback(
        lambda _: None if stream.finished else engine.abort_soon(stream.request_id)
    )
    if admitted:
        await context.send_initial_metadata(((ADMITTED_METADATA, "1"),))
    async for steps in stream:
        chunk = chunk_from_steps(steps)
        if num_cached_tokens is not None:
            chunk.num_cached_tokens = num_cached_tokens
        yield chunk


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        engine: EngineLoop,
        connector: DecodeConnector,
        instance_id: str,
        target: common_pb2.KVTarget,
        default_lease_ms: int,
    ) -> None:
        """`target`: this rank's agent name, KV groups and instance id (Reserve adds the block
        ids)."""
        self.engine, self.connector, self.instance_id = engine, connector, instance_id
        self.target, self.default_lease_ms = target, default_lease_ms

    async def Reserve(
        self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.ReserveResponse:
        request_id = require_id(request.request_id)
        tables = await self.connector.reserve(
            list(request.prompt_token_ids),
            sampling_from_pb(request.sampling),
            request_id,
            request.lease_ms or self.default_lease_ms,
        )
        target = common_pb2.KVTarget()
        target.CopyFrom(self.target)
        for group in target.groups:
            group.block_ids.extend(tables[group.name])
        return decode_pb2.ReserveResponse(target=target)

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.TokenChunk]:
        request_id = require_id(request.request_id)
        first = check_first_token(
            request.first_token.token_id if request.HasField("first_token") else None,
            self.engine.vocab_size,
        )
        stream = await self.connector.admit(request_id, first)
        async for chunk in stream_chunks(
            self.engine, stream, context, request.num_cached_tokens, admitted=True
        ):
            yield chunk

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.TokenChunk]:
        request_id = require_id(request.request_id)
        try:
            stream = await self.engine.generate(
                list(request.prompt_token_ids), sampling_from_pb(request.sampling), request_id
            )
        except asyncio.CancelledError:
            self.engine.abort_soon(request_id)
            raise
        async for chunk in stream_chunks(self.engine, stream, context):
            yield chunk

    async def Cancel(
        self, request: decode_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.CancelResponse:
        return decode_pb2.CancelResponse(
            found=await self.connector.cancel(require_id(request.request_id))
        )

    async def Status(
        self, request: common_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerStatus:
        return worker_status_pb(self.instance_id, await self.engine.status(request.check_integrity))
