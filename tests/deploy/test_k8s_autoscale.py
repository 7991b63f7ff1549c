"""The autoscale overlay (deploy/k8s/overlays/autoscale): KEDA ScaledObjects whose Prometheus
triggers read the gauge the gateway really exports, with the gateway's own bounds, so replicas =
the desired count; and worker StatefulSets whose replicas are single-rank instances (what a
ScaledObject may scale), each registered under its pod name, draining within its grace period.

The first tests read the overlay's files with PyYAML (no kubectl needed); the others render it
(`test_k8s.render`, skipped without kubectl)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from test_k8s import by_kind_name, container_env, expand, flag_value, pod_spec, render

from pdmesh_gateway.autoscale import DESIRED_REPLICAS_METRIC, Decision, PoolSignals, Signal, Signals
from pdmesh_gateway.autoscale_loop import AutoscaleMetrics
from pdmesh_service.scaling import POOLS, parse_bounds

OVERLAY = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "overlays" / "autoscale"
QUERY = re.compile(r'^max\((\w+)\{pool="(\w+)"\}\)$')


def scaled_objects() -> list[dict[str, Any]]:
    docs = yaml.safe_load_all((OVERLAY / "scaledobjects.yaml").read_text())
    return [d for d in docs if d and d["kind"] == "ScaledObject"]


def gateway_bounds_in_overlay() -> dict[str, Any]:
    """The --autoscale bounds the overlay's gateway patch adds."""
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    [patch] = [p for p in kustomization["patches"] if p.get("target", {}).get("name") == "gateway"]
    values = [op["value"] for op in yaml.safe_load(patch["patch"])]
    [flag] = [v for v in values if v.startswith("--autoscale=")]
    return parse_bounds(flag.split("=", 1)[1])


def test_each_pool_has_a_scaled_object_reading_the_gauge_the_gateway_exports() -> None:
    registry = CollectorRegistry()
    metrics = AutoscaleMetrics(registry)
    metrics.observe(
        Signals(prefill=PoolSignals(1), decode=PoolSignals(1)),
        {p: Decision(p, 2, 1, Signal.QUEUE_TIME, "x") for p in POOLS},
    )
    exported = generate_latest(registry).decode()
    objects = {o["spec"]["scaleTargetRef"]["name"]: o for o in scaled_objects()}
    assert set(objects) == set(POOLS)
    for pool, obj in objects.items():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        assert obj["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
        [trigger] = obj["spec"]["triggers"]
        assert trigger["type"] == "prometheus"
        # replicas = ceil(value / threshold) = the desired count (Value would scale the current)
        assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["threshold"] == "1"
        assert trigger["metadata"]["ignoreNullValues"] == "false"
        match = QUERY.match(trigger["metadata"]["query"])
        assert match is not None, trigger["metadata"]["query"]
        assert match.groups() == (DESIRED_REPLICAS_METRIC, pool)
        assert f'{DESIRED_REPLICAS_METRIC}{{pool="{pool}"}} 2.0' in exported
        assert obj["spec"]["cooldownPeriod"] > 0


def test_the_scaled_objects_bounds_are_the_gateways() -> None:
    bounds = gateway_bounds_in_overlay()
    for obj in scaled_objects():
        pool = obj["spec"]["scaleTargetRef"]["name"]
        assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]) == (
            bounds[pool].min_replicas,
            bounds[pool].max_replicas,
        ), pool


def test_rendered_workers_are_single_rank_instances_scaled_by_keda() -> None:
    objects = render("autoscale")
    bounds = gateway_bounds_in_overlay()
    scaled = {
        o["spec"]["scaleTargetRef"]["name"]: o for o in objects if o["kind"] == "ScaledObject"
    }
    assert set(scaled) == set(POOLS)
    for pool in POOLS:
        workload = by_kind_name("autoscale", "StatefulSet", pool)
        assert workload["spec"]["replicas"] == bounds[pool].min_replicas
        container = pod_spec(workload)["containers"][0]
        args = expand(container["args"], container_env("autoscale", container))
        assert not [a for a in args if a.startswith(("--dep=", "--dep-rank", "--dist-"))], args
        assert flag_value(args, "--instance-id") == "pod-0"  # its pod's name
        assert "DEP_RANK" not in {v["name"] for v in container["env"]}
        drain_s = float(flag_value(args, "--drain-s"))
        assert 0 < drain_s < pod_spec(workload)["terminationGracePeriodSeconds"]
    gateway = pod_spec(by_kind_name("autoscale", "Deployment", "gateway"))["containers"][0]
    assert flag_value(gateway["args"], "--autoscale") == "prefill=1..3,decode=1..2"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_other_overlays_do_not_autoscale(overlay: str) -> None:
    objects = render(overlay)
    assert not [o for o in objects if o["kind"] == "ScaledObject"]
    gateway = pod_spec(by_kind_name(overlay, "Deployment", "gateway"))["containers"][0]
    assert not [a for a in gateway["args"] if a.startswith("--autoscale")]
