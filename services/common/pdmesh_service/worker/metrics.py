"""A worker rank's counters: the totals its Status returns and its Prometheus series, moved
together.

`WorkerMetrics(instance_id)` is built once per rank by `run_worker` and handed to whoever counts
(the engine loop, decode's connector, prefill's pusher); each event is one method call that bumps
both the `WorkerStats` total and the series labelled `instance=<instance_id>`. Series (dashboards
and tests read these names):

    pdmesh_kv_transfer_bytes_total     KV bytes written to other agents over NIXL (every pool)
    pdmesh_kv_transfer_draft_bytes_total  of those, the speculative proposer pool's
    pdmesh_kv_transfer_seconds         duration of one NIXL KV WRITE (histogram)
    pdmesh_kv_transfer_failures_total  NIXL KV transfers that failed
    pdmesh_kv_received_bytes_total     KV bytes other agents wrote into this rank's pools
    pdmesh_kv_received_draft_bytes_total  of those, the speculative proposer pool's
    pdmesh_lease_expiries_total        reservations whose lease ran out before the KV
    pdmesh_kv_quarantines_total        ended reservations whose blocks stayed out while a WRITE
                                       could land
    pdmesh_kv_digest_mismatches_total  decode: hand-offs whose KV failed its digest check (failed
                                       closed: not admitted, blocks quarantined until released)
    pdmesh_kv_corruptions_injected_total  prefill, fault hook only: WRITEs sent with a flipped byte
    pdmesh_kv_blocks_used / _free      gauges, from the last `observe_load`
    pdmesh_requests_running / _waiting gauges, likewise
    pdmesh_spec_decode_draft_tokens_total{position}     drafts verified at each draft position
    pdmesh_spec_decode_accepted_tokens_total{position}  drafts accepted at each draft position
    pdmesh_spec_decode_verify_steps_total               request steps that verified drafts
    pdmesh_spec_decode_emitted_tokens_total             tokens those steps emitted
                                       (speculative decoding only: `observe_spec_decode` brings
                                       them up to the engine's `SpecDecodeStats`)

vLLM-named series (`pdmesh_service.vllm_metrics`, its table says which and why here), labelled
`model_name` (given by `serve_model`: the engine loop does it with the model directory's name) and
`engine=<instance_id>`:

    vllm:num_requests_running / _waiting   gauges, with the pdmesh ones
    vllm:kv_cache_usage_perc               used / (used + free) KV blocks of the full pool (free
    vllm:gpu_cache_usage_perc              counts the evictable cached ones, as vLLM's does); both
                                           names, one value
    vllm:prefix_cache_queries_total        prompt tokens of the requests whose prompt this rank
    vllm:prefix_cache_hits_total           computed, and of those the ones its prefix cache held,
                                           counted at each one's first output (`observe_output`); a
                                           prompt whose KV came over NIXL was not looked up here
    vllm:inter_token_latency_seconds       the gap between two outputs with tokens of one request
                                           on this rank (one per step, as vLLM's: a speculative
                                           step's tokens are one gap)

Prometheus families are per registry: `WorkerCollectors(registry)` makes them;
`default_collectors()` is the one set on the process-wide default registry (several ranks in one
process share it, each with its label).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pdmesh_service import vllm_metrics

if TYPE_CHECKING:
    from pdmesh_engine.scheduler import StepOutput
    from pdmesh_engine.spec_decode import SpecDecodeStats

TRANSFER_SECONDS_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
_INSTANCE_LABEL = ("instance",)


@dataclass
class WorkerStats:
    """Totals since the rank started (a snapshot is returned by `WorkerMetrics.snapshot`)."""

    kv_bytes_sent: int = 0  # every pool's
    kv_bytes_received: int = 0  # every pool's
    kv_draft_bytes_sent: int = 0  # of kv_bytes_sent, the speculative proposer pool's
    kv_draft_bytes_received: int = 0  # of kv_bytes_received, likewise
    transfer_failures: int = 0
    lease_expiries: int = 0
    kv_quarantines: int = 0
    kv_digest_mismatches: int = 0  # decode: hand-offs that failed the KV digest check
    kv_corruptions_injected: int = 0  # prefill: WRITEs the fault hook corrupted
    requests_total: int = 0  # requests this rank took (Generate, Reserve, Prefill)


@dataclass(frozen=True)
class WorkerLoad:
    """What the load gauges show: the engine's batch and pool at one moment."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int


class WorkerCollectors:
    """The worker families on one registry (a registry takes each name once)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _INSTANCE_LABEL, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _INSTANCE_LABEL, registry=registry)

        self.kv_transfer_bytes = counter(
            "pdmesh_kv_transfer_bytes_total", "KV bytes written to other agents over NIXL"
        )
        self.kv_transfer_seconds = Histogram(
            "pdmesh_kv_transfer_seconds",
            "Duration of one NIXL KV WRITE",
            _INSTANCE_LABEL,
            buckets=TRANSFER_SECONDS_BUCKETS,
            registry=registry,
        )
        self.kv_transfer_failures = counter(
            "pdmesh_kv_transfer_failures_total", "NIXL KV transfers that failed"
        )
        self.kv_received_bytes = counter(
            "pdmesh_kv_received_bytes_total", "KV bytes other agents wrote into this rank's pools"
        )
        self.kv_transfer_draft_bytes = counter(
            "pdmesh_kv_transfer_draft_bytes_total",
            "Of the KV bytes written over NIXL, the speculative proposer pool's",
        )
        self.kv_received_draft_bytes = counter(
            "pdmesh_kv_received_draft_bytes_total",
            "Of the KV bytes received over NIXL, the speculative proposer pool's",
        )
        self.lease_expiries = counter(
            "pdmesh_lease_expiries_total", "Reservations whose lease ran out before the KV"
        )
        self.kv_quarantines = counter(
            "pdmesh_kv_quarantines_total",
            "Ended reservations whose blocks stayed out of the pool while a KV write could land",
        )
        self.kv_digest_mismatches = counter(
            "pdmesh_kv_digest_mismatches_total",
            "Hand-offs whose KV failed its digest check on arrival (failed closed, not admitted)",
        )
        self.kv_corruptions_injected = counter(
            "pdmesh_kv_corruptions_injected_total",
            "KV WRITEs sent with one byte flipped by the fault hook (tests and chaos only)",
        )
        self.kv_blocks_used = gauge("pdmesh_kv_blocks_used", "KV blocks held by requests")
        self.kv_blocks_free = gauge("pdmesh_kv_blocks_free", "KV blocks free or evictable")
        self.requests_running = gauge("pdmesh_requests_running", "Requests in the running batch")
        self.requests_waiting = gauge(
            "pdmesh_requests_waiting", "Requests waiting to run or for KV"
        )
        by_position = (*_INSTANCE_LABEL, "position")
        self.spec_draft_tokens = Counter(
            "pdmesh_spec_decode_draft_tokens_total",
            "Speculative drafts verified, by position in their step (0: the first draft)",
            by_position,
            registry=registry,
        )
        self.spec_accepted_tokens = Counter(
            "pdmesh_spec_decode_accepted_tokens_total",
            "Speculative drafts accepted, by position in their step (0: the first draft)",
            by_position,
            registry=registry,
        )
        self.spec_verify_steps = counter(
            "pdmesh_spec_decode_verify_steps_total",
            "Request steps that verified speculative drafts",
        )
        self.spec_emitted_tokens = counter(
            "pdmesh_spec_decode_emitted_tokens_total",
            "Tokens emitted by the steps that verified drafts (accepted drafts + 1 each)",
        )
        self.vllm_running = vllm_metrics.gauge(registry, "vllm:num_requests_running")
        self.vllm_waiting = vllm_metrics.gauge(registry, "vllm:num_requests_waiting")
        self.vllm_kv_usage = vllm_metrics.gauge(registry, "vllm:kv_cache_usage_perc")
        self.vllm_gpu_cache_usage = vllm_metrics.gauge(registry, "vllm:gpu_cache_usage_perc")
        self.vllm_prefix_queries = vllm_metrics.counter(registry, "vllm:prefix_cache_queries")
        self.vllm_prefix_hits = vllm_metrics.counter(registry, "vllm:prefix_cache_hits")
        self.vllm_itl = vllm_metrics.histogram(registry, "vllm:inter_token_latency_seconds")


@functools.cache
def default_collectors() -> WorkerCollectors:
    """The worker families on prometheus_client's default registry (made on first use)."""
    return WorkerCollectors(REGISTRY)


@dataclass(frozen=True)
class _VllmSeries:
    """One rank's children of the vLLM-named families."""

    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    gpu_cache_usage: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    itl: Histogram


class WorkerMetrics:
    """One rank's counters. Not thread-safe: counted from the engine thread only (where Status reads
    them)."""

    def __init__(self, instance_id: str, collectors: WorkerCollectors | None = None) -> None:
        families = collectors if collectors is not None else default_collectors()
        self.instance_id = instance_id
        self._families = families
        self._stats = WorkerStats()
        self._sent = families.kv_transfer_bytes.labels(instance_id)
        self._seconds = families.kv_transfer_seconds.labels(instance_id)
        self._failures = families.kv_transfer_failures.labels(instance_id)
        self._received = families.kv_received_bytes.labels(instance_id)
        self._draft_sent = families.kv_transfer_draft_bytes.labels(instance_id)
        self._draft_received = families.kv_received_draft_bytes.labels(instance_id)
        self._spec: SpecDecodeStats | None = None  # the last stats `observe_spec_decode` saw
        self._expiries = families.lease_expiries.labels(instance_id)
        self._quarantines = families.kv_quarantines.labels(instance_id)
        self._digest_mismatches = families.kv_digest_mismatches.labels(instance_id)
        self._corruptions = families.kv_corruptions_injected.labels(instance_id)
        self._load = (
            families.kv_blocks_used.labels(instance_id),
            families.kv_blocks_free.labels(instance_id),
            families.requests_running.labels(instance_id),
            families.requests_waiting.labels(instance_id),
        )
        self._vllm: _VllmSeries | None = None  # from `serve_model`
        self._computing: set[str] = set()  # streamed requests whose prompt is computed here
        self._last_token_at: dict[str, float] = {}  # streamed requests: their last output's time

    def serve_model(self, model_name: str) -> None:
        """Make this rank's vLLM-named series, labelled `model_name` (the served model)."""
        f, labels = self._families, (model_name, self.instance_id)
        self._vllm = _VllmSeries(
            f.vllm_running.labels(*labels),
            f.vllm_waiting.labels(*labels),
            f.vllm_kv_usage.labels(*labels),
            f.vllm_gpu_cache_usage.labels(*labels),
            f.vllm_prefix_queries.labels(*labels),
            f.vllm_prefix_hits.labels(*labels),
            f.vllm_itl.labels(*labels),
        )

    def snapshot(self) -> WorkerStats:
        return replace(self._stats)

    def request_taken(self) -> None:
        self._stats.requests_total += 1

    def kv_sent(self, num_bytes: int, seconds: float, draft_bytes: int = 0) -> None:
        """One WRITE of `num_bytes` in all, `draft_bytes` of them the proposer pool's."""
        self._stats.kv_bytes_sent += num_bytes
        self._stats.kv_draft_bytes_sent += draft_bytes
        self._sent.inc(num_bytes)
        self._draft_sent.inc(draft_bytes)
        self._seconds.observe(seconds)

    def transfer_failed(self) -> None:
        self._stats.transfer_failures += 1
        self._failures.inc()

    def kv_received(self, num_bytes: int, draft_bytes: int = 0) -> None:
        """A WRITE of `num_bytes` in all landed, `draft_bytes` of them in the proposer pool."""
        self._stats.kv_bytes_received += num_bytes
        self._stats.kv_draft_bytes_received += draft_bytes
        self._received.inc(num_bytes)
        self._draft_received.inc(draft_bytes)

    def lease_expired(self) -> None:
        self._stats.lease_expiries += 1
        self._expiries.inc()

    def kv_quarantined(self) -> None:
        self._stats.kv_quarantines += 1
        self._quarantines.inc()

    def kv_digest_mismatch(self) -> None:
        self._stats.kv_digest_mismatches += 1
        self._digest_mismatches.inc()

    def kv_corruption_injected(self) -> None:
        self._stats.kv_corruptions_injected += 1
        self._corruptions.inc()

    def observe_load(self, load: WorkerLoad) -> None:
        """Set the load gauges (the heartbeat calls this with each status it publishes)."""
        used, free, running, waiting = self._load
        used.set(load.kv_blocks_used)
        free.set(load.kv_blocks_free)
        running.set(load.num_running)
        waiting.set(load.num_waiting)
        if self._vllm is not None:
            total = load.kv_blocks_used + load.kv_blocks_free
            usage = load.kv_blocks_used / total if total > 0 else 0.0
            self._vllm.running.set(load.num_running)
            self._vllm.waiting.set(load.num_waiting)
            self._vllm.kv_usage.set(usage)
            self._vllm.gpu_cache_usage.set(usage)

    # ----- per request, from the engine thread -----
    def prompt_submitted(self, request_id: str) -> None:
        """This rank computes the prompt of `request_id`, whose outputs it streams."""
        self._computing.add(request_id)

    def observe_output(self, output: StepOutput, taken: bool, now: float) -> None:
        """One step output of this rank's engine at `now` (time.monotonic). `taken`: the role
        consumed it (a prefill rank's computed prompt: its finishing output counts the prompt)."""
        request_id, finished = output.request_id, output.finish_reason is not None
        if taken:
            if finished:
                self._prompt_computed(output)
            return
        if request_id in self._computing:
            self._computing.discard(request_id)
            self._prompt_computed(output)
        if finished:
            last = self._last_token_at.pop(request_id, None)
        elif output.new_token_ids:
            last = self._last_token_at.get(request_id)
            self._last_token_at[request_id] = now
        else:
            return
        if last is not None and output.new_token_ids and self._vllm is not None:
            self._vllm.itl.observe(now - last)

    def forget(self, request_id: str) -> None:
        """The request left this rank other than by a finishing output (aborted)."""
        self._computing.discard(request_id)
        self._last_token_at.pop(request_id, None)

    def forget_all(self) -> None:
        self._computing.clear()
        self._last_token_at.clear()

    def _prompt_computed(self, output: StepOutput) -> None:
        if self._vllm is not None:
            self._vllm.prefix_queries.inc(output.num_prompt_tokens)
            self._vllm.prefix_hits.inc(output.num_cached_tokens)

    def observe_spec_decode(self, stats: SpecDecodeStats | None) -> None:
        """Bring the speculative-decoding counters up to the engine's totals `stats` (None:
        speculation is off, nothing to count). Called with each status the engine thread makes."""
        if stats is None:
            return
        last = self._spec
        families, instance = self._families, self.instance_id
        for position, (drafts, accepted) in enumerate(
            zip(stats.num_drafts_per_position, stats.num_accepted_per_position, strict=True)
        ):
            if last is None or position >= len(last.num_drafts_per_position):
                before = (0, 0)
            else:
                before = (
                    last.num_drafts_per_position[position],
                    last.num_accepted_per_position[position],
                )
            label = str(position)
            families.spec_draft_tokens.labels(instance, label).inc(drafts - before[0])
            families.spec_accepted_tokens.labels(instance, label).inc(accepted - before[1])
        families.spec_verify_steps.labels(instance).inc(
            stats.num_verify_steps - (last.num_verify_steps if last else 0)
        )
        families.spec_emitted_tokens.labels(instance).inc(
            stats.num_emitted_tokens - (last.num_emitted_tokens if last else 0)
        )
        self._spec = stats
