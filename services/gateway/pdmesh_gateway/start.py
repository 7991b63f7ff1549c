"""Starting a request: everything before its first token reaches the client, tried again as
`retry` says (nothing was shown yet, so a failure here is invisible).

disagg (a prefill rank is up): admission (a slot of a prefill rank, FCFS at the gateway) →
decode.Reserve → prefill.Prefill(target) → slot released → decode.Decode(first token), returned
once decode admitted the request. agg, or no prefill rank up: decode.Generate.

Contracts:
- At most `max_prefill_inflight` requests per prefill rank are between Reserve and the end of their
  Prefill; the others wait at the gateway, before Reserve (`PrefillAdmission`), so decode blocks are
  never held for prompts queued in a prefill engine. A client that leaves while its request waits
  there leaves no trace on any worker.
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
from collections.abc import Awaitable, Iterator
from enum import StrEnum
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState

from pdmesh_gateway.admission import PrefillAdmission
from pdmesh_gateway.core import GenerationRequest
from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.migration import tried
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

log = get_logger(__name__)
T = TypeVar("T")
DEFAULT_MAX_PREFILL_INFLIGHT = 2
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


async def while_live(router: Router, call: Awaitable[T], *instance_ids: str) -> T:
    """Await `call`, abandoned (`RankGone`) as soon as one of the ranks leaves the registry: a
    dead or paused rank never holds a request (nor its prefill admission slot) longer than its
    registry TTL."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
            if done:
                return task.result()
            gone = [i for i in instance_ids if not router.is_live(i)]
            if gone:
                raise RankGone(gone[0], f"{gone[0]} left the registry (not heartbeating)")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class Starter:
    """Opens requests' decode streams (module docstring). `waiting`: requests waiting at the
    gateway now (for a prefill slot, decode blocks or a decode rank)."""

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
    ) -> None:
        self.router, self.workers, self.metrics, self.mode = router, workers, metrics, mode
        self.request_timeout_s, self.retry_policy = request_timeout_s, retry_policy
        self.unroutable_wait_s = unroutable_wait_s
        self.admission = PrefillAdmission(max_prefill_inflight)
        self.background = Background()  # reservation releases nobody waits for
        self.waiting = 0

    async def start(
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
            return await while_live(
                self.router, self.workers.generate(decode, request, timeout), decode.instance_id
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
