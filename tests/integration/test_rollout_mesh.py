"""A rolling update under load: two revisions side by side, no error, no cross-revision hand-off.

A mesh of 2 prefill + 2 decode ranks (revision A: the tiny model with 8-token KV blocks) serves a
continuous stream of greedy requests while each rank in turn (decode-0, prefill-0, decode-1,
prefill-1) is replaced by one of revision B (16-token blocks: another fingerprint, the same greedy
text), surge first: the new rank serves, then the old one drains (--drain-s) and exits. Throughout,
the gateway pairs prefill and decode ranks of one revision only (a revision without a prefill rank
prefills on its decode rank), so every request completes with the offline engine's text, no
prefill rank ever refuses a target for its revision (the fence behind the pairing), and the new
revision's ranks hand KV off among themselves.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from meshlib import WORKER_ARGS, http_url, replace_service, start_mesh, with_options
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.launcher import Mesh

NUM_CLIENTS, MAX_TOKENS = 4, 8
DRAIN_S = "6"  # longer than a heartbeat + a gateway refresh + the longest request under this load
PROMPTS = [
    f"Request {i}: the rolling update keeps serving while ranks come and go " * (1 + i % 3)
    for i in range(8)
]
NEW_REVISION = {"--block-size": "16"}  # the old ranks run WORKER_ARGS' 8
ROLL_ORDER = ("decode-0", "prefill-0", "decode-1", "prefill-1")
SETTLE_S = 3.0  # load on each mixed state of the mesh before the next replacement


@pytest.fixture(scope="module")
def rollout_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    mesh = start_mesh(
        tiny_model,
        tmp_path_factory.mktemp("logs-rollout"),
        "test-rollout",
        num_prefill=2,
        num_decode=2,
        worker_args=with_options(WORKER_ARGS, {"--drain-s": DRAIN_S}),
    )
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> dict[str, str]:
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(tiny_model, num_blocks=512, block_size=8)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


def _revisions(mesh: Mesh) -> dict[str, str]:
    """Worker id → revision, as the registry has them."""
    from pdmesh_service.instance import Role
    from pdmesh_service.registry import Registry, connect

    async def read() -> dict[str, str]:
        redis = connect(mesh.redis_url)
        try:
            found = await Registry(redis, mesh.options.deployment).instances()
        finally:
            await redis.aclose()
        return {i.instance_id: i.revision for i in found if i.role in (Role.PREFILL, Role.DECODE)}

    return asyncio.run(read())


def _metric(mesh: Mesh, name: str, sample: str) -> float:
    """A worker's Prometheus sample (summed over labels)."""
    [spec] = [s for s in mesh.specs if s.name == name]
    text = httpx.get(f"http://{mesh.options.host}:{spec.metrics_port}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample
    )


def _paths(mesh: Mesh) -> dict[str, float]:
    text = httpx.get(f"{http_url(mesh)}/metrics", timeout=10).text
    return {
        s.labels["path"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pdmesh_gateway_prefill_paths_total"
    }


class Load:
    """`NUM_CLIENTS` threads sending greedy completions of PROMPTS in turn until stopped."""

    def __init__(self, mesh: Mesh) -> None:
        self.client = OpenAI(
            base_url=f"{http_url(mesh)}/v1", api_key="unused", max_retries=0, timeout=120
        )
        self.model = mesh.options.model_dir.name
        self.stop = threading.Event()
        self.results: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.pool = ThreadPoolExecutor(NUM_CLIENTS)
        self.futures = [self.pool.submit(self._client, i) for i in range(NUM_CLIENTS)]

    def _client(self, index: int) -> None:
        turn = index
        while not self.stop.is_set():
            prompt = PROMPTS[turn % len(PROMPTS)]
            turn += 1
            try:
                out = self.client.completions.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                self.results.append((prompt, out.choices[0].text))
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                self.errors.append(f"{type(e).__name__}: {e}")

    def finish(self) -> None:
        self.stop.set()
        for future in self.futures:
            future.result()
        self.pool.shutdown()


def test_a_rolling_update_under_load_has_no_error_and_no_cross_revision_handoff(
    rollout_mesh: Mesh, offline: dict[str, str]
) -> None:
    mesh = rollout_mesh
    before = _revisions(mesh)
    assert len(before) == 4 and len(set(before.values())) == 1, before
    old_revision = next(iter(before.values()))
    paths_before = _paths(mesh)
    load = Load(mesh)
    try:
        time.sleep(SETTLE_S)
        for name in ROLL_ORDER:
            replace_service(mesh, name, f"{name}-b", NEW_REVISION)
            time.sleep(SETTLE_S)
    finally:
        load.finish()
    after = _revisions(mesh)
    assert sorted(after) == sorted(f"{n}-b" for n in ROLL_ORDER), after
    assert len(set(after.values())) == 1 and old_revision not in after.values(), after

    assert load.errors == [], load.errors[:5]
    assert len(load.results) >= 40, len(load.results)
    wrong = [(p, text) for p, text in load.results if text != offline[p]]
    assert wrong == [], wrong[:3]

    # no prefill rank refused a target for its revision (the old ones' logs say so too)
    logs = "".join(p.read_text(errors="replace") for p in mesh.options.log_dir.glob("*.log"))
    assert "cross-revision hand-off refused" not in logs
    new_prefills = ("prefill-0-b", "prefill-1-b")
    for name in new_prefills:
        assert _metric(mesh, name, "pdmesh_handoff_revision_refusals_total") == 0
    # ... and the new revision's hand-offs ran between its own ranks (the prefix-aware choice may
    # send them all to one of its prefill ranks: the prompts repeat)
    pushed = sum(_metric(mesh, n, "pdmesh_kv_transfer_bytes_total") for n in new_prefills)
    assert pushed > 0
    paths = {k: v - paths_before.get(k, 0.0) for k, v in _paths(mesh).items()}
    assert paths.get("disagg", 0) > 0, paths
    print(f"rollout: {len(load.results)} requests, {len(load.errors)} errors, paths {paths}")
