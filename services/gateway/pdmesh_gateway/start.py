"""Starting a request: everything before its first token reaches the client, tried again as
`retry` says (nothing was shown yet, so a failure here is invisible).

disagg (a prefill rank is up): admission (a slot of a prefill rank, FCFS at the gateway) →
decode.Reserve → prefill.Prefill(target) → slot released → decode.Decode(first token), returned
once decode admitted the request. agg, or no prefill rank up: decode.Generate. Which prefill rank,
and whether a short prompt is prefilled by its decode rank instead (local), is `routing`'s choice
over the kvstore's prefix index (`prefix_lookup`); the path taken is the stream's `prefill_path`.

Contracts:
- At most `max_prefill_inflight` requests per prefill rank are between Reserve and the end of their
  Prefill; the others wait at the gateway, before Reserve (`PrefillAdmission`), so decode blocks are
  never held for prompts queued in a prefill engine. A client that leaves while its request waits
  there leaves no trace on any worker. The queue is bounded: a request's first try is refused at
  once (`Shed`, 429) when it is full; later tries and continuations are never refused.
- Reserve answering RESOURCE_EXHAUSTED (pool short) is retried, other decode ranks first, with
  backoff, until the request's timeout (then `Overloaded`, 503).
- The first token of the disaggregated path comes from PrefillResponse; it is shown only once
  Decode admitted the request, so no request fails after its first token because of its hand-off.
- A Prefill still in flight when the client leaves is cancelled and its reservation released with
  decode.Cancel.
- Every try has an id of its own (`migration.tried`), so nothing a failed try left behind (a
  reservation, a live hand-off record) is in the next one's way; a Reserve that fails (other than
  for lack of blocks) ends its try. A rank that failed the request is skipped for it until it
  heartbeats again (`retry.Exclusions`: a restarted rank is back in play at once).
- No call waits on a dead or paused rank: every worker call is abandoned once one of its ranks left
  the registry (`while_live`; the router's `is_live`), Reserve has its own short deadline, and with
  no decode rank at all a request waits up to `unroutable_wait_s` for one before 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterator, Sequence
from enum import StrEnum
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState

from pdmesh_gateway.admission import PrefillAdmission, QueueLimits
from pdmesh_gateway.core import GenerationRequest
from pdmesh_gateway.load_window import LoadWindow, QueueTicket
from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.migration import tried
from pdmesh_gateway.prefix_lookup import PrefixLookup
from pdmesh_gateway.retry import (
    BlocksWait,
    DecodeFull,
    Exclusions,
    HandoffLost,
    Overloaded,
    RankGone,
    RetryPolicy,
    StartRetry,
    retried,
)
from pdmesh_gateway.router import NoInstance, Router
from pdmesh_gateway.routing import (
    HandoffModel,
    PrefillCandidate,
    PrefillRouting,
    RoutingConfig,
    choose_prefill,
    local_threshold,
    prefills_locally,
)
from pdmesh_gateway.upstream import DecodeStream, WorkerClient
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.prefill.v1 import prefill_pb2
from pdmesh_service import errors
from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.logging import get_logger
from pdmesh_service.tasks import Background

log = get_logger(__name__)
T = TypeVar("T")
DEFAULT_MAX_PREFILL_INFLIGHT = 2
# tries of a request's start against failing ranks, and the longest wait between two: together
# they outlast a kvstore or worker restart (about 10 s of waiting)
DEFAULT_MAX_ATTEMPTS, RETRY_MAX_BACKOFF_S = 16, 1.0
DEFAULT_UNROUTABLE_WAIT_S = 20.0  # how long a request waits for a decode rank when none is up
RESERVE_TIMEOUT_S = 15.0  # a Reserve is one engine-thread command: longer means a stuck rank


class Path(StrEnum):
    """Where a request's prompt was computed."""

    DISAGG = "disagg"  # on a prefill rank, its KV pushed to the decode rank over NIXL
    LOCAL = "local"  # on its decode rank, by choice (conditional disaggregation)
    AGG = "agg"  # on its decode rank: agg mode, or no prefill rank up

    def __str__(self) -> str:
        return self.value


class Mode(StrEnum):
    """disagg: prefill ranks compute prompts (decode prefills itself when none is up); agg: decode
    does all."""

    DISAGG = "disagg"
    AGG = "agg"

    def __str__(self) -> str:
        return self.value


async def while_live(router: Router, call: Awaitable[T], *instance_ids: str) -> T:
    """Await `call`, abandoned (`RankGone`) as soon as one of the ranks leaves the registry: a
    dead or paused rank never holds a request (nor its prefill admission slot) longer than its
    registry TTL. Nothing polls: the router resolves the ranks' `departure` futures."""
    task = asyncio.ensure_future(call)
    departures = [router.departure(i) for i in instance_ids]
    try:
        await asyncio.wait({task, *departures}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        gone = next(i for i, d in zip(instance_ids, departures, strict=True) if d.done())
        raise RankGone(gone, f"{gone} left the registry (not heartbeating)")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class _PrefillChoice:
    """The cache-aware choice of a prefill rank for one prompt (`routing.choose_prefill` over the
    ranks' cached tokens and the admission's queued work), as `PrefillAdmission.acquire` calls
    it; `tokens`: what the last choice costs its rank (given back with the slot)."""

    def __init__(self, starter: Starter, prompt_tokens: int, cached: dict[str, int]) -> None:
        self.starter, self.prompt_tokens, self.cached = starter, prompt_tokens, cached
        self.tokens = 0

    def __call__(self, ranks: Sequence[str]) -> tuple[str, int]:
        admission = self.starter.admission
        candidates = [
            PrefillCandidate(
                r, self.cached.get(r, 0), admission.queued_tokens(r), admission.in_flight(r)
            )
            for r in ranks
        ]
        best = choose_prefill(self.prompt_tokens, candidates, self.starter.last_prefill)
        self.starter.last_prefill = best.instance_id
        self.tokens = self.prompt_tokens - best.cached_tokens
        return best.instance_id, self.tokens


class Starter:
    """Opens requests' decode streams (module docstring). `waiting`: requests waiting at the
    gateway now (for a prefill slot, decode blocks or a decode rank); `blocks_waiting`: of those,
    the ones waiting for decode KV blocks; `paths`: requests started per `Path`; `handoffs`: the
    measured cost of hand-offs (the `auto` local-prefill threshold); `load_window`: told when a
    request leaves the gateway's queues (a `QueueTicket` given to `start`)."""

    def __init__(
        self,
        router: Router,
        workers: WorkerClient,
        metrics: GatewayMetrics,
        *,
        mode: Mode,
        request_timeout_s: float,
        retry_policy: RetryPolicy,
        max_prefill_inflight: int,
        unroutable_wait_s: float,
        routing: RoutingConfig,
        queue_limits: QueueLimits = QueueLimits(),
        load_window: LoadWindow | None = None,
    ) -> None:
        self.router, self.workers, self.metrics, self.mode = router, workers, metrics, mode
        self.load_window = load_window
        self.request_timeout_s, self.retry_policy = request_timeout_s, retry_policy
        self.unroutable_wait_s, self.routing = unroutable_wait_s, routing
        self.admission = PrefillAdmission(max_prefill_inflight, queue_limits)
        router.on_membership(lambda: self.admission.refresh(len(router.ready(Role.PREFILL))))
        self.lookup = PrefixLookup(router, workers, metrics, routing.lookup_timeout_s)
        self.handoffs = HandoffModel()
        self.background = Background()  # reservation releases nobody waits for
        self.waiting = 0
        self.blocks_waiting = 0
        self.paths = {str(p): 0 for p in Path}
        self.last_prefill = ""  # the prefill rank chosen last (ties go round robin)
        metrics.local_prefill_threshold.set(self.local_threshold)

    @property
    def local_threshold(self) -> int:
        """Uncached prompt tokens up to which a decode rank prefills itself (0: never)."""
        return local_threshold(self.routing.local_prefill, self.handoffs)

    async def start(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        tries: Iterator[int],
        ticket: QueueTicket | None = None,
    ) -> DecodeStream:
        """Open the request's decode stream, tried again as `retry_policy` says (nothing was sent
        yet); with no decode rank to try, wait up to `unroutable_wait_s` for one (a restarting
        rank, a registry refilling after a Redis restart). `ticket` leaves the load window's
        queue when the request gets its prefill slot (or its decode call begins)."""
        self._check_pin(request)
        loop = asyncio.get_running_loop()
        give_up_at = min(deadline, loop.time() + self.unroutable_wait_s)
        while True:
            try:
                stream = await self._start_retrying(request, deadline, excluded, tries, ticket)
                self.paths[stream.prefill_path] += 1
                self.metrics.prefill_paths.labels(stream.prefill_path).inc()
                return stream
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
                # a heartbeat lifts an exclusion: every view may bring a usable rank
                next_view = self.router.next_view()
                await asyncio.wait([next_view], timeout=until - loop.time())
        return False

    async def _start_retrying(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        tries: Iterator[int],
        ticket: QueueTicket | None,
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
            number = next(tries)  # 0: the request's first try, the only one the queue may shed
            attempt = tried(request, number)
            return await self._start_once(attempt, deadline, excluded, number == 0, ticket)

        return await retried(retrying, start_once)

    def _check_pin(self, request: GenerationRequest) -> None:
        """A DP rank that no prefill or decode rank has is the client's error."""
        if request.dp_rank is None:
            return
        ranks = {i.rank for i in self.router.snapshot() if i.role in (Role.PREFILL, Role.DECODE)}
        if request.dp_rank not in ranks:
            raise errors.InvalidArgument(
                f"X-Data-Parallel-Rank {request.dp_rank}: no rank of the mesh has that DP rank "
                f"(ranks: {sorted(ranks)})"
            )

    def _skipped(self, excluded: Exclusions, pin: int | None = None) -> set[str]:
        """Ranks not to use: those `excluded` blocks, and with `pin` those of another DP rank."""
        skipped = excluded.blocked(self.router.snapshot())
        if pin is not None:
            skipped |= {i.instance_id for i in self.router.snapshot() if i.rank != pin}
        return skipped

    def _prefill_ranks(
        self, request: GenerationRequest, excluded: Exclusions, revision: str | None = None
    ) -> list[str]:
        """The usable prefill ranks (of `revision` only, when given: a hand-off's pair)."""
        skipped = self._skipped(excluded, request.dp_rank)
        ready = self.router.ready(Role.PREFILL, revision)
        return [i.instance_id for i in ready if i.instance_id not in skipped]

    async def _start_once(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        bounded: bool,
        ticket: QueueTicket | None = None,
    ) -> DecodeStream:
        path, decode = Path.AGG, None
        if self.mode is Mode.DISAGG:
            cached = await self._cached(request, excluded)
            decode = self._local_decode(request, excluded, cached)
            if decode is not None:
                path = Path.LOCAL
            else:
                stream = await self._start_remote(
                    request, deadline, excluded, cached, bounded, ticket
                )
                if stream is not None:
                    return stream
        if decode is None:
            decode = self.router.pick_decode(self._skipped(excluded, request.dp_rank))
        timeout = self._timeout(deadline)
        self._left_queue(ticket)
        self.router.note_sent(decode.instance_id, tokens=len(request.prompt_ids))
        try:
            stream = await while_live(
                self.router, self.workers.generate(decode, request, timeout), decode.instance_id
            )
        except errors.MeshError:
            excluded.add(decode.instance_id)
            raise
        stream.prefill_path = str(path)
        return stream

    async def _cached(self, request: GenerationRequest, excluded: Exclusions) -> dict[str, int]:
        """Per rank, the prompt tokens it holds (what routing needs: prefill ranks for the
        cache-aware choice when there is a choice, decode ranks for a local prefill); {} without
        a lookup when neither applies."""
        skipped = self._skipped(excluded)
        ranks = []
        if self.routing.prefill is PrefillRouting.CACHE_AWARE:
            prefills = [i for i in self.router.ready(Role.PREFILL) if i.instance_id not in skipped]
            ranks += prefills if len(prefills) > 1 else []
        if self.local_threshold > 0:
            ranks += [i for i in self.router.ready(Role.DECODE) if i.instance_id not in skipped]
        if not ranks:
            return {}
        return await self.lookup.cached(request.prompt_ids, ranks, request.params.cache_salt)

    def _local_decode(
        self, request: GenerationRequest, excluded: Exclusions, cached: dict[str, int]
    ) -> InstanceInfo | None:
        """The decode rank that prefills this prompt itself (conditional disaggregation: its
        uncached part there is within the threshold), or None. Only while a prefill rank is up
        (else the prompt goes to decode anyway, as `Path.AGG`)."""
        threshold = self.local_threshold
        if threshold <= 0 or not self._prefill_ranks(request, excluded):
            return None
        decode = self.router.pick_decode(self._skipped(excluded, request.dp_rank))
        uncached = len(request.prompt_ids) - cached.get(decode.instance_id, 0)
        return decode if prefills_locally(uncached, threshold) else None

    async def _start_remote(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        cached: dict[str, int],
        bounded: bool,
        ticket: QueueTicket | None = None,
    ) -> DecodeStream | None:
        """The disaggregated start on an admitted prefill rank; None when no prefill rank is
        usable. `bounded`: the queue may shed the request (its first try)."""
        choice = None
        if self.routing.prefill is PrefillRouting.CACHE_AWARE:
            choice = _PrefillChoice(self, len(request.prompt_ids), cached)
        # the hand-off pairs ranks of one revision: the least loaded decode rank's
        revision = self.router.decode_revision(self._skipped(excluded))
        rank = await self._admit(request, deadline, excluded, choice, bounded, revision)
        if rank is None:
            return None
        self._left_queue(ticket)
        stream = await self._start_disagg(
            request, deadline, excluded, rank, choice.tokens if choice else 0, revision
        )
        stream.prefill_path = str(Path.DISAGG)
        return stream

    def _timeout(self, deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise errors.DeadlineExceeded(f"request timed out after {self.request_timeout_s:g}s")
        return left

    def _left_queue(self, ticket: QueueTicket | None) -> None:
        if ticket is not None and self.load_window is not None:
            self.load_window.left_queue(ticket, time.monotonic())

    def waiting_here(self) -> contextlib.AbstractContextManager[None]:
        """Counts a request as waiting at the gateway (the fair queue's wait, too)."""
        return self._waiting()

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

    async def _admit(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        choice: _PrefillChoice | None,
        bounded: bool,
        revision: str | None = None,
    ) -> str | None:
        """A slot of a ready prefill rank, FCFS (`PrefillAdmission`), of the rank `choice` picks
        when given; None when no prefill rank is usable; `Shed` at once when `bounded` and the
        queue is full."""
        with self._waiting():
            try:
                return await asyncio.wait_for(
                    self.admission.acquire(
                        lambda: self._prefill_ranks(request, excluded, revision),
                        choice,
                        bounded=bounded,
                    ),
                    self._timeout(deadline),
                )
            except TimeoutError:
                raise Overloaded(
                    f"no prefill slot was free within the request timeout "
                    f"({self.request_timeout_s:g}s)"
                ) from None

    async def _start_disagg(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        rank: str,
        tokens: int,
        revision: str | None = None,
    ) -> DecodeStream:
        """Reserve → Prefill while holding the admission slot of `rank` (whose choice cost it
        `tokens`), then Decode; the phases' times feed `handoffs`."""
        clock = asyncio.get_running_loop().time
        try:
            prefill = next(
                (i for i in self.router.ready(Role.PREFILL) if i.instance_id == rank), None
            )
            if prefill is None:
                raise errors.Unavailable(f"prefill {rank} left the mesh")
            t0 = clock()
            decode, target = await self._reserve(request, deadline, excluded, revision)
            t1 = clock()
            first = await self._prefill(request, prefill, decode, target, deadline, excluded)
            t2 = clock()
        finally:
            self.admission.release(rank, tokens)
        stream = await self._decode(request, decode, first, deadline, excluded)
        uncached = len(request.prompt_ids) - first.num_cached_tokens
        self.handoffs.observe(
            uncached,
            t1 - t0,
            t2 - t1,
            first.transfer_seconds,
            clock() - t2,
            first.kv_bytes,
            len(request.prompt_ids),
        )
        self.metrics.local_prefill_threshold.set(self.local_threshold)
        return stream

    async def _reserve(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        revision: str | None = None,
    ) -> tuple[InstanceInfo, common_pb2.KVTarget]:
        """Blocks on a ready decode rank: passes over the ranks (`_reserve_pass`), waiting between
        passes while every rank is short of blocks, until the deadline (then `Overloaded`)."""
        loop = asyncio.get_running_loop()
        wait = BlocksWait(remaining=lambda: deadline - loop.time())

        async def sleep(seconds: float) -> None:
            self.blocks_waiting += 1
            try:
                with self._waiting():
                    await asyncio.sleep(seconds)
            finally:
                self.blocks_waiting -= 1

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
        return await retried(retrying, self._reserve_pass, request, deadline, excluded, revision)

    async def _reserve_pass(
        self,
        request: GenerationRequest,
        deadline: float,
        excluded: Exclusions,
        revision: str | None = None,
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
                decode = self.router.pick_decode(self._skipped(excluded) | full, revision)
            except NoInstance:
                if not full:
                    raise
                raise DecodeFull(f"decode ranks {sorted(full)} are short of KV blocks") from None
            timeout = min(self._timeout(deadline), RESERVE_TIMEOUT_S)
            try:
                target = await while_live(
                    self.router, self.workers.reserve(decode, request, timeout), decode.instance_id
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
            self.router.note_sent(decode.instance_id, tokens=len(request.prompt_ids))
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
            return await while_live(
                self.router,
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
            return await while_live(
                self.router,
                self.workers.decode(decode, request, first, timeout),
                decode.instance_id,
            )
        except errors.MeshError as e:
            if isinstance(e, RankGone):  # a paused rank would hold the cancel up: not waited for
                excluded.add(decode.instance_id)
                self.background.spawn(self.workers.cancel(decode, request.request_id))
            elif not isinstance(e, HandoffLost):
                excluded.add(decode.instance_id)
                await self.workers.cancel(decode, request.request_id)
            raise
