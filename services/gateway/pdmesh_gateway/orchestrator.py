"""One request end to end over the workers' gRPC APIs, as a stream of engine-neutral events.

The pieces: `start.Starter` opens the request's decode stream (admission, Reserve → Prefill →
Decode or Generate, retried invisibly before the first token), `migration` continues it on another
decode rank when its rank is lost mid-stream, `progress` turns worker chunks into client events,
`retry` decides what is tried again (pure), `upstream.WorkerClient` makes the calls, `router` and
`admission` pick ranks; this module composes them and keeps the deadline, the gateway's
active/waiting counts and the metrics.

Contracts:
- Stop strings are applied here (`RequestProgress`); workers only see stop token ids.
- Closing the event iterator early (client gone) or a stop-string hit cancels the decode stream
  (that aborts the request on decode).
- After the first event, a decode rank lost mid-stream (the stream breaks or ends early, the rank
  aborts the request or leaves the registry) is survived by migration: the request goes on from
  its tokens so far on another rank, at most `max_migrations` times; the client sees one stream,
  every token once.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

from prometheus_client import CollectorRegistry

from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.admission import PrefillAdmission, QueueLimits, Shed
from pdmesh_gateway.core import GenerationEvent, GenerationRequest, WorkerChunk
from pdmesh_gateway.fair_queue import Entry, FairQueueConfig
from pdmesh_gateway.load_window import LoadWindow
from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.migration import (
    DEFAULT_MAX_MIGRATIONS,
    MigrationsExhausted,
    continuation,
    is_rank_loss,
)
from pdmesh_gateway.progress import RequestProgress
from pdmesh_gateway.retry import Exclusions, RetryPolicy
from pdmesh_gateway.router import Router
from pdmesh_gateway.routing import RoutingConfig
from pdmesh_gateway.start import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_MAX_PREFILL_INFLIGHT,
    DEFAULT_UNROUTABLE_WAIT_S,
    RETRY_MAX_BACKOFF_S,
    Mode,
    Starter,
    while_live,
)
from pdmesh_gateway.tenant_admission import TenantAdmission, start_slots
from pdmesh_gateway.tenants import OPEN_TENANT, PriorityClass, Tenancy, Tenants
from pdmesh_gateway.upstream import DecodeStream, WorkerClient
from pdmesh_service import errors
from pdmesh_service.instance import Role
from pdmesh_service.logging import get_logger

__all__ = [
    "DEFAULT_MAX_PREFILL_INFLIGHT",
    "DEFAULT_UNROUTABLE_WAIT_S",
    "GatewayMetrics",
    "Mode",
    "Orchestrator",
]
log = get_logger(__name__)
CLOSE_GRACE_S = 2.0  # how long `close` lets reservation releases finish before cancelling them
DEFAULT_LOAD_WINDOW_S = 10.0  # the autoscaler's window on the load (`load_window`)


class Orchestrator:
    """Runs requests over the mesh; one per gateway process (its `WorkerClient` caches a channel per
    address). `active`: requests being generated now, waiting ones included; `waiting`: of those,
    the ones waiting at the gateway (for a prefill slot or for decode blocks); `load_window`: the
    recent arrivals, queue waits and outputs (what the autoscaler reads)."""

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
        routing: RoutingConfig = RoutingConfig(),
        queue_limits: QueueLimits = QueueLimits(),
        workers: WorkerClient | None = None,  # default: one without mesh credentials
        tenants: Tenants | None = None,  # --api-keys-file; None: one tenant, no limits
        fair_queue: FairQueueConfig = FairQueueConfig(),
        queue_timeout_s: float | None = None,
        tenant_registry: CollectorRegistry | None = None,  # the fair queue's series; None: hidden
        load_window_s: float = DEFAULT_LOAD_WINDOW_S,
    ) -> None:
        if max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {max_migrations}")
        self.router, self.tokenizer, self.metrics = router, tokenizer, metrics
        self.mode, self.max_migrations = Mode(mode), max_migrations
        self.request_timeout_s = request_timeout_s
        self.load_window = LoadWindow(load_window_s, started_at=time.monotonic())
        self.starter = Starter(
            router,
            workers if workers is not None else WorkerClient(),
            metrics,
            mode=self.mode,
            request_timeout_s=request_timeout_s,
            retry_policy=RetryPolicy(
                max_attempts=max_attempts,
                handoff_retries=handoff_retries,
                max_backoff_s=RETRY_MAX_BACKOFF_S,
            ),
            max_prefill_inflight=max_prefill_inflight,
            unroutable_wait_s=unroutable_wait_s,
            routing=routing,
            queue_limits=queue_limits,
            load_window=self.load_window,
        )
        self.active = 0
        metrics.watch_queue(self.starter.admission)
        self._init_gate(tenants, fair_queue, queue_limits, queue_timeout_s, tenant_registry)

    def _init_gate(
        self,
        tenants: Tenants | None,
        config: FairQueueConfig,
        queue_limits: QueueLimits,
        queue_timeout_s: float | None,
        registry: CollectorRegistry | None,
    ) -> None:
        """The fair queue every new request waits in (`tenant_admission`), its start slots
        `--max-prefill-inflight` per rank that computes prompts unless `--max-starting` is given."""
        per_rank, router = self.starter.admission.limit, self.router
        self.tenants = tenants
        self.gate = TenantAdmission(
            replace(config, max_queued=config.max_queued or queue_limits.max_queued),
            tenants,
            capacity=lambda: start_slots(
                per_rank, [*router.ready(Role.PREFILL), *router.ready(Role.DECODE)]
            ),
            queue_timeout_s=queue_timeout_s,
            registry=registry,
        )
        router.on_membership(self.gate.refresh)

    @property
    def waiting(self) -> int:
        return self.starter.waiting

    @property
    def admission(self) -> PrefillAdmission:
        return self.starter.admission

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + CLOSE_GRACE_S
        background = self.starter.background
        while len(background) and loop.time() < until:
            await asyncio.sleep(0.01)
        await background.close()
        await self.starter.workers.close()

    def check_queue(self) -> None:
        """`Shed` (429, counted) when a new request may not join the gateway's queue now: the
        front doors ask before they read the request, so shedding costs next to nothing."""
        try:
            self.starter.admission.check_room()  # the fair queue's bounds need the tenant: later
        except Shed as e:
            self.metrics.shed(e)
            raise

    def is_routable(self) -> bool:
        """Whether requests can be served now (a ready decode rank; prefill is optional)."""
        return self.router.has_ready(Role.DECODE)

    # ----- the request -----
    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationEvent, None]:
        """Events of one request; the last has finish_reason and usage. Close early to cancel.

        The request first waits in the fair queue (`request.tenancy`: its tenant and class; None:
        the open tenant, the class of its `priority`), which sets its engine priority and the
        tenant's default cache salt. A decode rank lost mid-stream (`migration.is_rank_loss`) is
        not the request's end: it goes on from the tokens generated so far on another rank
        (`migration.continuation`), up to `max_migrations` times."""
        tenancy = request.tenancy or open_tenancy(request)
        request = with_tenancy(request, tenancy)
        progress = RequestProgress(request, self.tokenizer)
        deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        excluded = Exclusions()  # decode ranks that failed this request
        tries = itertools.count()  # every try of the request gets an id of its own (`tried`)
        attempt: GenerationRequest | None = request
        status = "cancelled"
        self.metrics.in_flight.inc()
        self.active += 1
        entry: Entry | None = None
        ticket = self.load_window.arrived(time.monotonic(), len(request.prompt_ids))
        try:
            entry = await self._queue(request, tenancy, deadline)
            progress.admitted_at = time.monotonic()
            while attempt is not None:
                stream = await self.starter.start(attempt, deadline, excluded, tries, ticket)
                if not progress.prefill_path:  # the first start's (a continuation re-prefills)
                    progress.prefill_path = stream.prefill_path
                try:
                    async for event in self._relay(stream, progress):
                        self.gate.started(entry)  # its first byte: the start slot is free
                        self.gate.charge(entry, len(event.token_ids))
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
            if isinstance(e, Shed):
                self.metrics.shed(e)
            raise
        finally:
            if entry is not None:
                self.gate.finished(entry)
            self.active -= 1
            self.metrics.in_flight.dec()
            self.metrics.ended(progress, status)
            self.load_window.ended(ticket, time.monotonic(), progress.num_tokens)

    async def _queue(self, request: GenerationRequest, tenancy: Tenancy, deadline: float) -> Entry:
        """A start slot from the fair queue (counted as waiting at the gateway meanwhile)."""
        cost = len(request.prompt_ids) + request.params.max_tokens
        with self.starter.waiting_here():
            return await self.gate.admit(tenancy, cost, len(request.prompt_ids), deadline)

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
            chunk = await while_live(self.router, stream.next(), stream.instance_id)
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


def open_tenancy(request: GenerationRequest) -> Tenancy:
    """The tenancy of a request that came with none: the open tenant, the class of its engine
    priority (vLLM's integer)."""
    return Tenancy(OPEN_TENANT, PriorityClass.of_int(request.params.priority))


def with_tenancy(request: GenerationRequest, tenancy: Tenancy) -> GenerationRequest:
    """The request with its class's engine priority, and the tenant's cache salt when it has
    none."""
    params = request.params
    salt = params.cache_salt if params.cache_salt is not None else tenancy.limits.cache_salt
    if params.priority == tenancy.priority.value and salt == params.cache_salt:
        return request
    return replace(
        request, params=replace(params, priority=tenancy.priority.value, cache_salt=salt)
    )
