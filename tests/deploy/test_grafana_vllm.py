"""deploy/grafana/vllm.json, vLLM's own dashboard, shows what pdmesh exports: every metric every
query of it names (panel targets and template variables) is a series a real mesh exports, read from
a scrape of its gateway and its worker after a request, not from a list.

A name is matched as a query writes it (`vllm:prompt_tokens_total`,
`vllm:e2e_request_latency_seconds_bucket`) against the scraped sample names, so no suffix is
guessed away; a name with a series suffix must also be a sample of a family of the kind that has it
(`_bucket`/`_sum`/`_count`: a histogram, `_total`: a counter; a histogram whose own name ends in
`_total`, like vLLM's `vllm:iteration_tokens_total`, is scraped as `..._total_bucket` and so on).
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_service.redis_server import free_port

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
# a metric selector: a name followed by `{` or `[` (with or without labels), or a name with a colon
# (a recording-rule-like vLLM name) anywhere
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]")
COLON_NAME = re.compile(r"(?<![a-zA-Z0-9_:$])([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+)")
LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,")
SUFFIX_KIND = {
    "_bucket": "histogram",
    "_sum": "histogram",
    "_count": "histogram",
    "_total": "counter",
}
WORKER_ARGS = ("--block-size", "8", "--num-blocks", "96", "--torch-threads", "1")


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((GRAFANA / "vllm.json").read_text())
    return loaded


def walk_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from walk_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk_exprs(item)


def variable_queries(board: dict[str, Any]) -> list[str]:
    queries = []
    for variable in board.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        queries.append(query.get("query", "") if isinstance(query, dict) else str(query or ""))
    return queries


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions like `rate(` are not followed by `{`
    or `[`; label matchers' names are inside the braces, not before them)."""
    without_labels = re.sub(r"\{[^}]*\}", "{}", expr)
    return set(SELECTOR.findall(without_labels)) | set(COLON_NAME.findall(without_labels))


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        "histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket"
        '{model_name="$model_name"}[$__rate_interval])))'
    )
    assert metric_names(expr) == {"vllm:e2e_request_latency_seconds_bucket"}
    assert metric_names('vllm:num_requests_running{model_name="$m"}') == {
        "vllm:num_requests_running"
    }
    assert metric_names("rate(up[5m])") == {"up"}


def test_the_dashboard_is_provisioned_beside_pdmeshs() -> None:
    board = dashboard()
    assert board["title"] == "vLLM" and board["uid"] != "pdmesh"
    providers = {}
    for path in (GRAFANA / "provisioning" / "dashboards").glob("*.yml"):
        for provider in yaml.safe_load(path.read_text())["providers"]:
            providers[provider["name"]] = provider["options"]["path"]
    assert {"pdmesh", "vllm"} <= set(providers)
    # neither provider's directory holds the other's (the file provider reads subdirectories)
    a, b = Path(providers["pdmesh"]), Path(providers["vllm"])
    assert a != b and a not in b.parents and b not in a.parents


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """sample name -> its family's kind, of every sample the gateway and the decode rank of an agg
    mesh export after one completion."""
    from pdmesh.tools.model_init import init_model

    model = init_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny", verbose=False)
    mesh = Mesh(
        MeshOptions(
            model_dir=model,
            num_prefill=0,
            num_decode=1,
            mode="agg",
            http_port=free_port(),
            grpc_port=free_port(),
            deployment="test-grafana-vllm",
            log_dir=tmp_path_factory.mktemp("logs-grafana-vllm"),
            worker_args=WORKER_ARGS,
        )
    )
    mesh.start(timeout_s=240, progress=lambda line: None)
    try:
        base = f"http://{mesh.options.host}:{mesh.options.http_port}"
        body = json.dumps({"prompt": "Hello, world", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            base + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
        urls = [base + "/metrics"] + [
            f"http://{mesh.options.host}:{spec.metrics_port}/metrics"
            for spec in mesh.specs
            if spec.role == "decode"
        ]
        kinds: dict[str, str] = {}
        for url in urls:
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    kinds[sample.name] = family.type
        yield kinds
    finally:
        mesh.stop()


def test_every_query_names_a_series_pdmesh_exports(scraped: dict[str, str]) -> None:
    board = dashboard()
    exprs = [*walk_exprs(board), *variable_queries(board)]
    assert len(exprs) >= 30
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr) | set(LABEL_VALUES.findall(expr))
        if expr.startswith("label_values(") and not names:
            continue  # label_values(model_name): a label, any series
        assert names, f"no metric in {expr!r}"
        used |= names
    missing = sorted(n for n in used if n not in scraped)
    assert not missing, f"the dashboard queries series pdmesh does not export: {missing}"
    for name in used:
        suffix = next((s for s in SUFFIX_KIND if name.endswith(s)), None)
        if suffix is not None:
            assert scraped[name] == SUFFIX_KIND[suffix], (name, scraped[name])
        else:  # a bare name: a gauge's (or an untyped) sample
            assert scraped[name] in ("gauge", "unknown"), (name, scraped[name])
    assert any(n.startswith("vllm:") for n in used)
