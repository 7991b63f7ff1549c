"""The controller's Prometheus series (dashboards and tests read these names):

    pdmesh_eplb_balancedness{instance, model}      window balancedness of the running placement, now
    pdmesh_eplb_placement_version{instance, model} the published version
    pdmesh_eplb_rebalances_total{reason}           versions published ("interval" | "manual")
    pdmesh_eplb_slots_moved_total                  slots rewritten by the published versions
    pdmesh_eplb_plan_seconds                       time to plan one rebalance (histogram)

Families are per registry: `EplbMetrics(registry)`; `default_metrics()` is the one set on the
process-wide default registry (several controllers in one process, as in tests, share it).
"""

from __future__ import annotations

import functools

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pdmesh_service.eplb_protocol import RebalanceRecord

PLAN_SECONDS_BUCKETS = (1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
_MODEL_LABELS = ("instance", "model")


class EplbMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.balancedness = Gauge(
            "pdmesh_eplb_balancedness",
            "Window balancedness of the running placement",
            _MODEL_LABELS,
            registry=registry,
        )
        self.placement_version = Gauge(
            "pdmesh_eplb_placement_version",
            "Published placement version",
            _MODEL_LABELS,
            registry=registry,
        )
        self.rebalances = Counter(
            "pdmesh_eplb_rebalances_total",
            "Placement versions published",
            ("reason",),
            registry=registry,
        )
        self.slots_moved = Counter(
            "pdmesh_eplb_slots_moved_total",
            "Slots rewritten by published versions",
            registry=registry,
        )
        self.plan_seconds = Histogram(
            "pdmesh_eplb_plan_seconds",
            "Time to plan one rebalance",
            buckets=PLAN_SECONDS_BUCKETS,
            registry=registry,
        )

    def observe(self, instance: str, model: str, version: int, balancedness: float | None) -> None:
        self.placement_version.labels(instance, model).set(version)
        if balancedness is not None:
            self.balancedness.labels(instance, model).set(balancedness)

    def published(self, record: RebalanceRecord) -> None:
        self.rebalances.labels(record.reason).inc()
        self.slots_moved.inc(record.num_slots_moved)
        self.plan_seconds.observe(record.plan_ms / 1000.0)


@functools.cache
def default_metrics() -> EplbMetrics:
    """The eplb families on prometheus_client's default registry (made on first use)."""
    return EplbMetrics(REGISTRY)
