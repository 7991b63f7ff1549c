"""A lean HTTP/1.1 client for load generation: POST a JSON body, read the answer whole or line by
line (SSE), over a pool of keep-alive connections to one host.

Why: `pdmesh bench overload` sends 100 requests a second on the machine that runs the mesh, and
every CPU cycle the client spends is taken from the engines it measures. httpx costs about a
millisecond of CPU a request; this costs a fraction of that. It speaks just what the gateway
(uvicorn/h11) answers: a status line, headers, then a `Content-Length` body or a chunked one.

The surface mirrors the part of httpx the benchmarks use (`stream("POST", url, json=...)` as an
async context manager whose response has `status_code`, `headers`, `aread()`, `aiter_lines()`), so
the same sending code runs on either. Errors are `LeanError` (an `httpx.TransportError`). A
connection goes back to the pool only when its answer was read to the end and the server keeps it
open; any other goes closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx

MAX_HEADER_LINES = 100


class LeanError(httpx.TransportError):
    """The connection failed or the answer was not HTTP/1.1 as expected."""


class LeanResponse:
    """One answer; its body is read by `aread()` or `aiter_lines()`, once."""

    def __init__(self, reader: asyncio.StreamReader, status_code: int, headers: dict[str, str]):
        self.status_code, self.headers = status_code, headers  # header names lower-cased
        self._reader = reader
        self.is_complete = False  # the whole body was read: the connection may be reused

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self._chunks()])

    async def aiter_lines(self) -> AsyncIterator[str]:
        buffer = b""
        async for chunk in self._chunks():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if buffer:
            yield buffer.rstrip(b"\r").decode()

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readline()).split(b";")[0], 16):
                yield (await reader.readexactly(size + 2))[:-2]
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                pass
        else:
            size = int(self.headers.get("content-length", "0"))
            if size:
                yield await reader.readexactly(size)
        self.is_complete = True


class LeanClient:
    """Keep-alive connections to the host of `url`, at most `max_connections` open at once."""

    def __init__(self, url: str, max_connections: int) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the lean client speaks plain http to one host, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def __aenter__(self) -> LeanClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    @contextlib.asynccontextmanager
    async def stream(
        self, method: str, url: str, *, json: Any = None
    ) -> AsyncIterator[LeanResponse]:
        """`method` `url` (this client's host) with `json` as the body; the response's body is
        read inside the block."""
        path = urlsplit(url).path or "/"
        async with self._slots:
            reader, writer = await self._connection()
            response: LeanResponse | None = None
            try:
                writer.write(_request(method, path, self.host, json))
                response = await _read_head(reader)
                yield response
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                raise LeanError(f"{type(e).__name__}: {e}") from e
            finally:
                reusable = response is not None and response.is_complete
                if reusable and response.headers.get("connection", "").lower() != "close":
                    self._idle.append((reader, writer))
                else:
                    writer.close()

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        try:
            return await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            raise LeanError(f"cannot connect to {self.host}:{self.port}: {e}") from e


def _request(method: str, path: str, host: str, body: Any) -> bytes:
    payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def _read_head(reader: asyncio.StreamReader) -> LeanResponse:
    status = (await reader.readline()).split(None, 2)
    if len(status) < 2 or not status[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {b' '.join(status)!r}")
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return LeanResponse(reader, int(status[1]), headers)
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    raise ValueError(f"more than {MAX_HEADER_LINES} header lines")
