"""One request end to end over the workers' gRPC APIs, as a stream of engine-neutral events.

disagg (a prefill rank is up): decode.Reserve → prefill.Prefill(target) → the first token goes out
at once → decode.Decode(first token) streams the rest. agg, or no prefill rank up: decode.Generate.

Contracts:
- The first token of the disaggregated path comes from PrefillResponse; decode's Decode stream
  carries the tokens after it (the last chunk may carry no tokens, only the finish).
- Stop strings are applied here (`TextStream`); workers only see stop token ids.
- Closing the event iterator early (client gone) or a stop-string hit cancels the decode stream
  (that aborts the request on decode); a Prefill still in flight is cancelled and its reservation
  released with decode.Cancel.
- Retries (tenacity) only happen before the first event: Reserve/Generate failing UNAVAILABLE or
  RESOURCE_EXHAUSTED moves to another decode rank, a failing Prefill (UNAVAILABLE, or ABORTED: the
  reservation ended before the KV was ready) to another prefill rank, with a new Reserve under the same
  request id (the kvstore replaces the ended hand-off record).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from pdmesh.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdmesh.services.common import errors
from pdmesh.services.common.grpc_server import channel, request_metadata
from pdmesh.services.common.logging import get_logger
from pdmesh.services.gateway.core import GenerationEvent, GenerationRequest, TextStream, TokenLogprob, Usage
from pdmesh.services.gateway.router import NoInstance, Router
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

log = get_logger(__name__)
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


def map_rpc_error(error: grpc.aio.AioRpcError, where: str) -> errors.MeshError:
    """A worker's status as the domain error the transports map to HTTP/gRPC statuses."""
    cls = _ERRORS.get(error.code(), errors.MeshError)
    return cls(f"{where}: {error.details() or error.code().name}")


def _retryable(error: BaseException) -> bool:
    return isinstance(error, (errors.Unavailable, errors.ResourceExhausted)) and not isinstance(error, NoInstance)


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


@dataclass
class _Chunk:
    """A worker's TokenChunk (or the prefill's first token), engine-neutral."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token_id: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


def _logprob(lp: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))


def _chunk(msg: decode_pb2.TokenChunk) -> _Chunk:
    return _Chunk(list(msg.token_ids), [_logprob(lp) for lp in msg.logprobs], _FINISH.get(msg.finish_reason),
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


class _Upstream:
    """The decode stream of one request, with the chunks already in hand (first token, first read)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, where: str, pending: list[_Chunk]) -> None:
        self.call, self.where, self.pending = call, where, pending

    async def next(self) -> _Chunk | None:
        if self.pending:
            return self.pending.pop(0)
        try:
            msg = await self.call.read()
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, self.where) from None
        return None if msg is grpc.aio.EOF else _chunk(msg)

    def close(self) -> None:
        if not self.call.done():
            self.call.cancel()


class _Run:
    """Per-request state: detokenized text with stop strings, counts, timings."""

    def __init__(self, req: GenerationRequest, tokenizer: Tokenizer) -> None:
        params = req.params
        detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, params.skip_special_tokens)
        self.req, self.text = req, TextStream(detok, params.stop, params.include_stop_str_in_output)
        self.num_tokens, self.num_cached = 0, 0
        self.started, self.first_at, self.ended = time.monotonic(), 0.0, 0.0
        self.finished = False

    def event(self, chunk: _Chunk) -> GenerationEvent | None:
        """The event for one chunk (None if it carries nothing to tell)."""
        ids, lps, text = [], [], ""
        for k, token_id in enumerate(chunk.token_ids):
            if self.text.stop_hit:
                break
            ids.append(token_id)
            if self.req.params.logprobs is not None and k < len(chunk.logprobs):
                lps.append(chunk.logprobs[k])
            text += self.text.push([token_id])
        self.num_tokens += len(ids)
        self.num_cached = max(self.num_cached, chunk.num_cached_tokens)
        if ids and not self.first_at:
            self.first_at = time.monotonic()
        finish, stop_reason, usage = None, None, None
        if self.text.stop_hit is not None or chunk.finish_reason is not None:
            text += self.text.finish()
            if self.text.stop_hit is not None:
                finish, stop_reason = "stop", self.text.stop_hit
            else:
                finish = chunk.finish_reason
                stop_reason = (chunk.stop_token_id or None) if finish == "stop" else None
            usage = Usage(chunk.num_prompt_tokens or len(self.req.prompt_ids), self.num_tokens, self.num_cached)
            self.finished, self.ended = True, time.monotonic()
        if not (ids or text or finish):
            return None
        return GenerationEvent(tuple(ids), text, tuple(lps), finish, stop_reason, usage)


class Orchestrator:
    """Runs requests over the mesh; one per gateway process (it caches a channel per address)."""

    def __init__(self, router: Router, tokenizer: Tokenizer, *, mode: str = "disagg",
                 request_timeout_s: float = 300.0, metrics: GatewayMetrics | None = None,
                 max_attempts: int = 3) -> None:
        if mode not in ("disagg", "agg"):
            raise ValueError(f"mode must be 'disagg' or 'agg', got {mode!r}")
        self.router, self.tokenizer, self.mode = router, tokenizer, mode
        self.request_timeout_s, self.max_attempts = request_timeout_s, max_attempts
        self.metrics = metrics or GatewayMetrics.for_registry()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task] = set()
        self.active = 0                          # requests being generated now

    # ----- plumbing -----
    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = channel(address)
        return self._channels[address]

    def _decode(self, address: str) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self._channel(address))

    def _prefill(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self._channel(address))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, stub: decode_pb2_grpc.DecodeStub, request_id: str) -> None:
        """decode.Cancel, best effort (the reservation's lease frees the blocks anyway)."""
        try:
            await stub.Cancel(decode_pb2.CancelRequest(request_id=request_id), timeout=5.0,
                              metadata=request_metadata(request_id))
        except grpc.aio.AioRpcError as e:
            log.warning("cancel of reservation failed", request_id=request_id, code=e.code().name)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    def is_routable(self) -> bool:
        """Whether requests can be served now (a ready decode rank; prefill is optional)."""
        return self.router.has_ready("decode")

    # ----- the request -----
    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Events of one request; the last has finish_reason and usage. Close early to cancel."""
        run = _Run(req, self.tokenizer)
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        upstream: _Upstream | None = None
        status = "cancelled"
        self.metrics.in_flight.inc()
        self.active += 1
        try:
            upstream = await self._start(req, deadline)
            while (chunk := await upstream.next()) is not None:
                event = run.event(chunk)
                if event is not None and event.finish_reason is not None:
                    status = "success" if event.finish_reason != "abort" else "aborted"
                    yield event
                    return
                if event is not None:
                    yield event
            raise errors.Unavailable(f"{upstream.where}: the stream ended before the request finished")
        except errors.MeshError as e:
            status = e.error_type
            raise
        finally:
            if upstream is not None:
                upstream.close()
            self._observe(run, status)

    def _observe(self, run: _Run, status: str) -> None:
        m = self.metrics
        self.active -= 1
        m.in_flight.dec()
        m.requests.labels(status=status).inc()
        if run.first_at:
            m.ttft.observe(run.first_at - run.started)
        if run.finished:
            m.e2e.observe(run.ended - run.started)
            m.prompt_tokens.inc(len(run.req.prompt_ids))
            m.cached_tokens.inc(run.num_cached)
            if run.num_tokens > 1:
                m.tpot.observe((run.ended - run.first_at) / (run.num_tokens - 1))
        m.generation_tokens.inc(run.num_tokens)

    async def _start(self, req: GenerationRequest, deadline: float) -> _Upstream:
        """Open the request's decode stream; retried on another rank while nothing was sent."""
        excluded: set[str] = set()
        retrying = AsyncRetrying(stop=stop_after_attempt(self.max_attempts), reraise=True,
                                 wait=wait_exponential(multiplier=0.02, max=0.5), retry=retry_if_exception(_retryable))
        async for attempt in retrying:
            with attempt:
                prefills = [i for i in self.router.ready("prefill") if i.instance_id not in excluded]
                if self.mode == "disagg" and prefills:
                    return await self._start_disagg(req, deadline, excluded)
                return await self._start_agg(req, deadline, excluded)
        raise AssertionError("unreachable")   # pragma: no cover - AsyncRetrying reraises

    def _timeout(self, deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise errors.DeadlineExceeded(f"request timed out after {self.request_timeout_s:g}s")
        return left

    async def _start_agg(self, req: GenerationRequest, deadline: float, excluded: set[str]) -> _Upstream:
        decode = self.router.pick_decode(excluded)
        where = f"decode {decode.instance_id}"
        call = self._decode(decode.address).Generate(
            decode_pb2.GenerateRequest(request_id=req.request_id, prompt_token_ids=req.prompt_ids,
                                       sampling=sampling_proto(req)),
            timeout=self._timeout(deadline), metadata=request_metadata(req.request_id))
        self.router.note_sent(decode.instance_id)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as e:
            excluded.add(decode.instance_id)
            raise map_rpc_error(e, where) from None
        except BaseException:
            call.cancel()
            raise
        return _Upstream(call, where, [] if first is grpc.aio.EOF else [_chunk(first)])

    async def _start_disagg(self, req: GenerationRequest, deadline: float, excluded: set[str]) -> _Upstream:
        prefill = self.router.pick_prefill(excluded)
        decode = self.router.pick_decode(excluded)
        stub, md = self._decode(decode.address), request_metadata(req.request_id)
        try:
            reserved = await stub.Reserve(decode_pb2.ReserveRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=sampling_proto(req)),
                timeout=self._timeout(deadline), metadata=md)
        except grpc.aio.AioRpcError as e:
            excluded.add(decode.instance_id)
            raise map_rpc_error(e, f"decode {decode.instance_id}") from None
        self.router.note_sent(decode.instance_id)
        first = await self._prefill_once(req, prefill, reserved.target, stub, deadline, excluded)
        try:
            timeout = self._timeout(deadline)
        except errors.DeadlineExceeded:
            self._spawn(self._release(stub, req.request_id))
            raise
        call = stub.Decode(decode_pb2.DecodeRequest(request_id=req.request_id, first_token=first.first_token,
                                                    num_cached_tokens=first.num_cached_tokens),
                           timeout=timeout, metadata=md)
        lps = [_logprob(first.first_token)] if req.params.logprobs is not None else []
        head = _Chunk([first.first_token.token_id], lps, num_cached_tokens=first.num_cached_tokens)
        return _Upstream(call, f"decode {decode.instance_id}", [head])

    async def _prefill_once(self, req: GenerationRequest, prefill, target: common_pb2.KVTarget,
                            decode_stub: decode_pb2_grpc.DecodeStub, deadline: float,
                            excluded: set[str]) -> prefill_pb2.PrefillResponse:
        """Prefill into the reserved blocks; on failure or cancellation release the reservation."""
        self.router.prefill_started(prefill.instance_id)
        call = None
        try:
            call = self._prefill(prefill.address).Prefill(prefill_pb2.PrefillRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=sampling_proto(req),
                target=target), timeout=self._timeout(deadline), metadata=request_metadata(req.request_id))
            return await call
        except grpc.aio.AioRpcError as e:
            excluded.add(prefill.instance_id)
            await self._release(decode_stub, req.request_id)     # before a retry may reserve the id again
            raise map_rpc_error(e, f"prefill {prefill.instance_id}") from None
        except BaseException:                                      # cancelled: the client went away
            if call is not None:
                call.cancel()
            self._spawn(self._release(decode_stub, req.request_id))
            raise
        finally:
            self.router.prefill_finished(prefill.instance_id)
