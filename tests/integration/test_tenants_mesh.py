"""Tenants on a real mesh (agg: one decode rank, real processes on loopback): a keys file with three
tenants, the token-rate cap held over a window (prompt + output tokens served), the concurrency cap
held (the gateway's own accounting, and no two of the capped tenant's
streams overlapping more than the cap), an over-cap burst answered 429 with Retry-After and the
OpenAI error body, the priority header accepted and clamped to the tenant's maximum."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from meshlib import http_url, start_mesh

KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
KEY_C = "sk-tenant-c-0123456789"
RATE = 120  # gamma's max_tokens_per_s
KEYS = {
    "keys": {
        KEY_A: {"tenant": "alpha", "max_priority": "default", "max_concurrency": 2},
        KEY_B: {"tenant": "beta", "max_concurrency": 1, "max_queued": 1},
        KEY_C: {"tenant": "gamma", "max_tokens_per_s": RATE},
    }
}


@pytest.fixture(scope="module")
def tenant_mesh(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    keys = root / "keys.json"
    keys.write_text(json.dumps(KEYS))
    mesh = start_mesh(
        tiny_model,
        root / "logs",
        "test-tenants",
        num_prefill=0,
        mode="agg",
        gateway_args=("--api-keys-file", str(keys)),
    )
    yield mesh
    mesh.stop()


def _headers(key: str, priority: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    return headers | ({"x-pdmesh-priority": priority} if priority else {})


BODY = {"prompt": "Hello there", "max_tokens": 24, "ignore_eos": True, "temperature": 0}


async def _timed_stream(client: httpx.AsyncClient, key: str) -> tuple[float, float]:
    """(first token chunk, [DONE]) times of one streaming completion."""
    first = None
    async with client.stream(
        "POST", "/v1/completions", json=BODY | {"stream": True}, headers=_headers(key)
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and first is None:
                first = time.monotonic()
    assert first is not None
    return first, time.monotonic()


def test_the_concurrency_cap_holds(tenant_mesh) -> None:
    async def main() -> list[tuple[float, float]]:
        async with httpx.AsyncClient(base_url=http_url(tenant_mesh), timeout=120) as client:
            return await asyncio.gather(*(_timed_stream(client, KEY_A) for _ in range(6)))

    spans = asyncio.run(main())
    # a request is granted only once one of the tenant's 2 ended: no 3 streams overlap
    for first, _ in spans:
        overlapping = sum(1 for f, d in spans if f <= first + 1e-3 and d > first + 5e-3)
        assert overlapping <= 2, spans
    mesh = httpx.get(f"{http_url(tenant_mesh)}/mesh", headers=_headers(KEY_A)).json()["tenants"]
    alpha = [r for r in mesh["classes"] if r["tenant"] == "alpha"]
    assert sum(r["admitted_requests"] for r in alpha) >= 6 and mesh["running"]["alpha"] == 0


def test_an_over_cap_burst_is_429_with_retry_after_and_the_openai_body(tenant_mesh) -> None:
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=http_url(tenant_mesh), timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post("/v1/completions", json=BODY, headers=_headers(KEY_B))
                    for _ in range(6)
                )
            )

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 2 and codes.count(429) >= 3 and set(codes) == {200, 429}, codes
    for r in (r for r in responses if r.status_code == 429):
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_tenant_full"
        assert set(error) == {"message", "type", "param", "code"}
    metrics = httpx.get(f"{http_url(tenant_mesh)}/metrics").text
    assert 'pdmesh_gateway_tenant_rejected_requests_total{class="default",' in metrics
    assert 'reason="tenant_full",tenant="beta"}' in metrics


def test_the_priority_header_is_accepted_and_clamped(tenant_mesh) -> None:
    url = http_url(tenant_mesh)
    ok = httpx.post(
        f"{url}/v1/completions", json=BODY, headers=_headers(KEY_A, "system"), timeout=120
    )
    assert ok.status_code == 200
    ok = httpx.post(
        f"{url}/v1/completions", json=BODY, headers=_headers(KEY_B, "batch"), timeout=120
    )
    assert ok.status_code == 200
    body_priority = BODY | {"priority": -10}  # vLLM's integer: interactive, beta may ask for it
    assert (
        httpx.post(
            f"{url}/v1/completions", json=body_priority, headers=_headers(KEY_B), timeout=120
        ).status_code
        == 200
    )
    bad = httpx.post(f"{url}/v1/completions", json=BODY, headers=_headers(KEY_A, "urgent"))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert (
        httpx.post(
            f"{url}/v1/completions", json=BODY, headers=_headers("sk-nobody-000000")
        ).status_code
        == 401
    )
    rows = httpx.get(f"{url}/mesh", headers=_headers(KEY_B)).json()["tenants"]["classes"]
    classes = {(r["tenant"], r["class"]) for r in rows}
    assert ("alpha", "system") not in classes and ("alpha", "default") in classes  # clamped
    assert {("beta", "batch"), ("beta", "interactive")} <= classes


def test_the_token_rate_cap_holds_over_a_window(tenant_mesh) -> None:
    """8 closed loops of gamma for WINDOW_S: the tokens served (prompt + output of requests that
    ended in the window) stay within the bucket's bound, rate x (T + 1) plus what the requests
    running when it went into debt were charged past 0 (at most one request per loop)."""
    window_s, loops = 8.0, 8
    served: list[int] = []

    async def loop(client: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            response = await client.post("/v1/completions", json=BODY, headers=_headers(KEY_C))
            assert response.status_code == 200, response.text
            if time.monotonic() <= until:
                served.append(response.json()["usage"]["total_tokens"])

    async def main() -> float:
        async with httpx.AsyncClient(base_url=http_url(tenant_mesh), timeout=120) as client:
            start = time.monotonic()
            await asyncio.gather(*(loop(client, start + window_s) for _ in range(loops)))
            return start

    asyncio.run(main())
    assert served, "no request of the rate-limited tenant ended in the window"
    bound = RATE * (window_s + 1) + loops * max(served)
    assert sum(served) <= bound, (sum(served), bound)
    print(f"\ngamma: {sum(served)} tokens in {window_s:g} s (cap {RATE}/s, bound {bound})")
