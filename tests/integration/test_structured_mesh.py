"""Structured outputs through the mesh: real processes, Redis, NIXL and gRPC, the embedded
`coder-v4`.

The grammar travels with the request: the prefill rank samples the first token under it, the decode
rank advances its own state over that token and continues; a request migrated off a killed decode
rank replays the tokens it had into a fresh state on the other rank. So every constrained stream
equals the offline engine's (greedy, fp32): disaggregated with MTP speculation on (verify rows
masked after the drafts), after a kill -9 of a decode rank mid-stream, aggregated without
speculation, and with a DEP2 decode instance. On the aggregated mesh, through the `openai` SDK:
200 `json_schema` (strict) chat outputs over a set of schemas, sampled, all validate; forced tool
calls parse into `tool_calls` (streamed and not) whose arguments validate; a multi-turn exchange
with `tool` messages runs.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from meshlib import http_url, kill, respawn, start_mesh, wait_idle, worker_args
from openai import OpenAI

from pdmesh_engine.checkpoint import embedded_model_dir

MODEL = embedded_model_dir("coder-v4")
WORKER_ARGS = (*worker_args(64), "--dtype", "float32")
DISAGG = ("--local-prefill-tokens", "off")
MTP = ("--speculative-method", "mtp", "--num-speculative-tokens", "2")
ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["file", "dir", "link"]},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["id", "kind", "name"],
    "additionalProperties": False,
}
SCHEMAS: list[dict[str, Any]] = [
    {  # long: a stream is still running when its decode rank is killed
        "type": "object",
        "properties": {"items": {"type": "array", "items": ITEM, "minItems": 6, "maxItems": 8}},
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "score": {"type": "number", "minimum": -5, "maximum": 5},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "team": {"enum": ["x", "y"]}},
                "required": ["id", "team"],
                "additionalProperties": False,
            },
        },
        "required": ["ok", "score", "owner"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "List the files of the project as JSON:",
    "def describe(user):\n    return",
    "The record reads",
    "import json\nconfig =",
]
CASES = [(p, i) for i, p in enumerate(PROMPTS) for i in (i % len(SCHEMAS), 0)]
MAX_TOKENS = 400
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 30},
                    "filters": {"type": "array", "items": {"type": "string", "maxLength": 6}},
                },
                "required": ["query"],
            },
        },
    },
]


def response_format(schema_index: int) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {
            "name": f"s{schema_index}",
            "schema": SCHEMAS[schema_index],
            "strict": True,
        },
    }


@pytest.fixture(scope="module")
def offline() -> dict[tuple[str, int], str]:
    """Every case's greedy constrained text by the offline engine."""
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(MODEL, dtype="float32", num_blocks=160, block_size=64)
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0,
            grammar_kind="json_schema",
            grammar=json.dumps(SCHEMAS[i]),
        )
        for _, i in CASES
    ]
    outs = llm.generate([p for p, _ in CASES], params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
    return {case: o.text for case, o in zip(CASES, outs, strict=True)}


def _stream(url: str, prompt: str, schema_index: int, started: threading.Event) -> str:
    """A streamed constrained completion's text (raises on an error event)."""
    body = {
        "model": MODEL.name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "response_format": response_format(schema_index),
    }
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert "error" not in event, event
            for choice in event.get("choices", ()):
                text += choice.get("text", "")
                started.set()
    started.set()
    return text


def _run_streams(mesh, fault=None) -> dict[tuple[str, int], str]:
    """Every case streamed at once; `fault` runs once every stream has its first text."""
    url = http_url(mesh)
    events = [threading.Event() for _ in CASES]
    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = [
            pool.submit(_stream, url, p, i, e) for (p, i), e in zip(CASES, events, strict=True)
        ]
        for e in events:
            assert e.wait(120), "a stream never started"
        if fault is not None:
            fault()
        return {case: f.result(timeout=240) for case, f in zip(CASES, futures, strict=True)}


def _assert_equal_and_no_leaks(mesh, got: dict, offline: dict) -> None:
    for case, text in got.items():
        assert text == offline[case], case
        jsonschema.validate(json.loads(text), SCHEMAS[case[1]])
    for role, group in wait_idle(mesh, timeout_s=60).items():
        for status in group:
            assert status.kv_blocks_used == 0, (role, status.instance_id)


def _migrations(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdmesh_gateway_migrations_total "):
            return float(line.split()[1])
    raise AssertionError("the gateway exports no pdmesh_gateway_migrations_total")


def test_disaggregated_with_mtp_and_after_a_kill_9(offline, tmp_path: Path) -> None:
    mesh = start_mesh(
        MODEL,
        tmp_path / "logs",
        "test-structured-disagg",
        mode="disagg",
        num_decode=2,
        worker_args=(*WORKER_ARGS, *MTP),
        gateway_args=DISAGG,
    )
    try:
        _assert_equal_and_no_leaks(mesh, _run_streams(mesh), offline)
        url, before = http_url(mesh), _migrations(http_url(mesh))
        got = _run_streams(mesh, lambda: kill(mesh, "decode-0"))
        assert _migrations(url) > before, "no stream was on the killed decode rank"
        respawn(mesh, "decode-0")
        [spec] = [s for s in mesh.specs if s.name == "decode-0"]
        mesh._wait_serving(spec, spec.grpc_address, time.monotonic() + 120)
        _assert_equal_and_no_leaks(mesh, got, offline)
    finally:
        mesh.stop()


def test_dep2_decode(offline, tmp_path: Path) -> None:
    mesh = start_mesh(
        MODEL,
        tmp_path / "logs",
        "test-structured-dep",
        mode="disagg",
        decode_dep=2,
        worker_args=WORKER_ARGS,
        gateway_args=DISAGG,
    )
    try:
        _assert_equal_and_no_leaks(mesh, _run_streams(mesh), offline)
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def agg_mesh(tmp_path_factory: pytest.TempPathFactory):
    mesh = start_mesh(
        MODEL,
        tmp_path_factory.mktemp("logs-structured-agg"),
        "test-structured-agg",
        mode="agg",
        worker_args=WORKER_ARGS,
    )
    yield mesh
    mesh.stop()


def test_aggregated(agg_mesh, offline) -> None:
    _assert_equal_and_no_leaks(agg_mesh, _run_streams(agg_mesh), offline)


def _client(mesh) -> OpenAI:
    return OpenAI(base_url=f"{http_url(mesh)}/v1", api_key="unused", max_retries=0, timeout=180)


def test_200_json_schema_outputs_validate(agg_mesh) -> None:
    client = _client(agg_mesh)
    topics = ["a user", "a file", "a team", "a job", "a city"]

    def ask(n: int) -> tuple[int, str | None]:
        schema_index = n % len(SCHEMAS)
        out = client.chat.completions.create(
            model=MODEL.name,
            messages=[{"role": "user", "content": f"Describe {topics[n % len(topics)]} as JSON."}],
            response_format=response_format(schema_index),  # type: ignore[arg-type]
            temperature=0.8,
            seed=n,
            max_tokens=MAX_TOKENS,
        )
        return schema_index, out.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, range(200)))
    for schema_index, content in results:
        assert content is not None
        jsonschema.validate(json.loads(content), SCHEMAS[schema_index])


def _check_calls(calls: list[Any]) -> None:
    assert calls, "no tool call"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_forced_tool_calls_streamed_and_not(agg_mesh) -> None:
    client = _client(agg_mesh)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "search"}}):
        out = client.chat.completions.create(
            model=MODEL.name,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"
        _check_calls(message.tool_calls or [])
        if isinstance(choice, dict):
            assert [c.function.name for c in message.tool_calls or []] == ["search"]
        # the same request streamed: the SDK's accumulation gives the same calls
        with client.beta.chat.completions.stream(
            model=MODEL.name,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice=choice,  # type: ignore[arg-type]
            temperature=0,
            max_tokens=MAX_TOKENS,
        ) as stream:
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls or []
        ]


def test_a_multi_turn_exchange_with_tool_messages(agg_mesh) -> None:
    client = _client(agg_mesh)
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo, then summarise."}]
    first = client.chat.completions.create(
        model=MODEL.name,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    calls = first.choices[0].message.tool_calls or []
    _check_calls(calls)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 4}'})
    second = client.chat.completions.create(
        model=MODEL.name,
        messages=messages,
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=24,
    )
    assert second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
