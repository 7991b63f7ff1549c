"""The Kubernetes manifests: both overlays render, every object validates against the Kubernetes
schemas, and the rendered workloads keep the deployment's contracts (probes, requests, GPUs only on
workers, torch-free images for gateway/kvstore/eplb, one pod per DEP rank, flags the services
really take)."""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = REPO / "deploy" / "k8s" / "overlays"
K8S_VERSION = "1.32.0"  # the oldest release the manifests target (pod-index label: 1.28+)
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
PDMESH_SERVICES = ("gateway", "kvstore", "eplb", "prefill", "decode")
TORCH_FREE = ("gateway", "kvstore", "eplb")
GPU_WORKERS = ("prefill", "decode")
# Flags the manifests use that the services do not take yet (the per-pod DEP ranks need rank 0's
# address: deploy/README.md, "Rank identity"). A flag leaves this set when the service gains it.
# flags the manifests use before a service knows them (none)
PENDING_FLAGS: frozenset[str] = frozenset()
# What the downward API gives, for checking the expanded arguments.
FIELD_SAMPLES = {
    "status.podIP": "10.1.2.3",
    "metadata.name": "pod-0",
    "metadata.namespace": "pdmesh",
    "metadata.labels['apps.kubernetes.io/pod-index']": "1",
}
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# every overlay; `autoscale` (cpu + KEDA ScaledObjects, single-rank workers: test_k8s_autoscale.py)
# keeps every contract but the DEP one
ALL_OVERLAYS = ["cpu", "gpu", "autoscale"]
CRD_GROUPS = ("keda.sh/",)  # custom resources: no core schema to validate them against


@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on PATH: cannot render the kustomize overlays")
    out = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAYS / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return tuple(obj for obj in yaml.safe_load_all(out) if obj)


def workloads(overlay: str) -> list[dict[str, Any]]:
    return [obj for obj in render(overlay) if obj["kind"] in WORKLOAD_KINDS]


def by_kind_name(overlay: str, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in render(overlay) if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{overlay}: expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def all_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    return [*spec.get("initContainers", []), *spec["containers"]]


def container_env(overlay: str, container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (downward API fields as samples)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = source["configMapRef"]["name"]
        env.update(by_kind_name(overlay, "ConfigMap", config_map)["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            env[var["name"]] = "secret-sample"
        else:
            env[var["name"]] = FIELD_SAMPLES[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) references as the kubelet expands them; an unknown one is an error here (the
    kubelet would pass it on literally)."""

    def one(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in the container's environment"
        return env[match.group(1)]

    return [VAR_REF.sub(one, arg) for arg in args]


def flag_value(args: list[str], flag: str) -> str:
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {args}")


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    import kubernetes_validate

    objects = render(overlay)
    kinds = {obj["kind"] for obj in objects}
    assert {
        "Namespace",
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "StatefulSet",
        "Service",
    } <= kinds
    for obj in objects:
        where = f"{overlay}: {obj['kind']} {obj['metadata']['name']}"
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "pdmesh", where
        if obj["apiVersion"].startswith(CRD_GROUPS):
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_workload_has_probes_and_resource_requests(overlay: str) -> None:
    names = {obj["metadata"]["name"] for obj in workloads(overlay)}
    assert names == {"redis", *PDMESH_SERVICES}
    for obj in workloads(overlay):
        for container in pod_spec(obj)["containers"]:
            where = f"{overlay}: {obj['metadata']['name']}/{container['name']}"
            assert "readinessProbe" in container and "livenessProbe" in container, where
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
        for container in pod_spec(obj).get("initContainers", []):
            assert container["resources"]["requests"], (
                f"{overlay}: init container {container['name']}"
            )


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_grpc_probes_ask_for_the_services_health_name(overlay: str) -> None:
    expected = {
        "gateway": "pdmesh.gateway.v1.Generate",
        "kvstore": "pdmesh.kvstore.v1.KVStore",
        "eplb": "pdmesh.eplb.v1.Eplb",
        "prefill": "pdmesh.prefill.v1.Prefill",
        "decode": "pdmesh.decode.v1.Decode",
    }
    for name, service in expected.items():
        kind = "StatefulSet" if name in GPU_WORKERS else "Deployment"
        container = pod_spec(by_kind_name(overlay, kind, name))["containers"][0]
        probes = [
            container[p]
            for p in ("startupProbe", "readinessProbe", "livenessProbe")
            if p in container
        ]
        grpc_probes = [p["grpc"] for p in probes if "grpc" in p]
        assert grpc_probes, f"{name}: no gRPC probe"
        assert all(p["service"] == service and p["port"] == 50051 for p in grpc_probes), (
            name,
            grpc_probes,
        )


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_liveness_and_readiness_ask_the_probe_endpoints(overlay: str) -> None:
    """livenessProbe GETs /health/live, readinessProbe /health/ready (pdmesh_service.probes): on
    the metrics port (9090, --metrics-port) of every service but the gateway, on its REST port
    (8000, --http-port); the startup probe stays the gRPC health check of the service's name."""
    for name in PDMESH_SERVICES:
        kind = "StatefulSet" if name in GPU_WORKERS else "Deployment"
        container = pod_spec(by_kind_name(overlay, kind, name))["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        flag = "--http-port" if name == "gateway" else "--metrics-port"
        port_name = "http" if name == "gateway" else "metrics"
        assert f"{flag}={ports[port_name]}" in container["args"], (name, container["args"])
        for probe, path in (("livenessProbe", "/health/live"), ("readinessProbe", "/health/ready")):
            assert container[probe]["httpGet"] == {"path": path, "port": port_name}, (name, probe)
        assert "grpc" in container["startupProbe"], name


def gpu_count(container: dict[str, Any]) -> int:
    resources = container.get("resources", {})
    counts = [
        int(resources.get(part, {}).get("nvidia.com/gpu", 0)) for part in ("requests", "limits")
    ]
    return max(counts)


def test_gpu_overlay_gives_gpus_to_prefill_and_decode_only() -> None:
    with_gpu = {
        obj["metadata"]["name"]
        for obj in workloads("gpu")
        for c in pod_spec(obj)["containers"]
        if gpu_count(c) > 0
    }
    assert with_gpu == set(GPU_WORKERS)
    for name in GPU_WORKERS:
        obj = by_kind_name("gpu", "StatefulSet", name)
        assert pod_spec(obj)["nodeSelector"], name
        assert any(t["key"] == "nvidia.com/gpu" for t in pod_spec(obj)["tolerations"]), name
        assert all(c["image"].endswith("-cuda") for c in all_containers(obj)), name
    assert not [
        obj["metadata"]["name"]
        for obj in workloads("cpu")
        for c in all_containers(obj)
        if gpu_count(c)
    ]


def test_gpu_overlay_moves_the_kv_push_to_rdma() -> None:
    cpu = by_kind_name("cpu", "ConfigMap", network_config_map("cpu"))["data"]
    gpu = by_kind_name("gpu", "ConfigMap", network_config_map("gpu"))["data"]
    assert cpu["UCX_TLS"] == "tcp" and cpu["UCX_NET_DEVICES"] == "eth0"
    assert "rc" in gpu["UCX_TLS"].split(",") and "cuda_copy" in gpu["UCX_TLS"].split(",")
    assert gpu["UCX_NET_DEVICES"] != "eth0"
    assert (
        by_kind_name("gpu", "ConfigMap", common_config_map("gpu"))["data"]["PDMESH_DEVICE"]
        == "cuda"
    )


def network_config_map(overlay: str) -> str:
    return next(
        o["metadata"]["name"]
        for o in render(overlay)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("pdmesh-network")
    )


def common_config_map(overlay: str) -> str:
    return next(
        o["metadata"]["name"]
        for o in render(overlay)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("pdmesh-config")
    )


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_gateway_kvstore_and_eplb_run_their_torch_free_images(overlay: str) -> None:
    for name in TORCH_FREE:
        obj = by_kind_name(overlay, "Deployment", name)
        images = {c["image"] for c in all_containers(obj)}
        assert images == {f"pdmesh/{name}:latest"}, (name, images)
        assert not pod_spec(obj).get("nodeSelector"), name


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_each_dep_rank_is_one_pod_of_an_indexed_statefulset(overlay: str) -> None:
    for name in GPU_WORKERS:
        obj = by_kind_name(overlay, "StatefulSet", name)
        container = pod_spec(obj)["containers"][0]
        args = expand(container["args"], container_env(overlay, container))
        assert obj["spec"]["replicas"] == int(flag_value(args, "--dep")), name
        assert obj["spec"]["podManagementPolicy"] == "Parallel", name
        rank_source = next(v for v in container["env"] if v["name"] == "DEP_RANK")["valueFrom"][
            "fieldRef"
        ]
        assert rank_source["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
        assert "--dep-rank=$(DEP_RANK)" in container["args"]
        headless = by_kind_name(overlay, "Service", obj["spec"]["serviceName"])
        assert (
            headless["spec"]["clusterIP"] == "None"
            and headless["spec"]["publishNotReadyAddresses"] is True
        )
        assert (
            flag_value(args, "--dist-host") == f"{name}-0.{obj['spec']['serviceName']}.pdmesh.svc"
        )
        dist_port = int(flag_value(args, "--dist-port"))
        assert dist_port in {p["port"] for p in headless["spec"]["ports"]}, name


def service_parser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=name, exit_on_error=False)
    importlib.import_module(f"pdmesh_{name}.server").add_arguments(parser)
    return parser


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_containers_pass_flags_the_services_take(overlay: str) -> None:
    """Each pdmesh container's expanded arguments parse with its service's own parser and make a
    valid config; only PENDING_FLAGS may be unknown, and each of them must still be unknown."""
    used_pending: set[str] = set()
    for name in PDMESH_SERVICES:
        kind = "StatefulSet" if name in GPU_WORKERS else "Deployment"
        container = pod_spec(by_kind_name(overlay, kind, name))["containers"][0]
        args = expand(container["args"], container_env(overlay, container))
        parser = service_parser(name)
        namespace, unknown = parser.parse_known_args(args)
        unknown_flags = {arg.split("=", 1)[0] for arg in unknown if arg.startswith("--")}
        assert unknown_flags <= PENDING_FLAGS, (
            f"{name}: unknown flags {sorted(unknown_flags - PENDING_FLAGS)}"
        )
        used_pending |= unknown_flags
        # ValueError: bad value
        importlib.import_module(f"pdmesh_{name}.server").config_from_args(namespace)
    known_now = {
        flag
        for flag in PENDING_FLAGS
        if any(flag in service_parser(s)._option_string_actions for s in GPU_WORKERS)
    }
    assert not known_now, f"{sorted(known_now)} exist now: remove them from PENDING_FLAGS"
    assert used_pending <= PENDING_FLAGS


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_variable_reference_resolves_in_its_container(overlay: str) -> None:
    """A $(VAR) the container's environment lacks would reach the service literally."""
    pods = [o for o in render(overlay) if o["kind"] in (*WORKLOAD_KINDS, "Job")]
    assert any(o["kind"] == "Job" for o in pods) == (overlay in ("cpu", "autoscale"))
    for obj in pods:
        for container in all_containers(obj):
            expand(
                [*container.get("command", []), *container.get("args", [])],
                container_env(overlay, container),
            )


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_workers_roll_by_instance_decode_first_and_drain(overlay: str) -> None:
    """A revision rollout keeps both revisions servable (deploy/README.md, "Rolling out a new
    revision"): no StatefulSet replaces its ranks one by one (a DEP group of two revisions cannot
    form), decode instances roll before prefill ones, and a stopping rank drains (--drain-s) within
    its grace period."""
    order = {}
    for name in GPU_WORKERS:
        obj = by_kind_name(overlay, "StatefulSet", name)
        assert obj["spec"]["updateStrategy"] == {"type": "OnDelete"}, name
        order[name] = int(obj["metadata"]["annotations"]["pdmesh.io/roll-order"])
        container = pod_spec(obj)["containers"][0]
        args = expand(container["args"], container_env(overlay, container))
        drain_s = float(flag_value(args, "--drain-s"))
        assert 0 < drain_s < pod_spec(obj)["terminationGracePeriodSeconds"], name
    assert order["decode"] < order["prefill"], order


@pytest.mark.parametrize("overlay", ALL_OVERLAYS)
def test_every_image_is_a_compose_image_and_pins_by_digest(overlay: str, tmp_path: Path) -> None:
    """The manifests run the images `docker compose build` makes (deploy/compose.yaml's names), and
    a kustomization over the overlay that gives each a digest turns every container's image into
    `name@sha256:...`: a release can pin them all."""
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())["services"]
    compose_images = {
        re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", s["image"]).split(":")[0] for s in compose.values()
    }
    names = {
        c["image"].split("@")[0].rsplit(":", 1)[0]
        for obj in render(overlay)
        if obj["kind"] in (*WORKLOAD_KINDS, "Job")
        for c in all_containers(obj)
    }
    assert names <= compose_images, names - compose_images
    digests = {name: f"sha256:{n:064x}" for n, name in enumerate(sorted(names), start=1)}
    shutil.copytree(REPO / "deploy" / "k8s", tmp_path / "k8s")  # kustomize takes relative roots
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"k8s/overlays/{overlay}"],
                "images": [{"name": n, "digest": d} for n, d in digests.items()],
            }
        )
    )
    out = subprocess.run(
        ["kubectl", "kustomize", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    pinned = [
        c["image"]
        for obj in yaml.safe_load_all(out)
        if obj and obj["kind"] in (*WORKLOAD_KINDS, "Job")
        for c in all_containers(obj)
    ]
    assert pinned and all(
        image == f"{image.split('@')[0]}@{digests[image.split('@')[0]]}" for image in pinned
    ), pinned
