"""The vLLM-named Prometheus series pdmesh exports beside its `pdmesh_*` ones.

Tools written for vLLM (its Grafana dashboard, `deploy/grafana/vllm.json`; the Gateway API
Inference Extension's model-server protocol; autoscalers) read these names. `SERIES` is the table:
each series' name, type and label names as vLLM 0.33 declares them (`vllm/v1/metrics/loggers.py`
and `buckets.py` of its wheel), its histogram buckets, and where pdmesh exports it:

- `worker`: every prefill and decode rank, labelled `model_name` (the served model: the model
  directory's name, what the gateway's /v1/models lists by default) and `engine` (vLLM's engine
  index; here the rank's instance id, one value per rank). These are one engine's state or events
  that happen on exactly one rank: its batch, its KV pool, its prefix cache, the gaps between the
  tokens its steps emit.
- `gateway`: the gateway, labelled `model_name` (the request's model) only. These are requests'
  series: a disaggregated request is computed on a prefill rank and generated on a decode rank (on
  another after a migration), so per-rank counts would count one request on several ranks and the
  dashboard's sums over `model_name` would double it. The gateway sees each request once, as the
  client does (its usage, its finish reason, its latencies). `engine` is left out: no engine's.

`vllm:gpu_cache_usage_perc` is the name vLLM used before `vllm:kv_cache_usage_perc` (vLLM 0.33 no
longer exports it); the inference extension's model-server protocol still names it, so pdmesh sets
both to the same fraction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Kind = Literal["counter", "gauge", "histogram"]
Where = Literal["worker", "gateway"]

VLLM_VERSION = "0.33.0"  # where the names, types, labels and buckets below come from
WORKER_LABELS = ("model_name", "engine")
GATEWAY_LABELS = ("model_name",)
# vLLM's FinishReason strings (vllm/v1/engine: FINISH_REASON_STRINGS); request_success has a child
# for each from the start, as vLLM's does
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM's default bucket families (vllm/v1/metrics/buckets.py)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
# the request_tokens family's cap when the gateway is not told the model's context length
FALLBACK_MAX_MODEL_LEN = 1 << 20


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's `request_tokens` family: 1, 2, 5, 10, 20, 50, ... up to `max_model_len`."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(float(mantissa * scale))
        scale *= 10


@dataclass(frozen=True)
class Series:
    name: str  # as declared (a counter is scraped with `_total` after it)
    kind: Kind
    where: Where
    doc: str
    extra_labels: tuple[str, ...] = ()  # after model_name (and engine)
    buckets: str = ""  # histograms: the bucket family (`buckets_of`)

    @property
    def labels(self) -> tuple[str, ...]:
        """pdmesh's label names (vLLM's, less `engine` on the gateway's)."""
        base = WORKER_LABELS if self.where == "worker" else GATEWAY_LABELS
        return (*base, *self.extra_labels)

    @property
    def vllm_labels(self) -> tuple[str, ...]:
        """The label names vLLM 0.33 gives the series."""
        return (*WORKER_LABELS, *self.extra_labels)


_W: Where = "worker"
_G: Where = "gateway"

SERIES: tuple[Series, ...] = (
    # --- worker: one engine's state and events ---
    Series(
        "vllm:num_requests_running", "gauge", _W, "Number of requests in model execution batches."
    ),
    Series("vllm:num_requests_waiting", "gauge", _W, "Number of requests waiting to be processed."),
    Series("vllm:kv_cache_usage_perc", "gauge", _W, "KV-cache usage. 1 means 100 percent usage."),
    Series(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        _W,
        "KV-cache usage. 1 means 100 percent usage (vLLM's older name for kv_cache_usage_perc).",
    ),
    Series(
        "vllm:prefix_cache_queries",
        "counter",
        _W,
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    Series(
        "vllm:prefix_cache_hits",
        "counter",
        _W,
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    Series(
        "vllm:inter_token_latency_seconds",
        "histogram",
        _W,
        "Histogram of inter-token latency in seconds.",
        buckets="inter_token_latency",
    ),
    # --- gateway: requests, once each, as the client sees them ---
    Series("vllm:prompt_tokens", "counter", _G, "Number of prefill tokens processed."),
    Series("vllm:generation_tokens", "counter", _G, "Number of generation tokens processed."),
    Series(
        "vllm:request_success",
        "counter",
        _G,
        "Count of successfully processed requests.",
        extra_labels=("finished_reason",),
    ),
    Series(
        "vllm:time_to_first_token_seconds",
        "histogram",
        _G,
        "Histogram of time to first token in seconds.",
        buckets="time_to_first_token",
    ),
    Series(
        "vllm:e2e_request_latency_seconds",
        "histogram",
        _G,
        "Histogram of e2e request latency in seconds.",
        buckets="request_latency",
    ),
    Series(
        "vllm:request_time_per_output_token_seconds",
        "histogram",
        _G,
        "Histogram of time_per_output_token_seconds per request.",
        buckets="inter_token_latency",
    ),
    Series(
        "vllm:request_queue_time_seconds",
        "histogram",
        _G,
        "Histogram of time spent in WAITING phase for request.",
        buckets="request_latency",
    ),
    Series(
        "vllm:request_prefill_time_seconds",
        "histogram",
        _G,
        "Histogram of time spent in PREFILL phase for request.",
        buckets="request_latency",
    ),
    Series(
        "vllm:request_decode_time_seconds",
        "histogram",
        _G,
        "Histogram of time spent in DECODE phase for request.",
        buckets="request_latency",
    ),
    Series(
        "vllm:request_inference_time_seconds",
        "histogram",
        _G,
        "Histogram of time spent in RUNNING phase for request.",
        buckets="request_latency",
    ),
    Series(
        "vllm:request_prompt_tokens",
        "histogram",
        _G,
        "Number of prefill tokens processed.",
        buckets="request_tokens",
    ),
    Series(
        "vllm:request_generation_tokens",
        "histogram",
        _G,
        "Number of generation tokens processed.",
        buckets="request_tokens",
    ),
    Series(
        "vllm:request_max_num_generation_tokens",
        "histogram",
        _G,
        "Histogram of maximum number of requested generation tokens.",
        buckets="request_tokens",
    ),
    Series(
        "vllm:request_params_max_tokens",
        "histogram",
        _G,
        "Histogram of the max_tokens request parameter.",
        buckets="request_tokens",
    ),
)
SERIES_BY_NAME = {s.name: s for s in SERIES}


def buckets_of(series: Series, max_model_len: int = FALLBACK_MAX_MODEL_LEN) -> tuple[float, ...]:
    """A histogram's upper bounds (without +Inf), as vLLM's defaults for `max_model_len`."""
    if series.buckets == "request_tokens":
        return request_tokens_buckets(max_model_len)
    return {
        "request_latency": REQUEST_LATENCY_BUCKETS,
        "time_to_first_token": TIME_TO_FIRST_TOKEN_BUCKETS,
        "inter_token_latency": INTER_TOKEN_LATENCY_BUCKETS,
    }[series.buckets]


def counter(registry: CollectorRegistry, name: str) -> Counter:
    s = SERIES_BY_NAME[name]
    if s.kind != "counter":
        raise ValueError(f"{name} is a {s.kind}")
    return Counter(s.name, s.doc, s.labels, registry=registry)


def gauge(registry: CollectorRegistry, name: str) -> Gauge:
    s = SERIES_BY_NAME[name]
    if s.kind != "gauge":
        raise ValueError(f"{name} is a {s.kind}")
    return Gauge(s.name, s.doc, s.labels, registry=registry)


def histogram(
    registry: CollectorRegistry, name: str, max_model_len: int = FALLBACK_MAX_MODEL_LEN
) -> Histogram:
    s = SERIES_BY_NAME[name]
    if s.kind != "histogram":
        raise ValueError(f"{name} is a {s.kind}")
    return Histogram(
        s.name, s.doc, s.labels, buckets=buckets_of(s, max_model_len), registry=registry
    )
