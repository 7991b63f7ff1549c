"""The gateway's client of the workers' gRPC APIs: one call per method, status codes → domain
errors, TokenChunks → `WorkerChunk`s, and the decode stream of a request (`DecodeStream`).

It decides nothing: which rank to call, what to retry and what to release is the orchestrator's.
Contracts: every method raises `MeshError`s only (`map_rpc_error`), never grpc errors; a method
whose caller is cancelled cancels its call. `Prefill` ABORTED and a Decode ending NOT_FOUND /
DEADLINE_EXCEEDED before admission are `HandoffLost` (the hand-off ended first; the rank is fine).
"""

from __future__ import annotations

import re

import grpc

from pdmesh_gateway.core import GenerationRequest, TokenLogprob, WorkerChunk
from pdmesh_gateway.retry import HandoffLost
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdmesh_service import errors
from pdmesh_service.convert import finish_reason_from_pb, sampling_to_pb
from pdmesh_service.grpc_server import (
    ADMITTED_METADATA,
    NO_AUTH,
    MeshAuth,
    channel,
    request_metadata,
)
from pdmesh_service.instance import InstanceInfo
from pdmesh_service.logging import get_logger

log = get_logger(__name__)
CANCEL_TIMEOUT_S = 5.0
# Stop strings are applied at the gateway (`TextStream`); workers only see stop token ids.
GATEWAY_ONLY_SAMPLING = frozenset({"stop", "include_stop_str_in_output"})
_ERRORS: dict[grpc.StatusCode, type[errors.MeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.CANCELLED: errors.Unavailable,
    grpc.StatusCode.NOT_FOUND: errors.Unavailable,  # a worker lost the request (e.g. lease expired)
    grpc.StatusCode.ABORTED: errors.Unavailable,  # prefill lost the hand-off (lease ended first)
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
}


# transport details name peers ("ipv4:127.0.0.1:50061", "[::1]:50061"): not for clients' eyes
_PEER = re.compile(r"(?:ipv[46]:)?(?:\[[0-9a-fA-F:.%\w]*\]|\d{1,3}(?:\.\d{1,3}){3}|localhost):\d+")


def map_rpc_error(error: grpc.aio.AioRpcError, where: str) -> errors.MeshError:
    """A worker's status as the domain error the transports map to HTTP/gRPC statuses (network
    addresses in its details masked)."""
    cls = _ERRORS.get(error.code(), errors.MeshError)
    details = _PEER.sub("<peer>", error.details() or error.code().name)
    return cls(f"{where}: {details}")


def logprob_of(pb: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(pb.token_id, pb.logprob, tuple((t.token_id, t.logprob) for t in pb.top))


def chunk_of(pb: decode_pb2.TokenChunk) -> WorkerChunk:
    return WorkerChunk(
        tuple(pb.token_ids),
        tuple(logprob_of(lp) for lp in pb.logprobs),
        finish_reason_from_pb(pb.finish_reason),
        pb.stop_token_id,
        pb.num_prompt_tokens,
        pb.num_cached_tokens,
    )


def sampling_pb(request: GenerationRequest) -> common_pb2.SamplingParams:
    """The worker-side settings of a request."""
    return sampling_to_pb(request.params, exclude=GATEWAY_ONLY_SAMPLING)


class DecodeStream:
    """The decode stream of one request, with the chunks already in hand (first token, first
    read)."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall,
        decode: InstanceInfo,
        pending: list[WorkerChunk],
    ) -> None:
        self.call, self.instance_id, self.pending = call, decode.instance_id, pending
        self.where = _where(decode)
        self.prefill_path = ""  # where the prompt was computed (`start.Path`), set by the starter

    async def next(self) -> WorkerChunk | None:
        """The next chunk; None once the stream ended."""
        if self.pending:
            return self.pending.pop(0)
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, self.where) from None
        return None if msg is grpc.aio.EOF else chunk_of(msg)

    def close(self) -> None:
        if not self.call.done():
            self.call.cancel()


def _where(instance: InstanceInfo) -> str:
    return f"{instance.role} {instance.instance_id}"


class WorkerClient:
    """The decode and prefill RPCs the gateway makes; one channel per worker address."""

    def __init__(self, auth: MeshAuth = NO_AUTH) -> None:
        """`auth`: the gateway's mesh credentials, sent with every call (`grpc_server.channel`)."""
        self.auth = auth
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address, self.auth)
        return self._channels[address]

    def _decode(self, decode: InstanceInfo) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self._channel(decode.address))

    async def close(self) -> None:
        for open_channel in self._channels.values():
            await open_channel.close()
        self._channels.clear()

    async def generate(
        self, decode: InstanceInfo, request: GenerationRequest, timeout: float
    ) -> DecodeStream:
        """decode.Generate (the aggregated path), returned once its first message arrived."""
        call = self._decode(decode).Generate(
            decode_pb2.GenerateRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_ids,
                sampling=sampling_pb(request),
            ),
            timeout=timeout,
            metadata=request_metadata(request.request_id),
        )
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, _where(decode)) from None
        except BaseException:
            call.cancel()
            raise
        return DecodeStream(call, decode, [] if first is grpc.aio.EOF else [chunk_of(first)])

    async def reserve(
        self, decode: InstanceInfo, request: GenerationRequest, timeout: float
    ) -> common_pb2.KVTarget:
        """decode.Reserve: blocks for the prompt (ResourceExhausted when the rank is short of
        them)."""
        try:
            reserved = await self._decode(decode).Reserve(
                decode_pb2.ReserveRequest(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_ids,
                    sampling=sampling_pb(request),
                ),
                timeout=timeout,
                metadata=request_metadata(request.request_id),
            )
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, _where(decode)) from None
        return reserved.target

    async def prefill(
        self,
        prefill: InstanceInfo,
        request: GenerationRequest,
        target: common_pb2.KVTarget,
        timeout: float,
    ) -> prefill_pb2.PrefillResponse:
        """prefill.Prefill into reserved blocks; ABORTED (the reservation ended first) is
        `HandoffLost`."""
        stub = prefill_pb2_grpc.PrefillStub(self._channel(prefill.address))
        call = stub.Prefill(
            prefill_pb2.PrefillRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_ids,
                sampling=sampling_pb(request),
                target=target,
            ),
            timeout=timeout,
            metadata=request_metadata(request.request_id),
        )
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.ABORTED:
                raise HandoffLost(f"{_where(prefill)}: {e.details()}") from None
            raise map_rpc_error(e, _where(prefill)) from None
        except BaseException:
            call.cancel()
            raise

    async def decode(
        self,
        decode: InstanceInfo,
        request: GenerationRequest,
        first: prefill_pb2.PrefillResponse,
        timeout: float,
    ) -> DecodeStream:
        """decode.Decode with the prefill's first token, returned once decode admitted the request;
        the stream starts with that first token."""
        call = self._decode(decode).Decode(
            decode_pb2.DecodeRequest(
                request_id=request.request_id,
                first_token=first.first_token,
                num_cached_tokens=first.num_cached_tokens,
            ),
            timeout=timeout,
            metadata=request_metadata(request.request_id),
        )
        try:
            read = await _wait_admitted(call, _where(decode))
        except BaseException:
            call.cancel()
            raise
        logprobs = (logprob_of(first.first_token),) if request.params.logprobs is not None else ()
        head = WorkerChunk(
            (first.first_token.token_id,), logprobs, num_cached_tokens=first.num_cached_tokens
        )
        return DecodeStream(call, decode, [head, *read])

    async def longest_prefix(
        self, kvstore: InstanceInfo, block_hashes: list[bytes], timeout: float
    ) -> dict[str, int]:
        """kvstore.LongestPrefix: per rank id, how many leading blocks of `block_hashes` it
        holds (ranks holding none are absent)."""
        stub = kvstore_pb2_grpc.KVStoreStub(self._channel(kvstore.address))
        try:
            answer = await stub.LongestPrefix(
                kvstore_pb2.LongestPrefixRequest(block_hashes=block_hashes), timeout=timeout
            )
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, _where(kvstore)) from None
        return dict(answer.matched_blocks)

    async def cancel(self, decode: InstanceInfo, request_id: str) -> None:
        """decode.Cancel, best effort (the reservation's lease frees the blocks anyway)."""
        try:
            await self._decode(decode).Cancel(
                decode_pb2.CancelRequest(request_id=request_id),
                timeout=CANCEL_TIMEOUT_S,
                metadata=request_metadata(request_id),
            )
        except grpc.aio.AioRpcError as e:
            log.warning("cancel of reservation failed", request_id=request_id, code=e.code().name)


async def _wait_admitted(call: grpc.aio.UnaryStreamCall, where: str) -> list[WorkerChunk]:
    """Wait until decode admitted the request (`ADMITTED_METADATA`, or a first chunk from a decode
    rank that does not send it), returning the chunks read meanwhile. A call that ends first raises
    its error: NOT_FOUND / DEADLINE_EXCEEDED (the reservation ended before the KV came) as
    `HandoffLost`."""
    try:
        metadata = await call.initial_metadata()
        if metadata is not None and ADMITTED_METADATA in metadata:
            return []
        msg = await call.read()
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise HandoffLost(f"{where}: {e.details() or e.code().name}") from None
        raise map_rpc_error(e, where) from None
    return [] if msg is grpc.aio.EOF else [chunk_of(msg)]
