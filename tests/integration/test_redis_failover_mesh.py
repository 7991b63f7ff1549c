"""A mesh on Redis Sentinel survives the loss of its Redis primary under load.

The mesh (prefill 1, decode 1, the tiny model) runs with `--redis-url redis+sentinel://...` on a
primary, a replica and one sentinel (quorum 1: enough on loopback). While a stream of greedy
completions runs, the primary is killed with SIGKILL (it stays dead). Then:

- every request completes with the offline engine's text: the client may retry (the OpenAI SDK
  retries 5xx/429 and connection errors; the attempts are counted), none is lost;
- the registry on the promoted replica lists every instance again, each with a heartbeat written
  after the promotion, and the NIXL agents' metadata is there;
- no KV block is held afterwards and both pools pass their integrity check.

Reported (as properties, and printed): the failover (kill → promoted replica takes writes), the
registry's recovery (kill → every instance re-published on the new primary), the clients' recovery
(first failed attempt → first success after it; 0 when no attempt failed) and the retries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from meshlib import http_url, start_mesh
from openai import OpenAI
from redis_sentinel import SentinelDeployment
from test_mesh import _assert_no_leaks, _model_name

from pdmesh.launcher import Mesh
from pdmesh_service.redis_client import connect_sync
from pdmesh_service.registry import InstanceInfo, namespace

DEPLOYMENT = "redis-failover"
NUM_REQUESTS, MAX_TOKENS, CONCURRENCY = 40, 12, 6
KILL_AFTER = 6  # completed requests before the primary dies
PROMPTS = [f"Request {i}: the failover of word{i} under load " * 3 for i in range(NUM_REQUESTS)]
RECOVER_BOUND_S = 60.0


@pytest.fixture(scope="module")
def sentinel_redis() -> Iterator[SentinelDeployment]:
    with SentinelDeployment(down_after_ms=1000, failover_timeout_ms=5000) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def mesh(
    tiny_model: Path, sentinel_redis: SentinelDeployment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    started = start_mesh(
        tiny_model,
        tmp_path_factory.mktemp("logs-redis-failover"),
        DEPLOYMENT,
        redis_url=sentinel_redis.url,
    )
    try:
        yield started
    finally:
        started.stop()


def _registry(url: str) -> dict[str, InstanceInfo]:
    """Instance id → entry, read from the current primary."""
    client = connect_sync(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        keys = list(client.scan_iter(match=f"{namespace(DEPLOYMENT)}:instance:*", count=200))
        found = [InstanceInfo.from_json(v) for v in client.mget(keys) if v] if keys else []
        return {i.instance_id: i for i in found}
    finally:
        client.close()


def _agent_keys(url: str) -> set[bytes]:
    client = connect_sync(url, socket_timeout=2.0, socket_connect_timeout=2.0)
    try:
        return set(client.scan_iter(match=f"{namespace(DEPLOYMENT)}:agent:*", count=200))
    finally:
        client.close()


class Attempts:
    """Every HTTP attempt the SDK makes (retries included): (time, status; 0 for no response)."""

    def __init__(self) -> None:
        self.log: list[tuple[float, int]] = []
        self.lock = threading.Lock()

    def on_response(self, response: httpx.Response) -> None:
        with self.lock:
            self.log.append((time.monotonic(), response.status_code))

    def failed(self) -> list[float]:
        return [t for t, status in self.log if status >= 400]

    def recovery_s(self) -> float:
        """First failed attempt → first success after it (0: none failed)."""
        failed = self.failed()
        if not failed:
            return 0.0
        return min(t for t, s in self.log if s == 200 and t > failed[0]) - failed[0]


def _wait_registry_back(
    url: str, before: dict[str, InstanceInfo], promoted_ms: int, timeout_s: float
) -> dict[str, InstanceInfo]:
    """The registry once it lists every instance of `before`, each heartbeated after
    `promoted_ms` (wall clock ms), or the last read at the timeout."""
    deadline, now = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            now = _registry(url)
        except (OSError, redis.RedisError):  # mid-failover: no primary yet (MasterNotFoundError)
            now = {}
        fresh = {k for k, v in now.items() if v.updated_ms > promoted_ms}
        if set(before) <= fresh:
            return now
        time.sleep(0.1)
    return now


def test_the_mesh_survives_kill_9_of_the_redis_primary(
    mesh: Mesh, sentinel_redis: SentinelDeployment, tiny_model: Path, record_property
) -> None:
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(tiny_model, num_blocks=1024, block_size=8)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = [o.text for o in llm.generate(PROMPTS, params)]
    before, agents_before = _registry(sentinel_redis.url), _agent_keys(sentinel_redis.url)
    assert {i.role for i in before.values()} >= {"gateway", "kvstore", "prefill", "decode"}, before

    attempts = Attempts()
    http = httpx.Client(event_hooks={"response": [attempts.on_response]}, timeout=120)
    client = OpenAI(
        base_url=f"{http_url(mesh)}/v1",
        api_key="unused",
        max_retries=10,
        timeout=120,
        http_client=http,
    )
    done = threading.Semaphore(0)

    def complete(prompt: str) -> str:
        try:
            out = client.completions.create(
                model=_model_name(mesh),
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return out.choices[0].text
        finally:
            done.release()

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(complete, p) for p in PROMPTS]
        for _ in range(KILL_AFTER):
            assert done.acquire(timeout=120), "the mesh served nothing before the kill"
        old = sentinel_redis.kill_primary()
        killed_at, killed_ms = time.monotonic(), int(time.time() * 1000)
        sentinel_redis.wait_failover(old, timeout_s=RECOVER_BOUND_S)
        failover_s, promoted_ms = time.monotonic() - killed_at, int(time.time() * 1000)
        num_done_at_failover = sum(f.done() for f in futures)
        texts = [f.result(timeout=300) for f in futures]
    http.close()

    assert texts == expected
    assert num_done_at_failover < NUM_REQUESTS, "the stream ended before the failover"
    after = _wait_registry_back(sentinel_redis.url, before, promoted_ms, RECOVER_BOUND_S)
    # kill → the heartbeat seen on the new primary, per instance (the latest: the registry's)
    lag_s = {k: round((i.updated_ms - killed_ms) / 1000, 2) for k, i in sorted(after.items())}
    assert set(after) == set(before), (sorted(before), sorted(after))
    assert all(i.updated_ms > promoted_ms for i in after.values()), after
    assert _agent_keys(sentinel_redis.url) >= agents_before
    _assert_no_leaks(mesh)

    retries = len(attempts.log) - NUM_REQUESTS
    figures = {
        "failover_s": round(failover_s, 2),
        "registry_recover_s": max(lag_s.values(), default=-1.0),
        "registry_lag_s": lag_s,
        "client_recover_s": round(attempts.recovery_s(), 2),
        "failed_attempts": len(attempts.failed()),
        "retries": retries,
        "statuses": sorted({s for _, s in attempts.log}),
    }
    for name, value in figures.items():
        record_property(name, value)
    print(f"Redis primary killed under load: {figures}")
    assert figures["client_recover_s"] < RECOVER_BOUND_S
