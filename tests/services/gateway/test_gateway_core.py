"""Gateway: request validation, OpenAI response shapes, routing policy, stop strings, and one
request end to end through the orchestrator and the REST app over fake decode/prefill workers
(loopback gRPC)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdmesh_engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pdmesh_gateway.core import (
    GenerationEvent,
    TextStream,
    TokenLogprob,
    Usage,
    build_request,
    fold,
)
from pdmesh_gateway.openai_api import (
    Shaper,
    error_body,
    models_response,
    parse_chat,
    parse_completion,
)
from pdmesh_gateway.orchestrator import GatewayMetrics, Orchestrator
from pdmesh_gateway.rest import create_app
from pdmesh_gateway.router import NoInstance, Router
from pdmesh_gateway.server import _start_http
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdmesh_service.errors import InvalidArgument, NotFound, Unavailable
from pdmesh_service.registry import InstanceInfo, Load

CONTEXT = 64
MISSING = object()
SCRIPT_TEXT = "Hello world. The mesh routes every request to a decode rank."


def _error(fn, *args) -> Any:
    with pytest.raises((InvalidArgument, NotFound)) as info:
        fn(*args)
    return info.value


# ----- validation ------------------------------------------------------------------------------

COMPLETION_ERRORS = [
    ({"prompt": None}, "prompt"),
    ({"prompt": MISSING}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 1e9}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"seed": "x"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop": ["x" * 5000]}, "stop"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"min_tokens": 100}, "min_tokens"),
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"model": 5}, "model"),
]


@pytest.mark.parametrize("update,param", COMPLETION_ERRORS)
def test_completion_rejects_bad_input_naming_the_field(
    tok, model, update: dict, param: str
) -> None:
    body = {"model": "tiny", "prompt": "Hello", **update}
    body = {k: v for k, v in body.items() if v is not MISSING}
    error = _error(parse_completion, body, tok, model)
    assert isinstance(error, InvalidArgument) and error.http_status == 400
    assert error.param == param, str(error)


CHAT_ERRORS = [
    ({"messages": None}, "messages"),
    ({"messages": MISSING}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
    ),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
    ({"n": 2}, "n"),
    (
        {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
        "tools[0].function.name",
    ),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "word " * CONTEXT}]}, "messages"),
]


@pytest.mark.parametrize("update,param", CHAT_ERRORS)
def test_chat_rejects_bad_input_naming_the_field(tok, model, update: dict, param: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **update}
    body = {k: v for k, v in body.items() if v is not MISSING}
    error = _error(parse_chat, body, tok, model)
    assert isinstance(error, InvalidArgument) and error.param == param, str(error)


def test_unknown_model_is_404_and_body_must_be_an_object(tok, model) -> None:
    error = _error(parse_completion, {"model": "gpt-9", "prompt": "x"}, tok, model)
    assert isinstance(error, NotFound) and error.http_status == 404 and "gpt-9" in str(error)
    assert error_body(error)["error"] == {
        "message": str(error),
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert _error(parse_completion, [1, 2], tok, model).param is None


def test_over_context_is_400_for_the_prompt_or_for_max_tokens(tok, model) -> None:
    assert _error(parse_completion, {"prompt": list(range(CONTEXT))}, tok, model).param == "prompt"
    error = _error(
        parse_completion, {"prompt": list(range(CONTEXT - 4)), "max_tokens": 5}, tok, model
    )
    assert error.param == "max_tokens" and str(CONTEXT) in str(error)
    ok = parse_completion({"prompt": list(range(CONTEXT - 4)), "max_tokens": 4}, tok, model)
    assert ok.request.params.max_tokens == 4


def test_valid_requests_parse_to_prompt_ids_and_params(tok, model) -> None:
    text = parse_completion(
        {
            "model": "tiny",
            "prompt": "Hello",
            "stop": "\n",
            "temperature": 0,
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        tok,
        model,
    )
    assert (
        text.request.prompt_ids == tuple(tok.encode("Hello"))
        and text.request.params.max_tokens == 16
    )
    assert text.request.params.stop == ("\n",) and text.request.params.seed == 3
    assert (
        text.stream
        and text.include_usage
        and not text.logprobs
        and text.request.request_id.startswith("cmpl-")
    )
    ids = parse_completion(
        {"prompt": [[5, 6, 7]], "max_tokens": None, "logprobs": 2, "model": "tiny-dir"}, tok, model
    )
    assert ids.request.prompt_ids == (5, 6, 7) and ids.logprobs and ids.request.params.logprobs == 2
    assert ids.request.model == "tiny"  # the directory name is an alias of the served name
    near_full = parse_completion({"prompt": list(range(CONTEXT - 3))}, tok, model)
    assert near_full.request.params.max_tokens == 3  # the default 16 is clamped to what fits


def test_chat_renders_the_template_and_defaults_to_the_rest_of_the_context(tok, model) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
    ]
    req = parse_chat(
        {"model": "tiny", "messages": messages, "logprobs": True, "top_logprobs": 2}, tok, model
    )
    expected = tok.encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    )
    assert req.request.prompt_ids == tuple(expected) and req.request.request_id.startswith(
        "chatcmpl-"
    )
    assert (
        req.request.params.max_tokens == CONTEXT - len(expected)
        and req.request.params.logprobs == 2
    )
    req = parse_chat(
        {"messages": messages[1:], "max_completion_tokens": 7, "max_tokens": 3}, tok, model
    )
    assert req.request.params.max_tokens == 7 and req.request.params.logprobs is None


# ----- response shapes -------------------------------------------------------------------------


def _events(tok: Tokenizer, logprobs: bool) -> list[GenerationEvent]:
    ids = tok.encode("Hello world", add_special_tokens=False)[:3]
    lps = [TokenLogprob(t, -0.25, ((t, -0.25), (7, -2.0))) for t in ids]
    pieces = [tok.decode([t]) for t in ids]
    return [
        GenerationEvent((ids[0],), pieces[0], tuple(lps[:1]) if logprobs else ()),
        GenerationEvent(
            tuple(ids[1:]),
            "".join(pieces[1:]),
            tuple(lps[1:]) if logprobs else (),
            "length",
            None,
            Usage(5, 3, 2),
        ),
    ]


def test_completion_response_and_stream_chunks(tok, model) -> None:
    req = parse_completion(
        {"prompt": "Hi", "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}},
        tok,
        model,
    )
    events = _events(tok, logprobs=True)
    body = Shaper(req, tok).response(fold(events))
    assert (
        body["object"] == "text_completion"
        and body["model"] == "tiny"
        and body["id"] == req.request.request_id
    )
    choice = body["choices"][0]
    assert choice["text"] == events[0].text + events[1].text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert (
        len(lp["tokens"])
        == len(lp["token_logprobs"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
        == 3
    )
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["top_logprobs"][0][tok.decode([7], skip_special_tokens=False)] == -2.0
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    shaper = Shaper(req, tok)
    chunks = [c for e in events for c in shaper.chunks(e)]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    assert all(c["usage"] is None for c in chunks)
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]  # offsets continue across chunks
    last = shaper.usage_chunk(events[-1].usage)
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] == 2


def test_chat_response_and_stream_chunks(tok, model) -> None:
    req = parse_chat(
        {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1},
        tok,
        model,
    )
    events = _events(tok, logprobs=True)
    body = Shaper(req, tok).response(fold(events))
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": events[0].text + events[1].text,
        "refusal": None,
    }
    content = body["choices"][0]["logprobs"]["content"]
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert (
        content[0]["bytes"] == list(content[0]["token"].encode())
        and len(content[0]["top_logprobs"]) == 2
    )
    shaper = Shaper(req, tok)
    chunks = [c for e in events for c in shaper.chunks(e)]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == message["content"]
    )
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models_response_has_root_and_context(model) -> None:
    entry = models_response(model)["data"][0]
    assert entry == {
        "id": "tiny",
        "object": "model",
        "created": 1,
        "owned_by": "pdmesh",
        "root": "tiny-dir",
        "parent": None,
        "max_model_len": CONTEXT,
    }


# ----- routing ---------------------------------------------------------------------------------


def _inst(
    name: str, role: str = "decode", running: int = 0, ready: bool = True, updated_ms: int = 1000
):
    return InstanceInfo(
        name,
        role,
        f"127.0.0.1:{1000 + len(name)}",
        ready=ready,
        stats=Load(num_running=running),
        updated_ms=updated_ms,
    )


def test_router_picks_fewest_running_counting_requests_sent_since_the_heartbeat() -> None:
    router = Router()
    router.update([_inst("d0", running=3), _inst("d1", running=1)])
    assert router.pick_decode().instance_id == "d1"
    router.note_sent("d1", now_ms=2000)
    router.note_sent("d1", now_ms=2001)
    assert router.decode_load(router.ready("decode")[1]) == (3,)
    assert router.pick_decode().instance_id == "d0"  # tie 3:3 -> the other one, in turn
    router.update([_inst("d0", running=3), _inst("d1", running=1, updated_ms=2000)])
    # the send at 2000 is in that heartbeat
    assert router.decode_load(router.ready("decode")[1]) == (2,)


def test_router_breaks_ties_in_turn_and_skips_unready() -> None:
    router = Router()
    router.update(
        [
            _inst("d0"),
            _inst("d1"),
            _inst("d2"),
            _inst("d3", ready=False),
            _inst("p0", role="prefill"),
        ]
    )
    assert [router.pick_decode().instance_id for _ in range(4)] == ["d0", "d1", "d2", "d0"]
    assert router.pick_decode(exclude={"d1"}).instance_id == "d2"
    assert router.pick_prefill().instance_id == "p0"


def test_router_prefill_counts_in_flight_and_none_is_503() -> None:
    router = Router()
    router.update([_inst("p0", role="prefill"), _inst("p1", role="prefill")])
    router.prefill_started("p0")
    assert router.pick_prefill().instance_id == "p1"
    router.prefill_started("p1")
    router.prefill_started("p1")
    router.prefill_finished("p0")
    assert router.pick_prefill().instance_id == "p0"
    with pytest.raises(NoInstance) as info:
        router.pick_decode()
    assert isinstance(info.value, Unavailable) and info.value.http_status == 503
    router.update([_inst("p0", role="prefill", ready=False)])
    with pytest.raises(NoInstance):
        router.pick_prefill()


# ----- stop strings ----------------------------------------------------------------------------


def _stream(
    tok: Tokenizer, stop: tuple[str, ...], include: bool = False
) -> tuple[list[str], TextStream, list]:
    ids = tok.encode(SCRIPT_TEXT, add_special_tokens=False)
    text = TextStream(IncrementalDetokenizer(tok, tok.encode("Hi")), stop, include)
    deltas, used = [], []
    for t in ids:
        used.append(t)
        deltas.append(text.push([t]))
        if text.stop_hit:
            break
    deltas.append(text.finish())
    return deltas, text, used


@pytest.mark.parametrize(
    "stop,include,expected",
    [
        ((" mesh",), False, "Hello world. The"),
        (("every", ". T"), False, "Hello world"),
        ((" mesh",), True, "Hello world. The mesh"),
        ((), False, SCRIPT_TEXT),
        (("absent",), False, SCRIPT_TEXT),
    ],
)
def test_stop_strings_cut_the_text_and_hold_back_partial_matches(
    tok, stop, include, expected: str
) -> None:
    deltas, text, used = _stream(tok, stop, include)
    assert "".join(deltas) == text.text == expected
    assert text.stop_hit == (
        next((s for s in stop if s in SCRIPT_TEXT), None) if stop != ("every", ". T") else ". T"
    )
    # no emitted prefix ever contains a stop string, even partly completed at the end
    if not include:
        emitted = ""
        for d in deltas[:-1]:
            emitted += d
            assert not any(s in emitted for s in stop)
    if text.stop_hit:
        # stopped at the hit
        assert len(used) < len(tok.encode(SCRIPT_TEXT, add_special_tokens=False))


# ----- orchestrator and REST over fake workers -------------------------------------------------


def _logprob(t: int) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=t, logprob=-0.5, top=[common_pb2.TopLogprob(token_id=t, logprob=-0.5)]
    )


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """Streams `script` (the first token comes from prefill in the disaggregated path)."""

    def __init__(
        self, script: list[int], delay: float = 0.0, reserve_error: grpc.StatusCode | None = None
    ) -> None:
        self.script, self.delay, self.reserve_error = script, delay, reserve_error
        self.reserved: dict[str, Any] = {}
        self.calls: list[str] = []
        self.cancelled: list[str] = []
        self.aborted: list[str] = []

    async def Reserve(self, request, context):
        self.calls.append("Reserve")
        if self.reserve_error is not None:
            await context.abort(self.reserve_error, "no blocks here")
        self.reserved[request.request_id] = request
        return decode_pb2.ReserveResponse(
            target=common_pb2.KVTarget(instance_id="d", groups=[common_pb2.KVGroup(block_ids=[0])])
        )

    async def Decode(self, request, context):
        self.calls.append("Decode")
        reserved = self.reserved.pop(request.request_id)
        async for chunk in self._tokens(reserved, 1, request.num_cached_tokens):
            yield chunk

    async def Generate(self, request, context):
        self.calls.append("Generate")
        async for chunk in self._tokens(request, 0, 0):
            yield chunk

    async def _tokens(self, request, start: int, cached: int):
        ids, done = self.script[: request.sampling.max_tokens], False
        try:
            for t in ids[start:]:
                await asyncio.sleep(self.delay)
                yield decode_pb2.TokenChunk(token_ids=[t], logprobs=[_logprob(t)])
            finish = (
                common_pb2.FINISH_REASON_LENGTH
                if len(ids) == request.sampling.max_tokens
                else common_pb2.FINISH_REASON_STOP
            )
            yield decode_pb2.TokenChunk(
                finish_reason=finish,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=cached,
            )
            done = True
        finally:
            if not done:
                self.aborted.append(request.request_id)

    async def Cancel(self, request, context):
        self.cancelled.append(request.request_id)
        return decode_pb2.CancelResponse(found=True)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, script: list[int], delay: float = 0.0) -> None:
        self.script, self.delay, self.calls, self.aborted = script, delay, [], []

    async def Prefill(self, request, context):
        self.calls.append("Prefill")
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.aborted.append(request.request_id)
            raise
        return prefill_pb2.PrefillResponse(
            first_token=_logprob(self.script[0]), num_cached_tokens=3
        )


async def _serve_fakes(*servicers) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    for s in servicers:
        add = (
            decode_pb2_grpc.add_DecodeServicer_to_server
            if isinstance(s, FakeDecode)
            else prefill_pb2_grpc.add_PrefillServicer_to_server
        )
        add(s, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _mesh(addresses: dict[str, str]) -> Router:
    router = Router()
    router.update(
        [
            InstanceInfo(name, name.split("-")[0], address, ready=True)
            for name, address in addresses.items()
        ]
    )
    return router


def _run(coro, timeout: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.mark.parametrize("mode,with_prefill", [("disagg", True), ("agg", True), ("disagg", False)])
def test_orchestrator_runs_the_path_of_the_mode(tok, model, mode: str, with_prefill: bool) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        decode, prefill = FakeDecode(script), FakePrefill(script)
        server, address = await _serve_fakes(decode, prefill)
        names = {"decode-0": address, **({"prefill-0": address} if with_prefill else {})}
        orch = Orchestrator(
            _mesh(names), tok, mode=mode, metrics=GatewayMetrics(CollectorRegistry())
        )
        try:
            req = build_request(
                "r1", tok.encode("Hi"), {"max_tokens": 8, "logprobs": 0}, model, "tiny"
            )
            result = fold([e async for e in orch.generate(req)])
        finally:
            await orch.close()
            await server.stop(None)
        assert result.text == tok.decode(script[:8]) and result.token_ids == script[:8]
        assert result.finish_reason == "length" and len(result.logprobs) == 8
        disagg = mode == "disagg" and with_prefill
        assert decode.calls == (["Reserve", "Decode"] if disagg else ["Generate"])
        assert prefill.calls == (["Prefill"] if disagg else [])
        path = "disagg" if disagg else "agg"
        assert result.usage == Usage(len(req.prompt_ids), 8, 3 if disagg else 0, path)

    _run(main())


def test_orchestrator_stop_string_cancels_decode_and_reserve_retries_elsewhere(tok, model) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        full, good, prefill = (
            FakeDecode(script, reserve_error=grpc.StatusCode.UNAVAILABLE),
            FakeDecode(script, delay=0.01),
            FakePrefill(script),
        )
        (s1, a1), (s2, a2) = await _serve_fakes(full), await _serve_fakes(good, prefill)
        orch = Orchestrator(
            _mesh({"decode-0": a1, "decode-1": a2, "prefill-0": a2}),
            tok,
            metrics=GatewayMetrics(CollectorRegistry()),
        )
        try:
            for i in range(2):  # each request tries the idle failing rank first, then the other
                req = build_request(
                    f"r-{i}", tok.encode("Hi"), {"max_tokens": 40, "stop": " mesh"}, model, "tiny"
                )
                result = fold([e async for e in orch.generate(req)])
                assert (result.text, result.finish_reason, result.stop_reason) == (
                    "Hello world. The",
                    "stop",
                    " mesh",
                )
            await asyncio.sleep(0.2)
        finally:
            await orch.close()
            await s1.stop(None)
            await s2.stop(None)
        assert full.calls == ["Reserve", "Reserve"] and good.calls == ["Reserve", "Decode"] * 2
        # the decode streams were cancelled at the stop
        assert len(good.aborted) == 2 and orch.active == 0

    _run(main())


def test_rest_api_streams_and_cancels_upstream_on_disconnect(tok, model) -> None:
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)

    async def main() -> None:
        decode, prefill = FakeDecode(script), FakePrefill(script)
        server, address = await _serve_fakes(decode, prefill)
        registry = CollectorRegistry()
        orch = Orchestrator(
            _mesh({"decode-0": address, "prefill-0": address}),
            tok,
            metrics=GatewayMetrics(registry),
        )
        http, task, port = await _start_http(create_app(orch, tok, model, registry), "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                await _check_rest(client, tok, decode, prefill, script)
        finally:
            http.should_exit = True
            await task
            await orch.close()
            await server.stop(None)
        assert orch.active == 0

    _run(main())


async def _check_rest(
    client: httpx.AsyncClient,
    tok: Tokenizer,
    decode: FakeDecode,
    prefill: FakePrefill,
    script: list[int],
) -> None:
    body = {
        "model": "tiny",
        "prompt": "Hi",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line]
    assert (
        response.headers["content-type"].startswith("text/event-stream")
        and lines[-1] == "data: [DONE]"
    )
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == tok.decode(script[:4])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    chat = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"][
        "content"
    ] == tok.decode(script[:3])
    health = (await client.get("/health")).json()
    assert health == {
        "status": "degraded",  # no kvstore in this fake mesh: hand-offs could not be recorded
        "mode": "disagg",
        "decode": 1,
        "prefill": 1,
        "kvstore": 0,
        "problems": [health["problems"][0]],
    }
    assert "kvstore" in health["problems"][0]
    assert (await client.get("/v1/models")).json()["data"][0]["root"] == "tiny-dir"
    assert {i["role"] for i in (await client.get("/mesh")).json()["instances"]} == {
        "decode",
        "prefill",
    }
    bad = await client.post("/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert (
        await client.post("/v1/completions", json={"model": "x", "prompt": "a"})
    ).status_code == 404
    assert 'pdmesh_requests_total{status="success"} 2.0' in (await client.get("/metrics")).text
    decode.delay = 0.05  # a client that goes away mid-stream cancels the decode stream
    async with client.stream(
        "POST", "/v1/completions", json={**body, "max_tokens": 40}
    ) as response:
        async for line in response.aiter_lines():
            if line:
                break
    prefill.delay = 5.0  # and one that goes away during prefill cancels it and the reservation
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=0.3)
    for _ in range(400):  # up to 20 s: a loaded machine can be slow to notice
        if decode.aborted and prefill.aborted and decode.cancelled:
            break
        await asyncio.sleep(0.05)
    assert (
        len(decode.aborted) == 1
        and prefill.aborted == decode.cancelled
        and len(decode.cancelled) == 1
    )
