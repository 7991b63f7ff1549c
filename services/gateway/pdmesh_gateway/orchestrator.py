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
  makes it cheap). A rank that failed the request is skipped for it until it heartbeats again
  (`retry.Exclusions`: a restarted rank is back in play at once).
- After the first event, a decode rank lost mid-stream is survived by migration
  (`migration`): the request goes on from its tokens so far on another rank, at most
  `max_migrations` times; the client sees one stream, every token once.
- No call waits on a dead or paused rank: every worker call is abandoned once one of its ranks left
  the registry (`_while_live`; the router's `is_live`), Reserve has its own short deadline, and with
  no decode rank at all a request waits up to `unroutable_wait_s` for one before 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncGenerator, Awaitable, Iterator
from enum import StrEnum
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState

from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.admission import PrefillAdmission
from pdmesh_gateway.core import GenerationEvent, GenerationRequest, WorkerChunk
from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.migration import (
    DEFAULT_MAX_MIGRATIONS,
    MigrationsExhausted,
    continuation,
    is_rank_loss,
    tried,
)
from pdmesh_gateway.progress import RequestProgress
from pdmesh_gateway.retry import (
    BlocksWait,
    DecodeFull,
    Exclusions,
    HandoffLost,
    Overloaded,
    RankGone,
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
T = TypeVar("T")
DEFAULT_MAX_PREFILL_INFLIGHT = 2
CLOSE_GRACE_S = 2.0  # how long `close` lets reservation releases finish before cancelling them
# tries of a request's start against failing ranks, and the longest wait between two: together
# they outlast a kvstore or worker restart (about 10 s of waiting)
DEFAULT_MAX_ATTEMPTS, RETRY_MAX_BACKOFF_S = 16, 1.0
DEFAULT_UNROUTABLE_WAIT_S = 20.0  # how long a request waits for a decode rank when none is up
RESERVE_TIMEOUT_S = 15.0  # a Reserve is one engine-thread command: longer means a stuck rank
LIVENESS_POLL_S = 0.25  # how often an open call checks that its ranks are still registered


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
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        max_prefill_inflight: int = DEFAULT_MAX_PREFILL_INFLIGHT,
        handoff_retries: int = 2,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        unroutable_wait_s: float = DEFAULT_UNROUTABLE_WAIT_S,
        workers: WorkerClient | None = None,  # default: one without mesh credentials
    ) -> None:
        self.router, self.tokenizer, self.metrics = router, tokenizer, metrics
        self.mode = Mode(mode)
        self.request_timeout_s = request_timeout_s
        self.retry_policy = RetryPolicy(
            max_attempts=max_attempts,
            handoff_retries=handoff_retries,
            max_backoff_s=RETRY_MAX_BACKOFF_S,
        )
        if max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {max_migrations}")
        self.max_migrations, self.unroutable_wait_s = max_migrations, unroutable_wait_s
        self.admission = PrefillAdmission(max_prefill_inflight)
        self.workers = workers if workers is not None else WorkerClient()
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
        """Events of one request; the last has finish_reason and usage. Close early to cancel.

        A decode rank lost mid-stream (`migration.is_rank_loss`) is not the request's end: it goes
        on from the tokens generated so far on another rank (`migration.continuation`), up to
        `max_migrations` times."""
        progress = RequestProgress(request, self.tokenizer)
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        excluded = Exclusions()  # decode ranks that failed this request
        tries = itertools.count()  # every try of the request gets an id of its own (`tried`)
        attempt: GenerationRequest | None = request
        status = "cancelled"
        self.metrics.in_flight.inc()
        self.active += 1
        try:
            while attempt is not None:
                stream = await self._start(attempt, deadline, excluded, tries)
                try:
                    async for event in self._relay(stream, progress):
                        if event.finish_reason is not None:
                            status = "success" if event.finish_reason != "abort" else "aborted"
                        yield event
                    return
                except errors.MeshError as e:
                    if not is_rank_loss(e):
                        raise
                    excluded.add(stream.instance_id)
                    attempt = self._migrate(request, progress, e)
                finally:
                    stream.close()
            # the lost rank had generated every token but had not said so yet
            event = progress.event(WorkerChunk((), finish_reason="length"))
            if event is not None:
                status = "success"
                yield event
        except errors.MeshError as e:
            status = e.error_type
            raise
        finally:
            self.active -= 1
            self.metrics.in_flight.dec()
            self.metrics.ended(progress, status)

    def _migrate(
        self, request: GenerationRequest, progress: RequestProgress, error: errors.MeshError
    ) -> GenerationRequest | None:
        """The continuation of `request` after its decode rank failed with `error`; raises
        `MigrationsExhausted` past `max_migrations`."""
        if progress.num_migrations >= self.max_migrations:
            raise MigrationsExhausted(
                f"the request's decode rank failed {progress.num_migrations + 1} times "
                f"(--max-migrations {self.max_migrations}); last: {error}"
            ) from error
        progress.migrated()
        self.metrics.migrations.inc()
        log.warning(
            "decode rank lost mid-stream; continuing the request on another rank",
            request_id=request.request_id,
            tokens_done=progress.num_tokens,
            migration=progress.num_migrations,
            reason=str(error),
        )
        return continuation(request, progress.output_ids, progress.num_migrations)

    async def _relay(
        self, stream: DecodeStream, progress: RequestProgress
    ) -> AsyncGenerator[GenerationEvent, None]:
        """The client events of one decode stream, until the request finished. A stream that ends
        early, aborts the request or whose rank leaves the registry raises `Unavailable`."""
        while True:
            chunk = await self._while_live(stream.next(), stream.instance_id)
            if chunk is None:
                raise errors.Unavailable(
                    f"{stream.where}: the stream ended before the request finished"
                )
            if chunk.finish_reason == "abort":  # the rank dropped it: we did not ask
                raise errors.Unavailable(f"{stream.where}: the request was aborted")
            event = progress.event(chunk)
            if event is not None:
                yield event
            if progress.finished:
                return

    async def _while_live(self, call: Awaitable[T], *instance_ids: str) -> T:
        """Await `call`, abandoned (`RankGone`) as soon as one of the ranks leaves the registry: a
        dead or paused rank never holds a request (nor its prefill admission slot) longer than its
        registry TTL."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
                if done:
                    return task.result()
                gone = [i for i in instance_ids if not self.router.is_live(i)]
                if gone:
                    raise RankGone(gone[0], f"{gone[0]} left the registry (not heartbeating)")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _start(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        tries: Iterator[int],
    ) -> DecodeStream:
        """Open the request's decode stream, tried again as `retry_policy` says (nothing was sent
        yet); with no decode rank to try, wait up to `unroutable_wait_s` for one (a restarting
        rank, a registry refilling after a Redis restart)."""
        loop = asyncio.get_running_loop()
        give_up_at = min(deadline, loop.time() + self.unroutable_wait_s)
        while True:
            try:
                return await self._start_retrying(request, deadline, excluded, tries)
            except NoInstance:
                if not await self._wait_routable(excluded, give_up_at):
                    raise
                self.metrics.retries.inc()

    async def _wait_routable(self, excluded: Exclusions, until: float) -> bool:
        """Until a decode rank this request may use is ready (True) or `until` passed (False)."""
        loop = asyncio.get_running_loop()
        with self._waiting():
            while loop.time() < until:
                if any(not excluded.blocks(i) for i in self.router.ready(Role.DECODE)):
                    return True
                await asyncio.sleep(LIVENESS_POLL_S)
        return False

    async def _start_retrying(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        tries: Iterator[int],
    ) -> DecodeStream:
        decisions = StartRetry(self.retry_policy)

        def before_sleep(state: RetryCallState) -> None:
            self.metrics.retries.inc()
            log.info(
                "request start failed before the first token; retrying",
                request_id=request.request_id,
                reason=str(decisions.failures[-1]),
            )

        retrying = AsyncRetrying(
            retry=decisions.retry, wait=decisions.wait, before_sleep=before_sleep
        )

        async def start_once() -> DecodeStream:
            return await self._start_once(tried(request, next(tries)), deadline, excluded)

        return await retrying(start_once)

    def _skipped(self, excluded: Exclusions) -> set[str]:
        return excluded.blocked(self.router.snapshot())

    async def _start_once(
        self, request: GenerationRequest, deadline: float, excluded: Exclusions
    ) -> DecodeStream:
        if self.mode is Mode.DISAGG:
            rank = await self._admit(deadline, excluded)
            if rank is not None:
                return await self._start_disagg(request, deadline, excluded, rank)
        decode = self.router.pick_decode(self._skipped(excluded))
        timeout = self._timeout(deadline)
        self.router.note_sent(decode.instance_id)
        try:
            return await self._while_live(
                self.workers.generate(decode, request, timeout), decode.instance_id
            )
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

    async def _admit(self, deadline: float, excluded: Exclusions) -> str | None:
        """A slot of a ready prefill rank, FCFS (`PrefillAdmission`); None when no prefill rank is
        usable."""

        def ranks() -> list[str]:
            return [
                i.instance_id for i in self.router.ready(Role.PREFILL) if not excluded.blocks(i)
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
        self, request: GenerationRequest, deadline: float, excluded: Exclusions, rank: str
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
        self, request: GenerationRequest, deadline: float, excluded: Exclusions
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
        self, request: GenerationRequest, deadline: float, excluded: Exclusions
    ) -> tuple[InstanceInfo, common_pb2.KVTarget]:
        """Reserve on the least loaded decode rank that has the blocks. A rank short of them is
        skipped for this pass (it holds nothing under the id). A rank that fails otherwise is
        skipped for the request (`excluded`, until it heartbeats again) and ends this try: it may
        have left a reservation or a live hand-off record under the try's id, which no rank may
        be asked for again; the next try has an id of its own. `NoInstance` when no rank is left at
        all, `DecodeFull` when the ones left were all short of blocks (or the deadline passed
        while waiting)."""
        if deadline <= asyncio.get_running_loop().time():
            raise DecodeFull("no time was left to reserve decode blocks")
        full: set[str] = set()
        while True:
            try:
                decode = self.router.pick_decode(self._skipped(excluded) | full)
            except NoInstance:
                if not full:
                    raise
                raise DecodeFull(f"decode ranks {sorted(full)} are short of KV blocks") from None
            timeout = min(self._timeout(deadline), RESERVE_TIMEOUT_S)
            try:
                target = await self._while_live(
                    self.workers.reserve(decode, request, timeout), decode.instance_id
                )
            except errors.ResourceExhausted:
                full.add(decode.instance_id)
                continue
            except errors.DeadlineExceeded:
                self._timeout(deadline)  # the request's own deadline passed: DeadlineExceeded
                excluded.add(decode.instance_id)  # else the rank did not answer in time
                raise errors.Unavailable(f"{decode.instance_id} did not answer Reserve") from None
            except errors.Unavailable:
                excluded.add(decode.instance_id)
                raise
            self.router.note_sent(decode.instance_id)
            return decode, target

    async def _prefill(
        self,
        request: GenerationRequest,
        prefill: InstanceInfo,
        decode: InstanceInfo,
        target: common_pb2.KVTarget,
        deadline: float,
        excluded: Exclusions,
    ) -> prefill_pb2.PrefillResponse:
        """Prefill into the reserved blocks; on failure or cancellation release the reservation. A
        failing prefill rank is excluded, unless the hand-off was lost (`HandoffLost`: the rank is
        fine)."""
        self.router.prefill_started(prefill.instance_id)
        try:
            return await self._while_live(
                self.workers.prefill(prefill, request, target, self._timeout(deadline)),
                prefill.instance_id,
                decode.instance_id,
            )
        except errors.MeshError as e:
            # before a retry may reserve the id again (best effort: the lease frees it anyway)
            if isinstance(e, RankGone):  # a paused rank would hold the cancel up
                self.background.spawn(self.workers.cancel(decode, request.request_id))
            else:
                await self.workers.cancel(decode, request.request_id)
            if isinstance(e, RankGone):
                excluded.add(e.instance_id)
            elif not isinstance(e, HandoffLost):
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
        excluded: Exclusions,
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
            return await self._while_live(
                self.workers.decode(decode, request, first, timeout), decode.instance_id
            )
        except errors.MeshError as e:
            if isinstance(e, RankGone):  # a paused rank would hold the cancel up: not waited for
                excluded.add(decode.instance_id)
                self.background.spawn(self.workers.cancel(decode, request.request_id))
            elif not isinstance(e, HandoffLost):
                excluded.add(decode.instance_id)
                await self.workers.cancel(decode, request.request_id)
            raise
