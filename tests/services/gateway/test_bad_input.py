"""Hostile request bodies get the OpenAI error shape, never a 5xx, and the gateway keeps serving.

The app runs over an orchestrator with no ranks: every case here must be refused while parsing,
before any routing (a request that got through would answer 503 "no ready decode").
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.orchestrator import Orchestrator
from pdmesh_gateway.rest import create_app
from pdmesh_gateway.router import Router

MAX_BODY = 8192  # over int()'s 4300-digit limit, so that limit can be reached


def _post_all(tok, model, bodies: list[tuple[str, bytes]]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        orchestrator = Orchestrator(
            Router(), tok, metrics=GatewayMetrics(CollectorRegistry()), unroutable_wait_s=0.0
        )
        app = create_app(orchestrator, tok, model, CollectorRegistry(), max_body_bytes=MAX_BODY)
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                headers = {"Content-Type": "application/json"}
                return [
                    await client.post(path, content=body, headers=headers) for path, body in bodies
                ]
        finally:
            await orchestrator.close()

    return asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY + b'"}',
            413,
            "limit",
        ),
        ("/v1/completions", b"[" * 1500 + b"]" * 1500, 400, "nested too deeply"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "hi \\ud800 there"}', 400, "surrogate"),
        (
            "/v1/chat/completions",
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
            400,
            "surrogate",
        ),
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "hi", "top_k": 2147483648}',
            400,
            "top_k",
        ),
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "hi", "max_tokens": 4294967296}',
            400,
            "max_tokens",
        ),
        # an integer past int()'s digit limit: json.loads raised a bare ValueError (was a 500)
        (
            "/v1/completions",
            b'{"prompt": "hi", "seed": ' + b"9" * 4400 + b"}",
            400,
            "not valid JSON",
        ),
        # an integer past the float range where a number is due (was an OverflowError, a 500)
        (
            "/v1/completions",
            b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}",
            400,
            "finite",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "top_p": 1' + b"0" * 400 + b"}",
            400,
            "top_p",
        ),
        ("/v1/completions", b'{"prompt": "hi", "n": 2}', 400, "n=2 is not supported"),
    ],
)
def test_hostile_bodies_get_4xx_in_the_openai_shape(tok, model, path, body, status, needle) -> None:
    [response] = _post_all(tok, model, [(path, body)])
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_after_hostile_bodies_a_good_request_is_still_parsed(tok, model) -> None:
    good = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    responses = _post_all(tok, model, [("/v1/completions", b"[" * 1500), ("/v1/completions", good)])
    assert responses[0].status_code == 400
    assert responses[1].status_code == 503  # parsed fine; no decode rank in this mesh
    assert "decode" in responses[1].json()["error"]["message"]
