"""The gateway's side of the workers' gRPC APIs: status codes → domain errors, TokenChunks → engine-neutral
chunks, the decode stream of a request, and the gateway's Prometheus metrics.

`HandoffLost`: a disaggregated request's KV hand-off ended before decode admitted the request (Prefill
ABORTED: the reservation ended before the KV was ready; Decode NOT_FOUND / DEADLINE_EXCEEDED before
admission). Nothing reached the client yet, so the orchestrator retries the whole request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pdmesh_service import errors
from pdmesh_service.grpc_server import ADMITTED_METADATA
from pdmesh_gateway.core import GenerationRequest, TokenLogprob
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort"}
_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
           grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
           grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
           grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
           grpc.StatusCode.UNAVAILABLE: errors.Unavailable, grpc.StatusCode.CANCELLED: errors.Unavailable,
           grpc.StatusCode.NOT_FOUND: errors.Unavailable,      # a worker lost the request (e.g. lease expired)
           grpc.StatusCode.ABORTED: errors.Unavailable,        # prefill lost the hand-off (lease ended first)
           grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class HandoffLost(errors.Unavailable):
    """The request's KV hand-off ended before decode admitted it; retry the request from the start."""


class Overloaded(errors.ResourceExhausted):
    """The request waited at the gateway (prefill slot, decode blocks) until its timeout (not retried)."""


def map_rpc_error(error: grpc.aio.AioRpcError, where: str) -> errors.MeshError:
    """A worker's status as the domain error the transports map to HTTP/gRPC statuses."""
    cls = _ERRORS.get(error.code(), errors.MeshError)
    return cls(f"{where}: {error.details() or error.code().name}")


@dataclass
class Chunk:
    """A worker's TokenChunk (or the prefill's first token), engine-neutral."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


def logprob_of(lp: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))


def chunk_of(msg: decode_pb2.TokenChunk) -> Chunk:
    return Chunk(list(msg.token_ids), [logprob_of(lp) for lp in msg.logprobs], _FINISH.get(msg.finish_reason),
                 msg.stop_token_id, msg.num_prompt_tokens, msg.num_cached_tokens)


def sampling_proto(req: GenerationRequest) -> common_pb2.SamplingParams:
    """The worker-side settings (stop strings stay at the gateway)."""
    p = req.params
    proto = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                                      top_p=p.top_p, min_p=p.min_p, stop_token_ids=list(p.stop_token_ids),
                                      ignore_eos=p.ignore_eos, min_tokens=p.min_tokens)
    if p.seed is not None:
        proto.seed = p.seed - (1 << 64) if p.seed >= 1 << 63 else p.seed   # uint64 seeds wrap into int64
    if p.logprobs is not None:
        proto.logprobs = p.logprobs
    return proto


class Upstream:
    """The decode stream of one request, with the chunks already in hand (first token, first read)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, where: str, pending: list[Chunk]) -> None:
        self.call, self.where, self.pending = call, where, pending

    async def next(self) -> Chunk | None:
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


async def wait_admitted(call: grpc.aio.UnaryStreamCall, where: str) -> list[Chunk]:
    """Wait until decode admitted the request (`ADMITTED_METADATA`, or a first chunk from a decode rank that
    does not send it), returning the chunks read meanwhile. A call that ends first raises its error:
    NOT_FOUND / DEADLINE_EXCEEDED (the reservation ended before the KV came) as `HandoffLost`."""
    metadata = await call.initial_metadata()
    if metadata is not None and ADMITTED_METADATA in metadata:
        return []
    try:
        msg = await call.read()
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise HandoffLost(f"{where}: {e.details() or e.code().name}") from None
        raise map_rpc_error(e, where) from None
    return [] if msg is grpc.aio.EOF else [chunk_of(msg)]


class GatewayMetrics:
    """The gateway's Prometheus metrics; one set per registry (`for_registry`)."""

    _by_registry: dict[int, GatewayMetrics] = {}

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("pdmesh_requests", "Requests by final status", ["status"], registry=registry)
        self.ttft = Histogram("pdmesh_time_to_first_token_seconds", "Time to first token", registry=registry,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("pdmesh_time_per_output_token_seconds", "Time per output token after the first",
                              registry=registry, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.e2e = Histogram("pdmesh_e2e_request_latency_seconds", "Request latency", registry=registry,
                             buckets=_LATENCY_BUCKETS)
        self.in_flight = Gauge("pdmesh_requests_in_flight", "Requests being generated", registry=registry)
        self.waiting = Gauge("pdmesh_gateway_requests_waiting", "Requests queued at the gateway (for a prefill "
                             "slot or for decode KV blocks), part of the in-flight ones", registry=registry)
        self.prompt_tokens = Counter("pdmesh_prompt_tokens", "Prompt tokens", registry=registry)
        self.generation_tokens = Counter("pdmesh_generation_tokens", "Generated tokens", registry=registry)
        self.cached_tokens = Counter("pdmesh_cached_prompt_tokens", "Prompt tokens served from a prefix cache",
                                     registry=registry)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry | None = None) -> GatewayMetrics:
        registry = registry or REGISTRY
        if id(registry) not in cls._by_registry:
            cls._by_registry[id(registry)] = cls(registry)
        return cls._by_registry[id(registry)]

    def rejected(self, error: errors.MeshError) -> None:
        """A request refused before generation (validation, unknown model)."""
        self.requests.labels(status=error.error_type).inc()
