"""One request end to end over the workers' gRPC APIs, as a stream of engine-neutral events.

disagg (a prefill rank is up): admission (a slot of a prefill rank, FCFS at the gateway) → decode.Reserve
→ prefill.Prefill(target) → slot released → decode.Decode(first token) → the first token goes out once
decode admitted the request → the Decode stream carries the rest. agg, or no prefill rank up:
decode.Generate.

Contracts:
- At most `max_prefill_inflight` requests per prefill rank are between Reserve and the end of their
  Prefill; the others wait at the gateway, before Reserve (`PrefillAdmission`), so decode blocks are
  never held for prompts queued in a prefill engine. A client that leaves while its request waits there
  leaves no trace on any worker.
- Reserve answering RESOURCE_EXHAUSTED (pool short) is retried, other decode ranks first, with backoff,
  until the request's timeout (then `Overloaded`, 503); only no ready decode rank at all is 503 at once.
- The first token of the disaggregated path comes from PrefillResponse; decode's Decode stream
  carries the tokens after it (the last chunk may carry no tokens, only the finish). It is shown only
  once Decode admitted the request (`wait_admitted`), so no request fails after its first token
  because of its hand-off.
- Stop strings are applied here (`TextStream`); workers only see stop token ids.
- Closing the event iterator early (client gone) or a stop-string hit cancels the decode stream
  (that aborts the request on decode); a Prefill still in flight is cancelled and its reservation
  released with decode.Cancel.
- Retries only happen before the first event: Reserve/Generate failing UNAVAILABLE moves to another
  decode rank, a failing Prefill (UNAVAILABLE) to another prefill rank, up to `max_attempts` tries; a
  lost hand-off (`HandoffLost`: Prefill ABORTED, Decode NOT_FOUND / DEADLINE_EXCEEDED before admission)
  is retried `handoff_retries` times on any rank. A retry is a new Reserve under the same request id
  (the kvstore replaces the ended hand-off record; the prefill's prefix cache makes it cheap).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from pdmesh_engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdmesh_service import errors
from pdmesh_service.grpc_server import channel, request_metadata
from pdmesh_service.logging import get_logger
from pdmesh_gateway.admission import PrefillAdmission
from pdmesh_gateway.core import GenerationEvent, GenerationRequest, TextStream, Usage
from pdmesh_gateway.router import NoInstance, Router
from pdmesh_gateway.upstream import (Chunk, GatewayMetrics, HandoffLost, Overloaded, Upstream,
                                              chunk_of, logprob_of, map_rpc_error, sampling_proto, wait_admitted)
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

__all__ = ["GatewayMetrics", "Orchestrator"]
log = get_logger(__name__)
RETRY_BACKOFF_S, MAX_BACKOFF_S = 0.02, 0.5         # first wait before a retry, doubling up to the cap
DEFAULT_MAX_PREFILL_INFLIGHT = 2


def _retryable(error: BaseException) -> bool:
    return isinstance(error, (errors.Unavailable, errors.ResourceExhausted)) and \
        not isinstance(error, (NoInstance, Overloaded))


class _Run:
    """Per-request state: detokenized text with stop strings, counts, timings."""

    def __init__(self, req: GenerationRequest, tokenizer: Tokenizer) -> None:
        params = req.params
        detok = IncrementalDetokenizer(tokenizer, req.prompt_ids, params.skip_special_tokens)
        self.req, self.text = req, TextStream(detok, params.stop, params.include_stop_str_in_output)
        self.num_tokens, self.num_cached = 0, 0
        self.started, self.first_at, self.ended = time.monotonic(), 0.0, 0.0
        self.finished = False

    def event(self, chunk: Chunk) -> GenerationEvent | None:
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
                 max_attempts: int = 3, max_prefill_inflight: int = DEFAULT_MAX_PREFILL_INFLIGHT,
                 handoff_retries: int = 1) -> None:
        if mode not in ("disagg", "agg"):
            raise ValueError(f"mode must be 'disagg' or 'agg', got {mode!r}")
        self.router, self.tokenizer, self.mode = router, tokenizer, mode
        self.request_timeout_s, self.max_attempts = request_timeout_s, max_attempts
        self.handoff_retries = handoff_retries
        self.admission = PrefillAdmission(max_prefill_inflight)
        self.metrics = metrics or GatewayMetrics.for_registry()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task] = set()
        self.active = 0                          # requests being generated now (waiting ones included)
        self.waiting = 0                         # ... of which waiting at the gateway (prefill slot, decode blocks)

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
        upstream: Upstream | None = None
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

    async def _start(self, req: GenerationRequest, deadline: float) -> Upstream:
        """Open the request's decode stream; retried while nothing was sent to the client: a failing rank
        (UNAVAILABLE, RESOURCE_EXHAUSTED) up to `max_attempts` times, on another rank; a lost hand-off
        (`HandoffLost`) `handoff_retries` times, as a new request on any rank."""
        excluded: set[str] = set()
        failures = lost = 0
        while True:
            try:
                return await self._start_once(req, deadline, excluded)
            except HandoffLost as e:
                lost += 1
                if lost > self.handoff_retries:
                    raise
                log.info("hand-off lost before the first token; retrying the request", request_id=req.request_id,
                         reason=str(e))
            except (errors.Unavailable, errors.ResourceExhausted) as e:
                failures += 1
                if not _retryable(e) or failures >= self.max_attempts:
                    raise
                await asyncio.sleep(min(RETRY_BACKOFF_S * 2 ** failures, MAX_BACKOFF_S))

    async def _start_once(self, req: GenerationRequest, deadline: float, excluded: set[str]) -> Upstream:
        if self.mode == "disagg":
            rank = await self._admit(deadline, excluded)
            if rank is not None:
                return await self._start_disagg(req, deadline, excluded, rank)
        return await self._start_agg(req, deadline, excluded)

    def _timeout(self, deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise errors.DeadlineExceeded(f"request timed out after {self.request_timeout_s:g}s")
        return left

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Counts the request as waiting at the gateway (for a prefill slot or for decode blocks)."""
        self.waiting += 1
        self.metrics.waiting.inc()
        try:
            yield
        finally:
            self.waiting -= 1
            self.metrics.waiting.dec()

    async def _admit(self, deadline: float, excluded: set[str]) -> str | None:
        """A slot of a ready prefill rank, FCFS (`PrefillAdmission`); None when no prefill rank is usable."""
        def ranks() -> list[str]:
            return [i.instance_id for i in self.router.ready("prefill") if i.instance_id not in excluded]

        with self._waiting():
            try:
                return await asyncio.wait_for(self.admission.acquire(ranks), self._timeout(deadline))
            except asyncio.TimeoutError:
                raise Overloaded(f"no prefill slot was free within the request timeout "
                                 f"({self.request_timeout_s:g}s)") from None

    async def _start_agg(self, req: GenerationRequest, deadline: float, excluded: set[str]) -> Upstream:
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
        return Upstream(call, where, [] if first is grpc.aio.EOF else [chunk_of(first)])

    async def _start_disagg(self, req: GenerationRequest, deadline: float, excluded: set[str],
                            rank: str) -> Upstream:
        """Reserve → Prefill while holding the admission slot of `rank`, then Decode."""
        try:
            prefill = next((i for i in self.router.ready("prefill") if i.instance_id == rank), None)
            if prefill is None:
                raise errors.Unavailable(f"prefill {rank} left the mesh")
            decode, stub, target = await self._reserve(req, deadline, excluded)
            first = await self._prefill_once(req, prefill, target, stub, deadline, excluded)
        finally:
            self.admission.release(rank)
        return await self._decode_call(req, decode, stub, first, deadline, excluded)

    async def _reserve(self, req: GenerationRequest, deadline: float,
                       excluded: set[str]) -> tuple[Any, decode_pb2_grpc.DecodeStub, common_pb2.KVTarget]:
        """Blocks on a ready decode rank, the least loaded first. A rank short of blocks (RESOURCE_EXHAUSTED)
        is tried again after the others, with backoff, until the deadline (then `Overloaded`); an unavailable
        one is excluded (`NoInstance` once no rank is left)."""
        delay = RETRY_BACKOFF_S
        while True:
            full: set[str] = set()
            while True:
                try:
                    decode = self.router.pick_decode(excluded | full)
                except NoInstance:
                    if not full:
                        raise
                    break
                try:
                    stub = self._decode(decode.address)
                    return decode, stub, await self._reserve_on(stub, decode, req, deadline)
                except errors.ResourceExhausted:
                    full.add(decode.instance_id)
                except errors.Unavailable:
                    excluded.add(decode.instance_id)
            with self._waiting():
                await asyncio.sleep(min(delay, max(deadline - asyncio.get_running_loop().time(), 0.0)))
            if deadline <= asyncio.get_running_loop().time():
                raise Overloaded(f"no decode rank had free KV blocks within the request timeout "
                                 f"({self.request_timeout_s:g}s)")
            delay = min(delay * 2, MAX_BACKOFF_S)

    async def _reserve_on(self, stub: decode_pb2_grpc.DecodeStub, decode, req: GenerationRequest,
                          deadline: float) -> common_pb2.KVTarget:
        try:
            reserved = await stub.Reserve(decode_pb2.ReserveRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=sampling_proto(req)),
                timeout=self._timeout(deadline), metadata=request_metadata(req.request_id))
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, f"decode {decode.instance_id}") from None
        self.router.note_sent(decode.instance_id)
        return reserved.target

    async def _prefill_once(self, req: GenerationRequest, prefill, target: common_pb2.KVTarget,
                            decode_stub: decode_pb2_grpc.DecodeStub, deadline: float,
                            excluded: set[str]) -> prefill_pb2.PrefillResponse:
        """Prefill into the reserved blocks; on failure or cancellation release the reservation. ABORTED
        (the reservation ended before the KV was ready) is `HandoffLost`: the rank is fine."""
        self.router.prefill_started(prefill.instance_id)
        call = None
        try:
            call = self._prefill(prefill.address).Prefill(prefill_pb2.PrefillRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_ids, sampling=sampling_proto(req),
                target=target), timeout=self._timeout(deadline), metadata=request_metadata(req.request_id))
            return await call
        except grpc.aio.AioRpcError as e:
            await self._release(decode_stub, req.request_id)     # before a retry may reserve the id again
            where = f"prefill {prefill.instance_id}"
            if e.code() == grpc.StatusCode.ABORTED:
                raise HandoffLost(f"{where}: {e.details()}") from None
            excluded.add(prefill.instance_id)
            raise map_rpc_error(e, where) from None
        except BaseException:                                      # cancelled: the client went away
            if call is not None:
                call.cancel()
            self._spawn(self._release(decode_stub, req.request_id))
            raise
        finally:
            self.router.prefill_finished(prefill.instance_id)

    async def _decode_call(self, req: GenerationRequest, decode, stub: decode_pb2_grpc.DecodeStub,
                           first: prefill_pb2.PrefillResponse, deadline: float, excluded: set[str]) -> Upstream:
        """decode.Decode with the first token, returned once decode admitted the request (so that the first
        token is never shown for a request that then fails: until then a failure is retried invisibly)."""
        try:
            timeout = self._timeout(deadline)
        except errors.DeadlineExceeded:
            self._spawn(self._release(stub, req.request_id))
            raise
        where = f"decode {decode.instance_id}"
        call = stub.Decode(decode_pb2.DecodeRequest(request_id=req.request_id, first_token=first.first_token,
                                                    num_cached_tokens=first.num_cached_tokens),
                           timeout=timeout, metadata=request_metadata(req.request_id))
        try:
            read = await wait_admitted(call, where)
        except errors.MeshError as e:
            if not isinstance(e, HandoffLost):
                excluded.add(decode.instance_id)
                await self._release(stub, req.request_id)
            raise
        except BaseException:
            call.cancel()
            raise
        lps = [logprob_of(first.first_token)] if req.params.logprobs is not None else []
        head = Chunk([first.first_token.token_id], lps, num_cached_tokens=first.num_cached_tokens)
        return Upstream(call, where, [head, *read])

