"""The fair queue (`fair_queue.FairQueue`) on the event loop, and its Prometheus series (asyncio
and prometheus_client only: no grpc, redis or torch).

`TenantAdmission.admit` queues a new request and waits for its grant: a full queue is `Shed` at
once (429 with Retry-After), a wait past `--queue-timeout-s` (or the request's own deadline) is
`QueueTimeout` (408, OpenAI error shape), a client gone while waiting leaves the queue at once
(counted as `client_gone`, answered 499 by the REST handler). `started` (first byte), `finished`
(end, whatever it was) and `charge` (output tokens) follow the request; each may grant others.
Nothing polls: a grant resolves its waiter's future, and one timer wakes the queue when a
rate-limited tenant's bucket reopens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdmesh_gateway.admission import Shed
from pdmesh_gateway.fair_queue import (
    REASONS,
    Entry,
    EntryState,
    FairQueue,
    FairQueueConfig,
    Rejected,
)
from pdmesh_gateway.tenants import (
    OPEN_TENANT,
    Tenancy,
    Tenants,
    request_class,
)
from pdmesh_service.errors import InvalidArgument, MeshError

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class QueueTimeout(MeshError):
    """The request waited at the gateway past --queue-timeout-s (or its own timeout) without a
    start slot: HTTP 408 in the OpenAI error shape; gRPC DEADLINE_EXCEEDED."""

    grpc_code, http_status, error_type = "DEADLINE_EXCEEDED", 408, "timeout_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="queue_timeout")


def tenancy_of(
    tenants: Tenants | None, authorization: str | None, header: str | None, body_priority: object
) -> Tenancy:
    """The tenant of the request's key (OPEN_TENANT without a key table, or for a key not in it:
    the single --api-key) and its class from the x-pdmesh-priority header or the body's
    `priority`; InvalidArgument (400, param "priority") for a class that does not parse."""
    limits = OPEN_TENANT
    if tenants is not None and authorization:
        _, _, token = authorization.strip().partition(" ")
        limits = tenants.lookup(token.strip()) or OPEN_TENANT
    try:
        return Tenancy(limits, request_class(header, body_priority, limits))
    except ValueError as e:
        raise InvalidArgument(str(e), param="priority") from None


class TenantAdmission:
    """The fair queue's adapter (module docstring). `capacity()`: the start slots now (read at
    each `refresh`), unless the config fixes them."""

    def __init__(
        self,
        config: FairQueueConfig,
        tenants: Tenants | None = None,
        *,
        capacity: Callable[[], int] | None = None,
        queue_timeout_s: float | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if queue_timeout_s is not None and not queue_timeout_s > 0:
            raise ValueError(f"--queue-timeout-s must be positive, got {queue_timeout_s}")
        self.tenants, self.queue_timeout_s = tenants, queue_timeout_s
        self.core = FairQueue(config, tenants.tenants if tenants is not None else ())
        self._capacity = capacity
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        registry = registry or CollectorRegistry()  # none: series nobody scrapes
        self.wait = Histogram(
            "pdmesh_gateway_tenant_queue_wait_seconds",
            "Time requests waited in the gateway's fair queue for a start slot",
            ["tenant", "class"],
            registry=registry,
            buckets=_WAIT_BUCKETS,
        )
        registry.register(_QueueCollector(self.core))
        self.refresh()

    @property
    def num_queued(self) -> int:
        return self.core.num_queued

    def refresh(self) -> None:
        """The ranks changed: read the start slots again, and grant what they allow."""
        if self._capacity is not None:
            self.core.set_capacity(self._capacity())
        if self._futures:
            self._pump()

    async def admit(
        self, tenancy: Tenancy, cost: int, prompt_tokens: int, deadline: float
    ) -> Entry:
        """Wait for a start slot (module docstring); `deadline`: the request's, in loop time."""
        loop = asyncio.get_running_loop()
        try:
            entry = self.core.enqueue(
                tenancy.limits, tenancy.priority, cost, prompt_tokens, time.monotonic()
            )
        except Rejected as e:
            raise Shed(str(e), reason=e.reason, retry_after_s=e.retry_after_s) from None
        future = self._futures[entry.seq] = loop.create_future()
        self._pump()
        timeout = deadline - loop.time()
        if self.queue_timeout_s is not None:
            timeout = min(timeout, self.queue_timeout_s)
        try:
            async with asyncio.timeout(max(timeout, 0)):
                await future
        except TimeoutError:
            if entry.state is EntryState.QUEUED:
                self.core.leave(entry, "timeout", time.monotonic())
                raise QueueTimeout(
                    f"the request waited {max(timeout, 0):.1f}s at the gateway without starting "
                    "(--queue-timeout-s or the request timeout); retry later"
                ) from None
            # granted as the timer fired: it goes on
        except asyncio.CancelledError:
            # the waiter's future is cancelled at once, the queue hears of it when this runs:
            # a grant in between holds a slot that must be given back
            if entry.state is EntryState.QUEUED:
                self.core.leave(entry, "client_gone", time.monotonic())
            else:
                self.finished(entry)
            raise
        finally:
            self._futures.pop(entry.seq, None)
        self.wait.labels(entry.tenant, str(entry.priority)).observe(
            (entry.granted_at or entry.enqueued_at) - entry.enqueued_at
        )
        return entry

    def started(self, entry: Entry) -> None:
        self.core.started(entry)
        self._pump()

    def finished(self, entry: Entry) -> None:
        self.core.finished(entry)
        self._pump()

    def charge(self, entry: Entry, tokens: int) -> None:
        self.core.charge(entry, tokens, time.monotonic())

    def view(self) -> dict[str, object]:
        return {**self.core.view(time.monotonic()), "queue_timeout_s": self.queue_timeout_s}

    def _pump(self) -> None:
        now = time.monotonic()
        for entry in self.core.pump(now):
            future = self._futures.get(entry.seq)
            if future is not None and not future.done():
                future.set_result(None)
        self._arm(self.core.next_wakeup(now), now)

    def _arm(self, at: float | None, now: float) -> None:
        """One timer, at the earliest bucket reopening (none when nothing waits on one)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if at is not None:
            self._timer = asyncio.get_running_loop().call_later(max(at - now, 0.001), self._pump)


class _QueueCollector(Collector):
    """Per tenant and class at each scrape: queued requests, admitted and rejected (by reason)
    requests and tokens; per tenant the running ones. Labels are bounded: the key file's tenants
    (plus `default`), the four classes, the REASONS."""

    def __init__(self, core: FairQueue) -> None:
        self.core = core

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["tenant", "class"]
        queued = GaugeMetricFamily(
            "pdmesh_gateway_tenant_queued", "Requests waiting in the fair queue", labels=labels
        )
        running = GaugeMetricFamily(
            "pdmesh_gateway_tenant_running", "Requests granted and not ended", labels=["tenant"]
        )
        admitted = CounterMetricFamily(
            "pdmesh_gateway_tenant_admitted_requests", "Requests granted a start", labels=labels
        )
        admitted_tokens = CounterMetricFamily(
            "pdmesh_gateway_tenant_admitted_tokens",
            "Tokens (prompt + max_tokens) of the requests granted a start",
            labels=labels,
        )
        rejected = CounterMetricFamily(
            "pdmesh_gateway_tenant_rejected_requests",
            f"Requests refused or given up in the fair queue, by reason ({', '.join(REASONS)})",
            labels=[*labels, "reason"],
        )
        rejected_tokens = CounterMetricFamily(
            "pdmesh_gateway_tenant_rejected_tokens",
            "Tokens (prompt + max_tokens) of the rejected requests, by reason",
            labels=[*labels, "reason"],
        )
        for (tenant, cls), stats in sorted(self.core.stats().items()):
            key = [tenant, str(cls)]
            queued.add_metric(key, self.core.queued(tenant, cls))
            admitted.add_metric(key, stats.admitted_requests)
            admitted_tokens.add_metric(key, stats.admitted_tokens)
            for reason, count in sorted(stats.rejected_requests.items()):
                rejected.add_metric([*key, reason], count)
                rejected_tokens.add_metric([*key, reason], stats.rejected_tokens[reason])
        for tenant in sorted({t for t, _ in self.core.stats()}):
            running.add_metric([tenant], self.core.running(tenant))
        yield from (queued, running, admitted, admitted_tokens, rejected, rejected_tokens)


def start_slots(per_rank: int, ranks: Iterable[object]) -> int:
    """The default start slots: `per_rank` (--max-prefill-inflight) for every rank that computes
    prompts (prefill ranks, and decode ranks: agg mode, local prefill)."""
    return max(per_rank * sum(1 for _ in ranks), 1)
