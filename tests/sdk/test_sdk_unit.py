"""The client SDK against a small fake gateway servicer served by real gRPC on loopback."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from pdmesh_client import (
    AsyncClient,
    Chunk,
    Client,
    Completion,
    GenerateError,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
    TokenLogprob,
    Usage,
)
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc

WORDS = ["Hello", " there", ",", " mesh", "!"]


class FakeGateway(gateway_pb2_grpc.GenerateServicer):
    """Echoes WORDS as tokens 10, 11, ...; the prompt text picks a behaviour:
    "flaky" fails UNAVAILABLE on every other attempt, "down" always, "bad" is INVALID_ARGUMENT,
    "midway" streams one chunk then fails UNAVAILABLE, "slow" streams slowly (to be cancelled)."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.cancelled = threading.Event()

    def _check(self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        key = request.text or "ids"
        self.attempts[key] += 1
        if request.model not in ("", "tiny"):
            context.abort(grpc.StatusCode.NOT_FOUND, f"The model `{request.model}` does not exist.")
        if key == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is bad")
        if key == "down" or (key == "flaky" and self.attempts[key] % 2 == 1):
            context.abort(grpc.StatusCode.UNAVAILABLE, "no ready decode instance")

    def _words(self, request: gateway_pb2.GenerateRequest) -> list[str]:
        return WORDS[: request.sampling.max_tokens]

    @staticmethod
    def _logprobs(n: int, start: int = 0) -> list[common_pb2.TokenLogprob]:
        return [
            common_pb2.TokenLogprob(
                token_id=10 + start + i,
                logprob=-0.5,
                top=[common_pb2.TopLogprob(token_id=3, logprob=-1.5)],
            )
            for i in range(n)
        ]

    def Generate(self, request, context):
        self._check(request, context)
        words = self._words(request)
        return gateway_pb2.GenerateResponse(
            request_id=request.request_id or "gen-1",
            token_ids=[10 + i for i in range(len(words))],
            text="".join(words),
            logprobs=self._logprobs(len(words)) if request.sampling.HasField("logprobs") else [],
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=len(words)),
        )

    def GenerateStream(self, request, context) -> Iterator[gateway_pb2.GenerateChunk]:
        self._check(request, context)
        context.add_callback(self.cancelled.set)
        words = self._words(request)
        for i, word in enumerate(words):
            if request.text == "midway" and i == 1:
                context.abort(grpc.StatusCode.UNAVAILABLE, "decode went away")
            if request.text == "slow":
                time.sleep(0.05)
            last = i == len(words) - 1
            yield gateway_pb2.GenerateChunk(
                request_id="gen-2",
                token_ids=[10 + i],
                text=word,
                finish_reason=common_pb2.FINISH_REASON_STOP
                if last
                else common_pb2.FINISH_REASON_UNSPECIFIED,
                stop_reason="!" if last else "",
                usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=i + 1, cached_tokens=1)
                if last
                else None,
            )

    def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=["tiny"])


@pytest.fixture()
def gateway() -> Iterator[tuple[FakeGateway, str]]:
    fake = FakeGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    gateway_pb2_grpc.add_GenerateServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(None)


def test_generate_returns_a_typed_completion_and_sends_the_settings(gateway) -> None:
    fake, address = gateway
    with Client(address, timeout=10) as client:
        result = client.generate(
            "Hi",
            max_tokens=3,
            temperature=0.0,
            top_k=5,
            seed=7,
            stop=["!"],
            stop_token_ids=[2],
            logprobs=1,
            request_id="mine",
        )
        by_ids = client.generate([1, 2, 3], max_tokens=1)
        assert client.models() == ["tiny"]
    assert result == Completion(
        "mine",
        "Hello there,",
        (10, 11, 12),
        "length",
        Usage(2, 3),
        tuple(TokenLogprob(10 + i, -0.5, ((3, -1.5),)) for i in range(3)),
        None,
    )
    assert result.usage.total_tokens == 5 and by_ids.text == "Hello" and by_ids.logprobs == ()
    sent = fake.requests[0]
    assert (
        sent.text,
        sent.request_id,
        sent.sampling.max_tokens,
        sent.sampling.top_k,
        sent.sampling.seed,
    ) == ("Hi", "mine", 3, 5, 7)
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0
    assert list(sent.sampling.stop) == ["!"] and list(sent.sampling.stop_token_ids) == [2]
    assert not fake.requests[1].sampling.HasField("temperature")  # unset: the server's default
    assert list(fake.requests[1].token_ids.ids) == [1, 2, 3]


def test_stream_yields_chunks_with_the_finish_on_the_last(gateway) -> None:
    _, address = gateway
    with Client(address, timeout=10) as client:
        chunks = list(client.stream("Hi", max_tokens=5))
    assert "".join(c.text for c in chunks) == "".join(WORDS) and [c.token_ids for c in chunks][
        0
    ] == (10,)
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    assert chunks[-1] == Chunk("gen-2", "!", (14,), (), "stop", "!", Usage(2, 5, 1))


@pytest.mark.parametrize(
    "prompt,model,error,code",
    [
        ("bad", "", InvalidRequest, "INVALID_ARGUMENT"),
        ("Hi", "nope", ModelNotFound, "NOT_FOUND"),
        ("down", "", ServiceUnavailable, "UNAVAILABLE"),
    ],
)
def test_errors_are_mapped_to_typed_exceptions(
    gateway, prompt: str, model: str, error: type, code: str
) -> None:
    fake, address = gateway
    with Client(address, timeout=10, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(error) as info:
            client.generate(prompt, model=model)
    assert isinstance(info.value, GenerateError) and info.value.code == code and info.value.message
    # only UNAVAILABLE is retried
    assert fake.attempts[prompt] == (3 if code == "UNAVAILABLE" else 1)


def test_unary_call_is_retried_after_unavailable(gateway) -> None:
    fake, address = gateway
    with Client(address, timeout=10, backoff_s=0.01) as client:
        assert client.generate("flaky", max_tokens=2).text == "Hello there"
        assert fake.attempts["flaky"] == 2
        with pytest.raises(ServiceUnavailable):
            with Client(address, max_retries=0) as once:
                once.generate("flaky")  # attempt 3 fails and nothing retries it


def test_stream_retries_only_before_the_first_chunk(gateway) -> None:
    fake, address = gateway
    with Client(address, timeout=10, backoff_s=0.01) as client:
        assert "".join(c.text for c in client.stream("flaky")) == "".join(WORDS)
        assert fake.attempts["flaky"] == 2
        received = []
        with pytest.raises(ServiceUnavailable):
            for chunk in client.stream("midway"):
                received.append(chunk.text)
    assert received == ["Hello"] and fake.attempts["midway"] == 1


def test_closing_a_stream_early_cancels_the_call(gateway) -> None:
    fake, address = gateway
    with Client(address, timeout=10) as client:
        stream = client.stream("slow", max_tokens=5)
        assert next(stream).text == "Hello"
        stream.close()
        assert fake.cancelled.wait(5.0)


def test_async_client_has_the_same_api(gateway) -> None:
    fake, address = gateway

    async def main() -> None:
        async with AsyncClient(address, timeout=10, backoff_s=0.01) as client:
            result = await client.generate("flaky", max_tokens=2, logprobs=0)
            chunks = [c async for c in client.stream("Hi", max_tokens=5)]
            models = await client.models()
            with pytest.raises(InvalidRequest):
                await client.generate("bad")
            received = []
            with pytest.raises(ServiceUnavailable):
                async for chunk in client.stream("midway"):
                    received.append(chunk.text)
        assert (
            result.text == "Hello there"
            and len(result.logprobs) == 2
            and fake.attempts["flaky"] == 2
        )
        assert chunks[-1].finish_reason == "stop" and "".join(c.text for c in chunks) == "".join(
            WORDS
        )
        assert models == ["tiny"] and received == ["Hello"]

    asyncio.run(asyncio.wait_for(main(), 30))


def test_finish_reasons_and_sampling_fields_come_from_the_proto() -> None:
    from pdmesh_client.types import FINISH_REASONS, build_request, sampling_pb

    numbers = {number for _, number in common_pb2.FinishReason.items()}
    assert set(FINISH_REASONS) == numbers - {common_pb2.FINISH_REASON_UNSPECIFIED}
    assert FINISH_REASONS[common_pb2.FINISH_REASON_ABORT] == "abort" and set(
        FINISH_REASONS.values()
    ) == {"stop", "length", "abort"}
    pb = sampling_pb(
        {name: None for name in (f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields)}
    )
    assert pb == common_pb2.SamplingParams()  # every field is known; None leaves it unset
    with pytest.raises(ValueError, match="unknown sampling settings"):
        sampling_pb({"temprature": 0.5})
    request = build_request("Hi", max_tokens=3, stop="!", seed=5, stop_token_ids=[2])
    sampling = request.sampling
    assert (sampling.max_tokens, list(sampling.stop), sampling.seed) == (3, ["!"], 5)
    assert list(sampling.stop_token_ids) == [2]
    assert not sampling.HasField("temperature") and not sampling.HasField("logprobs")
