"""The prefill rank's own Prometheus families (the worker's are `pdmesh_service.worker.metrics`):

pdmesh_handoff_revision_refusals_total  hand-offs refused because the decode target runs
                                        another revision (`core.check_revision`)
"""

from __future__ import annotations

import functools

from prometheus_client import REGISTRY, CollectorRegistry, Counter


def revision_refusal_family(registry: CollectorRegistry) -> Counter:
    return Counter(
        "pdmesh_handoff_revision_refusals",
        "KV hand-offs refused because the decode target runs another revision",
        ("instance",),
        registry=registry,
    )


@functools.cache
def revision_refusals() -> Counter:
    """The family on prometheus_client's default registry (made on first use)."""
    return revision_refusal_family(REGISTRY)
