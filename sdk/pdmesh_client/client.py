"""Synchronous client of a pdmesh gateway (gRPC `pdmesh.gateway.v1.Generate`).

    with Client("127.0.0.1:50051") as client:
        print(client.generate("Hello", max_tokens=16).text)
        for chunk in client.stream("Hello", max_tokens=16):
            print(chunk.text, end="", flush=True)

Calls that fail UNAVAILABLE / RESOURCE_EXHAUSTED are retried with exponential backoff (up to
`max_retries` more times); a stream is retried only while no chunk has been received.

A gateway started with --api-key wants it on every call: `Client(address, api_key=KEY)` sends it
(metadata `authorization: Bearer KEY`); without `api_key=` the client sends $PDMESH_API_KEY when
that is set. A missing or wrong key fails with `Unauthenticated`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from pdmesh_client.types import (
    Chunk,
    Completion,
    auth_metadata,
    build_request,
    chunk_from_proto,
    completion_from_proto,
    error_from_rpc,
    is_retryable,
)
from pdmesh_proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc

T = TypeVar("T")
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def retry_policy(max_retries: int, backoff_s: float) -> dict[str, Any]:
    """tenacity arguments shared by both clients."""
    return dict(
        stop=stop_after_attempt(max_retries + 1),
        wait=wait_exponential(multiplier=backoff_s, max=5.0),
        retry=retry_if_exception(is_retryable),
        reraise=True,
    )


class Client:
    def __init__(
        self,
        address: str,
        timeout: float | None = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.1,
        api_key: str | None = None,
    ) -> None:
        """`timeout`: seconds per call (a stream's whole duration); None waits forever. `api_key`:
        the gateway's API key (None: $PDMESH_API_KEY, if set)."""
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.address, self.timeout, self.max_retries, self.backoff_s = (
            address,
            timeout,
            max_retries,
            backoff_s,
        )
        self._metadata = auth_metadata(api_key)
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = gateway_pb2_grpc.GenerateStub(self._channel)

    def _retrying(self, fn: Callable[[], T]) -> T:
        for attempt in Retrying(**retry_policy(self.max_retries, self.backoff_s)):
            with attempt:
                try:
                    return fn()
                except grpc.RpcError as e:
                    raise error_from_rpc(e) from None
        raise AssertionError("unreachable")  # pragma: no cover - Retrying reraises

    def generate(
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
        """A whole completion. Unset (None) settings take the server's defaults; `stop` strings are
        not returned; `logprobs=n` returns each token's logprob and n alternatives."""
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
        reply = self._retrying(
            lambda: self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        )
        return completion_from_proto(reply)

    def stream(
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
    ) -> Iterator[Chunk]:
        """Chunks as they are generated (same settings as `generate`). Closing the iterator early
        cancels the request on the server."""
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

        def open_stream() -> tuple[Any, gateway_pb2.GenerateChunk | None]:
            call = self._stub.GenerateStream(request, timeout=self.timeout, metadata=self._metadata)
            return call, next(call, None)

        call, first = self._retrying(open_stream)
        try:
            if first is None:
                return
            yield chunk_from_proto(first)
            for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            call.cancel()

    def models(self) -> list[str]:
        reply = self._retrying(
            lambda: self._stub.ListModels(
                gateway_pb2.ListModelsRequest(), timeout=self.timeout, metadata=self._metadata
            )
        )
        return list(reply.models)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
