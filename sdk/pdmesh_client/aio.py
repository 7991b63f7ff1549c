"""asyncio client of a pdmesh gateway; the same API as `Client`, awaited.

async with AsyncClient("127.0.0.1:50051") as client:
    completion = await client.generate("Hello", max_tokens=16)
    async for chunk in client.stream("Hello", max_tokens=16):
        print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from tenacity import AsyncRetrying

from pdmesh_client.client import CHANNEL_OPTIONS, retry_policy
from pdmesh_client.types import (
    Chunk,
    Completion,
    auth_metadata,
    build_request,
    chunk_from_proto,
    completion_from_proto,
    error_from_rpc,
)
from pdmesh_proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc

T = TypeVar("T")


class AsyncClient:
    def __init__(
        self,
        address: str,
        timeout: float | None = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.1,
        api_key: str | None = None,
    ) -> None:
        """Settings as `Client`'s (`api_key` None: $PDMESH_API_KEY, if set)."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.address, self.timeout, self.max_retries, self.backoff_s = (
            address,
            timeout,
            max_retries,
            backoff_s,
        )
        self._metadata = auth_metadata(api_key)
        self._channel: grpc.aio.Channel | None = None  # made on first use, inside the running loop
        self._stub_: gateway_pb2_grpc.GenerateStub | None = None

    @property
    def _stub(self) -> gateway_pb2_grpc.GenerateStub:
        if self._stub_ is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub_ = gateway_pb2_grpc.GenerateStub(self._channel)
        return self._stub_

    async def _retrying(self, fn: Callable[[], Awaitable[T]]) -> T:
        async for attempt in AsyncRetrying(**retry_policy(self.max_retries, self.backoff_s)):
            with attempt:
                try:
                    return await fn()
                except grpc.RpcError as e:
                    raise error_from_rpc(e) from None
        raise AssertionError("unreachable")  # pragma: no cover - AsyncRetrying reraises

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 16,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool | None = None,
        min_tokens: int | None = None,
        model: str = "",
        request_id: str = "",
    ) -> Completion:
        """A whole completion (settings as `Client.generate`)."""
        request = build_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            model=model,
            request_id=request_id,
        )
        reply = await self._retrying(
            lambda: self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        )
        return completion_from_proto(reply)

    async def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 16,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        logprobs: int | None = None,
        ignore_eos: bool | None = None,
        min_tokens: int | None = None,
        model: str = "",
        request_id: str = "",
    ) -> AsyncIterator[Chunk]:
        """Chunks as they are generated; closing the iterator early cancels the request."""
        request = build_request(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            min_tokens=min_tokens,
            model=model,
            request_id=request_id,
        )

        async def open_stream() -> tuple[Any, Any]:
            call = self._stub.GenerateStream(request, timeout=self.timeout, metadata=self._metadata)
            return call, await call.read()

        call, msg = await self._retrying(open_stream)
        try:
            while msg is not grpc.aio.EOF:
                yield chunk_from_proto(msg)
                msg = await call.read()
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            call.cancel()

    async def models(self) -> list[str]:
        reply = await self._retrying(
            lambda: self._stub.ListModels(
                gateway_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self._metadata
            )
        )
        return list(reply.models)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stub_ = None, None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
