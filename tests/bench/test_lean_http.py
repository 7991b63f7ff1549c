"""The load generator's lean HTTP/1.1 client against a real uvicorn server on loopback: a chunked
SSE stream read line by line, a sized 429 read whole with its headers, keep-alive reuse of a
connection whose answer was read to the end, and a closed one replaced."""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdmesh_bench.lean_http import LeanClient, LeanError


def _app(ports: list[int]) -> Starlette:
    async def stream(request: Request) -> Response:
        ports.append(request.client.port if request.client else -1)
        body = await request.json()

        async def events():
            for i in range(body["n"]):
                yield f"data: {json.dumps({'i': i, 'pad': 'x' * 5000})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def full(request: Request) -> Response:
        ports.append(request.client.port if request.client else -1)
        body = await request.json()
        return JSONResponse({"echo": body}, status_code=429, headers={"Retry-After": "2"})

    return Starlette(
        routes=[Route("/s", stream, methods=["POST"]), Route("/f", full, methods=["POST"])]
    )


def test_streams_and_sized_answers_over_reused_connections() -> None:
    async def main() -> None:
        ports: list[int] = []
        server = uvicorn.Server(
            uvicorn.Config(_app(ports), host="127.0.0.1", port=0, log_level="error")
        )
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        try:
            async with LeanClient(url, max_connections=4) as client:
                for n in (3, 40):
                    async with client.stream("POST", f"{url}/s", json={"n": n}) as resp:
                        lines = [line async for line in resp.aiter_lines() if line]
                    assert resp.status_code == 200 and lines[-1] == "data: [DONE]"
                    assert [json.loads(x[6:])["i"] for x in lines[:-1]] == list(range(n))
                async with client.stream("POST", f"{url}/f", json={"a": [1, 2]}) as resp:
                    body = json.loads(await resp.aread())
                assert resp.status_code == 429 and resp.headers["retry-after"] == "2"
                assert body == {"echo": {"a": [1, 2]}}
                assert len(set(ports)) == 1  # one keep-alive connection served all three
                async with client.stream("POST", f"{url}/s", json={"n": 5}) as resp:
                    pass  # left unread: this connection is not reused
                async with client.stream("POST", f"{url}/f", json={}) as resp:
                    await resp.aread()
                assert len(set(ports)) == 2
            with pytest.raises(LeanError):
                async with LeanClient("http://127.0.0.1:1", 1) as dead:
                    async with dead.stream("POST", "http://127.0.0.1:1/f", json={}):
                        pass
        finally:
            server.should_exit = True
            await task

    asyncio.run(asyncio.wait_for(main(), 30))
