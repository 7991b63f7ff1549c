"""The gateway's Prometheus metrics: one `GatewayMetrics` per process, made by `server.serve` on the
process registry and passed to the orchestrator (tests make theirs on a private
`CollectorRegistry`). Registering two on one registry is an error (prometheus_client refuses
duplicate names).

Beside the `pdmesh_*` series, the requests' vLLM-named ones (`pdmesh_service.vllm_metrics` says
which live here and why), labelled `model_name` (the request's, the served name), each request
counted once when it ends (`ended`):

    vllm:prompt_tokens_total, vllm:request_prompt_tokens        its usage.prompt_tokens (finished)
    vllm:generation_tokens_total                                its tokens (every request)
    vllm:request_generation_tokens                              its usage.completion_tokens
    vllm:request_success_total{finished_reason}                 a finished request: its finish
        reason (stop, length, abort); one the client cancelled: abort; one that failed after its
        first token: error (one refused or failed before generating is not counted, as in vLLM)
    vllm:time_to_first_token_seconds                            arrival -> first token
    vllm:e2e_request_latency_seconds                            arrival -> last token (finished)
    vllm:request_time_per_output_token_seconds                  (last - first token) / (tokens - 1)
    vllm:request_queue_time_seconds                             arrival -> out of the gateway's
        queue (`progress.admitted_at`; not observed while that is not known)
    vllm:request_prefill_time_seconds                           out of the queue (arrival if not
        known) -> first token: the prompt, its KV hand-off and any wait for a rank
    vllm:request_decode_time_seconds                            first -> last token
    vllm:request_inference_time_seconds                         prefill + decode time
    vllm:request_max_num_generation_tokens, vllm:request_params_max_tokens   its max_tokens

The request-token histograms' buckets are vLLM's for the model's context length (`model`; without
it, up to `vllm_metrics.FALLBACK_MAX_MODEL_LEN`). Given the model, every series exists for it from
the start (as vLLM's do); otherwise from its first request.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdmesh_gateway.admission import PrefillAdmission, Shed
from pdmesh_gateway.core import ModelInfo
from pdmesh_gateway.progress import RequestProgress
from pdmesh_service import vllm_metrics as vm
from pdmesh_service.errors import MeshError

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
LAG_TICK_S, LAG_WINDOW_S = 0.05, 1.0  # the loop-lag probe's period, and its max gauge's window


class GatewayMetrics:
    """Request counts by final status, latencies and token counts."""

    def __init__(self, registry: CollectorRegistry, model: ModelInfo | None = None) -> None:
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
        self._init_vllm(registry, model)

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

    def _init_vllm(self, registry: CollectorRegistry, model: ModelInfo | None) -> None:
        max_len = model.max_model_len if model is not None else vm.FALLBACK_MAX_MODEL_LEN
        self.vllm_prompt_tokens = vm.counter(registry, "vllm:prompt_tokens")
        self.vllm_generation_tokens = vm.counter(registry, "vllm:generation_tokens")
        self.vllm_request_success = vm.counter(registry, "vllm:request_success")
        self.vllm_ttft = vm.histogram(registry, "vllm:time_to_first_token_seconds")
        self.vllm_e2e = vm.histogram(registry, "vllm:e2e_request_latency_seconds")
        self.vllm_tpot = vm.histogram(registry, "vllm:request_time_per_output_token_seconds")
        self.vllm_queue_time = vm.histogram(registry, "vllm:request_queue_time_seconds")
        self.vllm_prefill_time = vm.histogram(registry, "vllm:request_prefill_time_seconds")
        self.vllm_decode_time = vm.histogram(registry, "vllm:request_decode_time_seconds")
        self.vllm_inference_time = vm.histogram(registry, "vllm:request_inference_time_seconds")
        self.vllm_request_prompt_tokens = vm.histogram(
            registry, "vllm:request_prompt_tokens", max_len
        )
        self.vllm_request_generation_tokens = vm.histogram(
            registry, "vllm:request_generation_tokens", max_len
        )
        self.vllm_max_generation_tokens = vm.histogram(
            registry, "vllm:request_max_num_generation_tokens", max_len
        )
        self.vllm_params_max_tokens = vm.histogram(
            registry, "vllm:request_params_max_tokens", max_len
        )
        self._vllm_models: set[str] = set()
        if model is not None:
            self._vllm_model(model.name)

    def _vllm_model(self, name: str) -> str:
        """`name`, with its children of every vLLM-named family made (once: one served model)."""
        if name not in self._vllm_models:
            self._vllm_models.add(name)
            for family in (
                self.vllm_prompt_tokens,
                self.vllm_generation_tokens,
                self.vllm_ttft,
                self.vllm_e2e,
                self.vllm_tpot,
                self.vllm_queue_time,
                self.vllm_prefill_time,
                self.vllm_decode_time,
                self.vllm_inference_time,
                self.vllm_request_prompt_tokens,
                self.vllm_request_generation_tokens,
                self.vllm_max_generation_tokens,
                self.vllm_params_max_tokens,
            ):
                family.labels(name)
            for reason in vm.FINISH_REASONS:
                self.vllm_request_success.labels(name, reason)
        return name

    def _vllm_ended(self, progress: RequestProgress, status: str) -> None:
        """The vLLM-named series of a request that ended (see the module docstring)."""
        model = self._vllm_model(progress.request.model)
        self.vllm_generation_tokens.labels(model).inc(progress.num_tokens)
        first, started = progress.first_token_at, progress.started_at
        if first:
            self.vllm_ttft.labels(model).observe(first - started)
        if not progress.finished:
            if status == "cancelled":
                self.vllm_request_success.labels(model, "abort").inc()
            elif first:
                self.vllm_request_success.labels(model, "error").inc()
            return
        reason = progress.finish_reason
        self.vllm_request_success.labels(
            model, reason if reason in vm.FINISH_REASONS else "stop"
        ).inc()
        num_prompt, num_tokens = len(progress.request.prompt_ids), progress.num_tokens
        max_tokens = progress.request.params.max_tokens
        self.vllm_prompt_tokens.labels(model).inc(num_prompt)
        self.vllm_request_prompt_tokens.labels(model).observe(num_prompt)
        self.vllm_request_generation_tokens.labels(model).observe(num_tokens)
        self.vllm_max_generation_tokens.labels(model).observe(max_tokens)
        self.vllm_params_max_tokens.labels(model).observe(max_tokens)
        end = progress.ended_at
        self.vllm_e2e.labels(model).observe(end - started)
        admitted = progress.admitted_at
        if admitted:
            self.vllm_queue_time.labels(model).observe(admitted - started)
        running_from = admitted or started
        if first:
            self.vllm_prefill_time.labels(model).observe(first - running_from)
            self.vllm_decode_time.labels(model).observe(end - first)
            self.vllm_inference_time.labels(model).observe(end - running_from)
            if num_tokens > 1:
                self.vllm_tpot.labels(model).observe((end - first) / (num_tokens - 1))

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
        self._vllm_ended(progress, status)
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
