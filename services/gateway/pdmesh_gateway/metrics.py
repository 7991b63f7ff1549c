"""The gateway's Prometheus metrics: one `GatewayMetrics` per process, made by `server.serve` on the
process registry and passed to the orchestrator (tests make theirs on a private
`CollectorRegistry`). Registering two on one registry is an error (prometheus_client refuses
duplicate names)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdmesh_gateway.admission import PrefillAdmission, Shed
from pdmesh_gateway.progress import RequestProgress
from pdmesh_service.errors import MeshError

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LAG_TICK_S, LAG_WINDOW_S = 0.05, 1.0  # the loop-lag probe's period, and its max gauge's window


class GatewayMetrics:
    """Request counts by final status, latencies and token counts."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdmesh_requests", "Requests by final status", ["status"], registry=registry
        )
        self.ttft = Histogram(
            "pdmesh_time_to_first_token_seconds",
            "Time to first token",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "pdmesh_time_per_output_token_seconds",
            "Time per output token after the first",
            registry=registry,
            buckets=_TOKEN_BUCKETS,
        )
        self.e2e = Histogram(
            "pdmesh_e2e_request_latency_seconds",
            "Request latency",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.in_flight = Gauge(
            "pdmesh_requests_in_flight", "Requests being generated", registry=registry
        )
        self.waiting = Gauge(
            "pdmesh_gateway_requests_waiting",
            "Requests queued at the gateway (for a prefill "
            "slot or for decode KV blocks), part of the in-flight ones",
            registry=registry,
        )
        self.migrations = Counter(
            "pdmesh_gateway_migrations",
            "Requests continued on another decode rank after theirs failed mid-stream",
            registry=registry,
        )
        self.retries = Counter(
            "pdmesh_gateway_retries",
            "Request starts tried again before the first token (a failed rank, a lost hand-off)",
            registry=registry,
        )
        self.prefill_paths = Counter(
            "pdmesh_gateway_prefill_paths",
            "Requests started, by where their prompt was computed: disagg (a prefill rank, KV over "
            "NIXL), local (conditional disaggregation: the decode rank), agg (the decode rank: agg "
            "mode or no prefill rank up)",
            ["path"],
            registry=registry,
        )
        self.prefix_lookups = Counter(
            "pdmesh_gateway_prefix_lookups",
            "Prefix-index lookups for routing, by result (ok, failed: routed on load alone)",
            ["result"],
            registry=registry,
        )
        self.local_prefill_threshold = Gauge(
            "pdmesh_gateway_local_prefill_threshold_tokens",
            "Uncached prompt tokens up to which the decode rank prefills itself (0: never)",
            registry=registry,
        )
        self.prompt_tokens = Counter("pdmesh_prompt_tokens", "Prompt tokens", registry=registry)
        self.generation_tokens = Counter(
            "pdmesh_generation_tokens", "Generated tokens", registry=registry
        )
        self.cached_tokens = Counter(
            "pdmesh_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache",
            registry=registry,
        )

        self._init_overload(registry)

    def _init_overload(self, registry: CollectorRegistry) -> None:
        self.requests_shed = Counter(
            "pdmesh_gateway_requests_shed",
            "Requests refused at once with 429 because the gateway's queue was full (reason "
            "full) or its estimated wait over --max-queue-wait-s (reason wait)",
            ["reason"],
            registry=registry,
        )
        self.max_queued = Gauge(
            "pdmesh_gateway_max_queued",
            "Requests that may wait at the gateway for a prefill slot (--max-queued)",
            registry=registry,
        )
        self.queue_wait = Gauge(
            "pdmesh_gateway_queue_wait_estimate_seconds",
            "Estimated wait for a prefill slot of a request arriving now (0: not known yet)",
            registry=registry,
        )
        self.loop_lag = Histogram(
            "pdmesh_gateway_event_loop_lag_seconds",
            f"How late the gateway's event loop ran a {LAG_TICK_S:g}s timer",
            registry=registry,
            buckets=_LAG_BUCKETS,
        )
        self.loop_lag_max = Gauge(
            "pdmesh_gateway_event_loop_lag_max_seconds",
            f"The largest event-loop lag over the last {LAG_WINDOW_S:g}s window",
            registry=registry,
        )

    def watch_queue(self, admission: PrefillAdmission) -> None:
        """The queue gauges read `admission` at each scrape."""
        self.max_queued.set_function(lambda: admission.max_queued)
        self.queue_wait.set_function(lambda: admission.estimated_wait_s() or 0.0)

    def shed(self, error: Shed) -> None:
        self.requests_shed.labels(reason=error.reason).inc()

    async def watch_loop_lag(self) -> None:
        """Forever: how late a `LAG_TICK_S` timer fires is the event loop's lag (what every token
        relayed waits for); the histogram takes each, the gauge each window's largest."""
        loop = asyncio.get_running_loop()
        window_end, worst = loop.time() + LAG_WINDOW_S, 0.0
        while True:
            start = loop.time()
            await asyncio.sleep(LAG_TICK_S)
            now = loop.time()
            lag = max(now - start - LAG_TICK_S, 0.0)
            self.loop_lag.observe(lag)
            worst = max(worst, lag)
            if now >= window_end:
                self.loop_lag_max.set(worst)
                window_end, worst = now + LAG_WINDOW_S, 0.0

    def rejected(self, error: MeshError) -> None:
        """A request refused before generation (validation, unknown model)."""
        self.requests.labels(status=error.error_type).inc()

    def ended(self, progress: RequestProgress, status: str) -> None:
        """A request that was generated ended (`status`: success, aborted, cancelled or an error
        type)."""
        self.requests.labels(status=status).inc()
        if progress.first_token_at:
            self.ttft.observe(progress.first_token_at - progress.started_at)
        if progress.finished:
            self.e2e.observe(progress.ended_at - progress.started_at)
            self.prompt_tokens.inc(len(progress.request.prompt_ids))
            self.cached_tokens.inc(progress.num_cached_tokens)
            if progress.num_tokens > 1:
                self.tpot.observe(
                    (progress.ended_at - progress.first_token_at) / (progress.num_tokens - 1)
                )
        self.generation_tokens.inc(progress.num_tokens)
