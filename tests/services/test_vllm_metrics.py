"""The vLLM-named series (`pdmesh_service.vllm_metrics.SERIES`) on a real mesh: a disaggregated one
(a prefill and a decode rank) on the tiny model serves a few completions over HTTP; then each
worker's metrics port and the gateway's /metrics are scraped.

Checked against the table (names, types, labels and buckets from vLLM 0.33's metrics code): every
series is exported where the table says, with its type, its label names, `model_name` = the model
/v1/models lists, `engine` = the rank's instance id, and vLLM's buckets; the counters moved by what
the responses' usage and finish reasons say; the gauges are in range.
"""

from __future__ import annotations

import collections
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_service import vllm_metrics as vm
from pdmesh_service.redis_server import free_port

WORKER_ARGS = (
    *("--block-size", "8"),
    *("--num-blocks", "160"),
    *("--max-num-batched-tokens", "64"),
    *("--max-num-seqs", "16"),
    *("--torch-threads", "1"),
)
PROMPT = "The quick brown fox jumps over the lazy dog, " * 4
SETTLE_S = 30.0


def scrape(url: str) -> dict[str, Any]:
    """name -> family (prometheus_client's parser: a counter's name without `_total`)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    from pdmesh.tools.model_init import init_model

    model = init_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", verbose=False)
    mesh = Mesh(
        MeshOptions(
            model_dir=model,
            num_prefill=1,
            num_decode=1,
            mode="disagg",
            http_port=free_port(),
            grpc_port=free_port(),
            deployment="test-vllm-metrics",
            log_dir=tmp_path_factory.mktemp("logs-vllm-metrics"),
            worker_args=WORKER_ARGS,
        )
    )
    mesh.start(timeout_s=240, progress=lambda line: None)
    yield mesh
    mesh.stop()


def worker_urls(mesh: Mesh) -> dict[str, str]:
    """instance id -> metrics URL of each prefill and decode rank."""
    return {
        spec.name: f"http://{mesh.options.host}:{spec.metrics_port}/metrics"
        for spec in mesh.specs
        if spec.role in ("prefill", "decode")
    }


def value(family: Any, sample_name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in family.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def check_family(family: Any, series: vm.Series, model: str, engine: str, max_len: int) -> None:
    assert family.type == series.kind, (series.name, family.type)
    assert family.samples, f"{series.name}: no samples"
    for sample in family.samples:
        names = set(sample.labels) - {"le"}
        assert names == set(series.labels), (series.name, sample.labels)
        assert sample.labels["model_name"] == model
        if series.where == "worker":
            assert sample.labels["engine"] == engine
            assert series.labels == series.vllm_labels  # a worker's are vLLM's exactly
        if series.extra_labels == ("finished_reason",):
            assert sample.labels["finished_reason"] in vm.FINISH_REASONS
    if series.kind == "histogram":
        bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
        expected = [*vm.buckets_of(series, max_len), float("inf")]
        if series.buckets == "request_tokens" and bounds != expected:
            # the gateway not given its model (server.serve) caps the family at the fallback
            expected = [*vm.buckets_of(series), float("inf")]
        assert bounds == expected, series.name
    if series.kind == "counter":  # scraped as vLLM's are: <name>_total
        assert {s.name for s in family.samples} <= {
            series.name + "_total",
            series.name + "_created",
        }


def test_vllm_series_on_every_worker_and_the_gateway(mesh: Mesh) -> None:
    base = f"http://{mesh.options.host}:{mesh.options.http_port}"
    with urllib.request.urlopen(base + "/v1/models", timeout=10) as response:
        model_list = json.loads(response.read())["data"]
    model, max_len = model_list[0]["id"], int(model_list[0].get("max_model_len") or 0)
    answers = [
        post(base, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 6}),
        # the same prompt again: its full blocks are in a prefix cache now
        post(base, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 4}),
        post(
            base,
            "/v1/completions",
            {"model": model, "prompt": "Hello there", "max_tokens": 5, "ignore_eos": True},
        ),
    ]
    usage = [a["usage"] for a in answers]
    prompt_tokens = sum(u["prompt_tokens"] for u in usage)
    completion_tokens = sum(u["completion_tokens"] for u in usage)
    reasons = collections.Counter(a["choices"][0]["finish_reason"] for a in answers)
    assert reasons["length"] >= 1  # ignore_eos with max_tokens

    # the gateway counts a request when it ends; the workers' gauges follow their heartbeat
    deadline = time.monotonic() + SETTLE_S
    while True:
        gateway = scrape(base + "/metrics")
        workers = {name: scrape(url) for name, url in worker_urls(mesh).items()}
        success = gateway.get("vllm:request_success")
        queries = sum(
            value(w["vllm:prefix_cache_queries"], "vllm:prefix_cache_queries_total")
            for w in workers.values()
            if "vllm:prefix_cache_queries" in w
        )
        settled = (
            success is not None
            and value(success, "vllm:request_success_total") == len(answers)
            and queries >= prompt_tokens
            and all(
                value(w[gauge], gauge) == 0
                for w in workers.values()
                for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting")
            )
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)

    if not max_len:
        max_len = vm.FALLBACK_MAX_MODEL_LEN
    assert len(workers) == 2
    for series in vm.SERIES:
        where = {"gateway": gateway} if series.where == "gateway" else workers
        for engine, families in where.items():
            assert series.name in families, f"{series.name} missing on {engine}"
            check_family(families[series.name], series, model, engine, max_len)

    # --- the gateway's counters: what the responses say ---
    def g(name: str, sample: str, **labels: str) -> float:
        return value(gateway[name], sample, model_name=model, **labels)

    assert g("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt_tokens
    assert g("vllm:generation_tokens", "vllm:generation_tokens_total") == completion_tokens
    for reason in vm.FINISH_REASONS:
        counted = g("vllm:request_success", "vllm:request_success_total", finished_reason=reason)
        assert counted == reasons.get(reason, 0), reason
    n = len(answers)
    for name in (
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_max_tokens",
        "vllm:request_max_num_generation_tokens",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
    ):
        assert g(name, name + "_count") == n, name
    assert g("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert (
        g("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum")
        == completion_tokens
    )
    assert g("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 6 + 4 + 5
    with_tpot = sum(1 for u in usage if u["completion_tokens"] > 1)
    assert (
        g(
            "vllm:request_time_per_output_token_seconds",
            "vllm:request_time_per_output_token_seconds_count",
        )
        == with_tpot
    )

    # --- the workers': each prompt computed once, on one rank ---
    def w(engine: str, name: str, sample: str) -> float:
        return value(workers[engine][name], sample, model_name=model, engine=engine)

    engines = list(workers)
    total_queries = sum(
        w(e, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") for e in engines
    )
    total_hits = sum(
        w(e, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") for e in engines
    )
    assert total_queries == prompt_tokens
    assert 0 < total_hits < total_queries  # the repeated prompt hit; >= 1 token is computed
    for engine in engines:
        usage_perc = w(engine, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc")
        assert 0.0 <= usage_perc <= 1.0
        assert w(engine, "vllm:gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc") == usage_perc
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            assert w(engine, gauge, gauge) == 0, (engine, gauge)  # idle again
    decode = next(e for e in engines if e.startswith("decode"))
    itl = w(decode, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    assert itl >= 1  # the decode steps after a request's first token there
    itl_sum = w(decode, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_sum")
    assert itl_sum > 0


def test_the_table_is_vllms() -> None:
    """The facts copied from vLLM 0.33: bucket families and the request-token 1-2-5 series."""
    assert vm.request_tokens_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert vm.request_tokens_buckets(2048)[-1] == 2000
    assert len(vm.SERIES) == len(vm.SERIES_BY_NAME)
    assert all(s.name.startswith("vllm:") for s in vm.SERIES)
    assert all(bool(s.buckets) == (s.kind == "histogram") for s in vm.SERIES)
    wanted = {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_success",
    }
    assert wanted <= set(vm.SERIES_BY_NAME)
