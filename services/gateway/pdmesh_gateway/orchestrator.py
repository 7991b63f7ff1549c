"""One request end to end over the workers' gRPC APIs, as a stream of engine-neutral events.

disagg (a prefill rank is up): admission (a slot of a prefill rank, FCFS at the gateway) →
decode.Reserve
→ prefill.Prefill(target) → slot released → decode.Decode(first token) → the first token goes out
  once
decode admitted the request → the Decode stream carries the rest. agg, or no prefill rank up:
decode.Generate.

The pieces: `retry` decides what is tried again and how long to wait (pure), `upstream.WorkerClient`
makes the calls, `router` and `admission` pick ranks; this module composes them and keeps the
deadline, the gateway's waiting/active counts and the metrics.

Contracts:
- At most `max_prefill_inflight` requests per prefill rank are between Reserve and the end of their
  Prefill; the others wait at the gateway, before Reserve (`PrefillAdmission`), so decode blocks are
  never held for prompts queued in a prefill engine. A client that leaves while its request waits
  there leaves no trace on any worker.
- Reserve answering RESOURCE_EXHAUSTED (pool short) is retried, other decode ranks first, with
  backoff, until the request's timeout (then `Overloaded`, 503); only no ready decode rank at all is
  503 at once.
- The first token of the disaggregated path comes from PrefillResponse; decode's Decode stream
  carries the tokens after it (the last chunk may carry no tokens, only the finish). It is shown
  only once Decode admitted the request, so no request fails after its first token because of its
  hand-off.
- Stop strings are applied here (`RequestProgress`); workers only see stop token ids.
- Closing the event iterator early (client gone) or a stop-string hit cancels the decode stream
  (that aborts the request on decode); a Prefill still in flight is cancelled and its reservation
  released with decode.Cancel.
- Retries only happen before the first event (`retry.RetryPolicy`). A retry is a new Reserve under
  the same request id (the kvstore replaces the ended hand-off record; the prefill's prefix cache
  makes it cheap).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator
from enum import StrEnum

from tenacity import AsyncRetrying, RetryCallState

from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.admission import PrefillAdmission
from pdmesh_gateway.core import GenerationEvent, GenerationRequest
from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.progress import RequestProgress
from pdmesh_gateway.retry import (
    BlocksWait,
    DecodeFull,
    HandoffLost,
    Overloaded,
    RetryPolicy,
    StartRetry,
)
from pdmesh_gateway.router import NoInstance, Router
from pdmesh_gateway.upstream import DecodeStream, WorkerClient
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.prefill.v1 import prefill_pb2
from pdmesh_service import errors
from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.logging import get_logger
from pdmesh_service.tasks import Background

__all__ = ["GatewayMetrics", "Mode", "Orchestrator"]
log = get_logger(__name__)
DEFAULT_MAX_PREFILL_INFLIGHT = 2
CLOSE_GRACE_S = 2.0  # how long `close` lets reservation releases finish before cancelling them


class Mode(StrEnum):
    """disagg: prefill ranks compute prompts (decode prefills itself when none is up); agg: decode
    does all."""

    DISAGG = "disagg"
    AGG = "agg"

    def __str__(self) -> str:
        return self.value


class Orchestrator:
    """Runs requests over the mesh; one per gateway process (its `WorkerClient` caches a channel per
    address). `active`: requests being generated now, waiting ones included; `waiting`: of those,
    the ones waiting at the gateway (for a prefill slot or for decode blocks)."""

    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        *,
        metrics: GatewayMetrics,
        mode: Mode | str = Mode.DISAGG,
        request_timeout_s: float = 300.0,
        max_attempts: int = 3,
        max_prefill_inflight: int = DEFAULT_MAX_PREFILL_INFLIGHT,
        handoff_retries: int = 1,
    ) -> None:
        self.router, self.tokenizer, self.metrics = router, tokenizer, metrics
        self.mode = Mode(mode)
        self.request_timeout_s = request_timeout_s
        self.retry_policy = RetryPolicy(max_attempts=max_attempts, handoff_retries=handoff_retries)
        self.admission = PrefillAdmission(max_prefill_inflight)
        self.workers = WorkerClient()
        self.background = Background()
        self.active = 0
        self.waiting = 0

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + CLOSE_GRACE_S
        while len(self.background) and loop.time() < until:
            await asyncio.sleep(0.01)
        await self.background.close()
        await self.workers.close()

    def is_routable(self) -> bool:
        """Whether requests can be served now (a ready decode rank; prefill is optional)."""
        return self.router.has_ready(Role.DECODE)

    # ----- the request -----
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        """Events of one request; the last has finish_reason and usage. Close early to cancel."""
        progress = RequestProgress(request, self.tokenizer)
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        stream: DecodeStream | None = None
        status = "cancelled"
        self.metrics.in_flight.inc()
        self.active += 1
        try:
            stream = await self._start(request, deadline)
            while (chunk := await stream.next()) is not None:
                event = progress.event(chunk)
                if event is None:
                    continue
                if event.finish_reason is not None:
                    status = "success" if event.finish_reason != "abort" else "aborted"
                yield event
                if progress.finished:
                    return
            raise errors.Unavailable(
                f"{stream.where}: the stream ended before the request finished"
            )
        except errors.MeshError as e:
            status = e.error_type
            raise
        finally:
            if stream is not None:
                stream.close()
            self.active -= 1
            self.metrics.in_flight.dec()
            self.metrics.ended(progress, status)

    async def _start(self, request: GenerationRequest, deadline: float) -> DecodeStream:
        """Open the request's decode stream, tried again as `retry_policy` says (nothing was sent
        yet)."""
        excluded: set[str] = set()  # ranks that failed this request
        decisions = StartRetry(self.retry_policy)

        def before_sleep(state: RetryCallState) -> None:
            if isinstance(decisions.failures[-1], HandoffLost):
                log.info(
                    "hand-off lost before the first token; retrying the request",
                    request_id=request.request_id,
                    reason=str(decisions.failures[-1]),
                )

        retrying = AsyncRetrying(
            retry=decisions.retry, wait=decisions.wait, before_sleep=before_sleep
        )
        return await retrying(self._start_once, request, deadline, excluded)

    async def _start_once(
        self, request: GenerationRequest, deadline: float, excluded: set[str]
    ) -> DecodeStream:
        if self.mode is Mode.DISAGG:
            rank = await self._admit(deadline, excluded)
            if rank is not None:
                return await self._start_disagg(request, deadline, excluded, rank)
        decode = self.router.pick_decode(excluded)
        timeout = self._timeout(deadline)
        self.router.note_sent(decode.instance_id)
        try:
            return await self.workers.generate(decode, request, timeout)
        except errors.MeshError:
            excluded.add(decode.instance_id)
            raise

    def _timeout(self, deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise errors.DeadlineExceeded(f"request timed out after {self.request_timeout_s:g}s")
        return left

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Counts the request as waiting at the gateway (for a prefill slot or for decode
        blocks)."""
        self.waiting += 1
        self.metrics.waiting.inc()
        try:
            yield
        finally:
            self.waiting -= 1
            self.metrics.waiting.dec()

    async def _admit(self, deadline: float, excluded: set[str]) -> str | None:
        """A slot of a ready prefill rank, FCFS (`PrefillAdmission`); None when no prefill rank is
        usable."""

        def ranks() -> list[str]:
            return [
                i.instance_id
                for i in self.router.ready(Role.PREFILL)
                if i.instance_id not in excluded
            ]

        with self._waiting():
            try:
                return await asyncio.wait_for(
                    self.admission.acquire(ranks), self._timeout(deadline)
                )
            except TimeoutError:
                raise Overloaded(
                    f"no prefill slot was free within the request timeout "
                    f"({self.request_timeout_s:g}s)"
                ) from None

    async def _start_disagg(
        self, request: GenerationRequest, deadline: float, excluded: set[str], rank: str
    ) -> DecodeStream:
        """Reserve → Prefill while holding the admission slot of `rank`, then Decode."""
        try:
            prefill = next(
                (i for i in self.router.ready(Role.PREFILL) if i.instance_id == rank), None
            )
            if prefill is None:
                raise errors.Unavailable(f"prefill {rank} left the mesh")
            decode, target = await self._reserve(request, deadline, excluded)
            first = await self._prefill(request, prefill, decode, target, deadline, excluded)
        finally:
            self.admission.release(rank)
        return await self._decode(request, decode, first, deadline, excluded)

    async def _reserve(
        self, request: GenerationRequest, deadline: float, excluded: set[str]
    ) -> tuple[InstanceInfo, common_pb2.KVTarget]:
        """Blocks on a ready decode rank: passes over the ranks (`_reserve_pass`), waiting between
        passes while every rank is short of blocks, until the deadline (then `Overloaded`)."""
        loop = asyncio.get_running_loop()
        wait = BlocksWait(remaining=lambda: deadline - loop.time())

        async def sleep(seconds: float) -> None:
            with self._waiting():
                await asyncio.sleep(seconds)

        def overloaded(state: RetryCallState) -> None:
            raise Overloaded(
                f"no decode rank had free KV blocks within the request timeout "
                f"({self.request_timeout_s:g}s)"
            )

        retrying = AsyncRetrying(
            retry=wait.retry,
            wait=wait.wait,
            stop=wait.stop,
            sleep=sleep,
            retry_error_callback=overloaded,
        )
        return await retrying(self._reserve_pass, request, deadline, excluded)

    async def _reserve_pass(
        self, request: GenerationRequest, deadline: float, excluded: set[str]
    ) -> tuple[InstanceInfo, common_pb2.KVTarget]:
        """Reserve on the least loaded decode rank that has the blocks. A rank short of them is
        skipped for this pass, an unavailable one for the request (`excluded`). `NoInstance` when no
        rank is left at all, `DecodeFull` when the ones left were all short of blocks (or the
        deadline passed while waiting)."""
        if deadline <= asyncio.get_running_loop().time():
            raise DecodeFull("no time was left to reserve decode blocks")
        full: set[str] = set()
        while True:
            try:
                decode = self.router.pick_decode(excluded | full)
            except NoInstance:
                if not full:
                    raise
                raise DecodeFull(f"decode ranks {sorted(full)} are short of KV blocks") from None
            try:
                target = await self.workers.reserve(decode, request, self._timeout(deadline))
            except errors.ResourceExhausted:
                full.add(decode.instance_id)
                continue
            except errors.Unavailable:
                excluded.add(decode.instance_id)
                continue
            self.router.note_sent(decode.instance_id)
            return decode, target

    async def _prefill(
        self,
        request: GenerationRequest,
        prefill: InstanceInfo,
        decode: InstanceInfo,
        target: common_pb2.KVTarget,
        deadline: float,
        excluded: set[str],
    ) -> prefill_pb2.PrefillResponse:
        """Prefill into the reserved blocks; on failure or cancellation release the reservation. A
        failing prefill rank is excluded, unless the hand-off was lost (`HandoffLost`: the rank is
        fine)."""
        self.router.prefill_started(prefill.instance_id)
        try:
            return await self.workers.prefill(prefill, request, target, self._timeout(deadline))
        except errors.MeshError as e:
            # before a retry may reserve the id again
            await self.workers.cancel(decode, request.request_id)
            if not isinstance(e, HandoffLost):
                excluded.add(prefill.instance_id)
            raise
        except BaseException:  # cancelled: the client went away
            self.background.spawn(self.workers.cancel(decode, request.request_id))
            raise
        finally:
            self.router.prefill_finished(prefill.instance_id)

    async def _decode(
        self,
        request: GenerationRequest,
        decode: InstanceInfo,
        first: prefill_pb2.PrefillResponse,
        deadline: float,
        excluded: set[str],
    ) -> DecodeStream:
        """decode.Decode with the first token, returned once decode admitted the request (so that
        the first token is never shown for a request that then fails: until then a failure is
        retried invisibly)."""
        try:
            timeout = self._timeout(deadline)
        except errors.DeadlineExceeded:
            self.background.spawn(self.workers.cancel(decode, request.request_id))
            raise
        try:
            return await self.workers.decode(decode, request, first, timeout)
        except errors.MeshError as e:
            if not isinstance(e, HandoffLost):
                excluded.add(decode.instance_id)
                await self.workers.cancel(decode, request.request_id)
            raise
