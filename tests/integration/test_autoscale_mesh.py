"""Autoscaling end to end: a mesh as `pdmesh up --autoscale prefill=1..2,decode=1..1` runs it (the
launcher's processes, a real Redis, loopback, the embedded coder-v4 model) under a quiet → burst →
quiet load of streaming completions. The prefill pool grows to 2 during the burst (a second prefill
process starts and serves), shrinks back to 1 once the cooldown passed (the surplus worker drains
and exits; the supervisor does not restart it), the desired count changes at most twice, and every
request completes: none lost, none errored, those in flight while the worker drained included."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from meshlib import http_url, start_mesh, with_options, worker_args

from pdmesh.launcher import Mesh
from pdmesh_engine.checkpoint import embedded_model_dir
from pdmesh_gateway.autoscale import DESIRED_REPLICAS_METRIC
from pdmesh_service.scaling import PoolBounds

MODEL = embedded_model_dir("coder-v4")
WORKER_ARGS = with_options((*worker_args(64), "--dtype", "float32"), {"--drain-s": "20"})
SETTINGS = (
    *("--autoscale-interval-s", "0.5", "--autoscale-window-s", "3"),
    *("--autoscale-cooldown-s", "6", "--autoscale-up-cooldown-s", "3"),
)
PROMPT = "def fibonacci(n):\n    " * 12
BURST_CLIENTS, QUIET_PAUSE_S = 8, 0.3


@dataclass(frozen=True)
class Outcome:
    started: float  # time.monotonic
    ended: float
    error: str  # "": finished with a finish_reason and [DONE]


class Load:
    """Streaming completions from a thread: `clients` loops, each sending one request after the
    other (quiet: one client pausing `pause_s` between requests)."""

    def __init__(self, url: str) -> None:
        self.url, self.clients, self.pause_s = f"{url}/v1/completions", 1, QUIET_PAUSE_S
        self.num_sent = 0
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "the load did not stop"

    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(self._loop(client, i) for i in range(BURST_CLIENTS)))

    async def _loop(self, client: httpx.AsyncClient, index: int) -> None:
        while not self._stop.is_set():
            if index >= self.clients:
                await asyncio.sleep(0.05)
                continue
            self.num_sent += 1
            self.outcomes.append(await self._one(client))
            await asyncio.sleep(self.pause_s)

    async def _one(self, client: httpx.AsyncClient) -> Outcome:
        started, error, finish = time.monotonic(), "", None
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
        try:
            async with client.stream("POST", self.url, json=body) as response:
                if response.status_code != 200:
                    return Outcome(started, time.monotonic(), f"HTTP {response.status_code}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = json.dumps(event["error"])
                    finish = event["choices"][0].get("finish_reason") or finish
        except (httpx.HTTPError, ValueError, LookupError) as e:  # ValueError: bad JSON
            error = f"{type(e).__name__}: {e}"
        if not error and finish is None:
            error = "the stream ended without a finish_reason"
        return Outcome(started, time.monotonic(), error)


def _desired(url: str) -> int | None:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{DESIRED_REPLICAS_METRIC}{{pool="prefill"}}'):
            return int(float(line.split()[-1]))
    return None


def _wait_event(mesh: Mesh, action: str, timeout_s: float, series: list[int], url: str) -> float:
    """Until the scaler recorded `action` for the prefill pool (its time), sampling the desired
    count meanwhile."""
    assert mesh.scaler is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        series.append(_desired(url) or 0)
        found = [e for e in mesh.scaler.events if e.action == action and e.pool == "prefill"]
        if found:
            return found[0].at
        time.sleep(0.5)
    raise AssertionError(f"no {action} event within {timeout_s:g}s: {mesh.scaler.events}")


@pytest.fixture
def autoscaled_mesh(tmp_path: Path):
    mesh = start_mesh(
        MODEL,
        tmp_path / "logs",
        "test-autoscale",
        autoscale={"prefill": PoolBounds(1, 2), "decode": PoolBounds(1, 1)},
        max_prefill_inflight=1,
        worker_args=WORKER_ARGS,
        gateway_args=SETTINGS,
    )
    mesh.start_supervisor()
    yield mesh
    mesh.stop()


def test_the_prefill_pool_follows_a_burst_without_losing_a_request(autoscaled_mesh: Mesh) -> None:
    mesh, url = autoscaled_mesh, http_url(autoscaled_mesh)
    assert mesh.scaler is not None and mesh.names("prefill") == ["prefill-0"]
    series: list[int] = []
    load = Load(url)
    load.start()
    try:
        for _ in range(10):  # quiet: nothing to scale
            series.append(_desired(url) or 0)
            time.sleep(0.5)
        assert set(series) == {1} and not mesh.scaler.events, mesh.scaler.events
        load.clients, load.pause_s = BURST_CLIENTS, 0.0
        _wait_event(mesh, "serving", 150, series, url)
        assert mesh.names("prefill") == ["prefill-0", "prefill-1"]
        time.sleep(3)  # the burst on two prefill ranks
        load.clients, load.pause_s = 1, QUIET_PAUSE_S
        drained_at = _wait_event(mesh, "drain", 60, series, url)
        stopped_at = _wait_event(mesh, "stopped", 60, series, url)
        for _ in range(4):
            time.sleep(0.5)
            series.append(_desired(url) or 0)
    finally:
        load.stop()
    changes = sum(a != b for a, b in zip(series, series[1:], strict=False))
    assert max(series) == 2 and series[-1] == 1 and changes <= 2, series
    actions = [(e.action, e.name) for e in mesh.scaler.events]
    assert actions == [
        ("start", "prefill-1"),
        ("serving", "prefill-1"),
        ("drain", "prefill-1"),
        ("stopped", "prefill-1"),
    ]
    assert mesh.names("prefill") == ["prefill-0"] and "prefill-1" not in mesh.processes
    assert mesh.restarts == {}  # the drained worker was not restarted, nothing died
    errors = [o.error for o in load.outcomes if o.error]
    assert load.num_sent == len(load.outcomes) > 50  # every request sent has its outcome
    assert not errors, errors[:5]
    during_drain = [o for o in load.outcomes if o.started < stopped_at and o.ended > drained_at]
    assert during_drain, "no request was in flight while prefill-1 drained"
