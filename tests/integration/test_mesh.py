"""The mesh end to end: real processes started by `pdmesh up`'s launcher, real Redis, NIXL and gRPC.

Greedy outputs through REST (openai SDK, httpx streaming) and the gRPC SDK equal the offline engine
in both modes; NIXL moves exactly the prompts' KV bytes; bad input gets OpenAI-shaped errors and
breaks nothing; disconnects, lease expiries and aborts return every block.
"""

from __future__ import annotations

import json
import math
import time

import grpc
import httpx
import pytest
from meshlib import abandon_stream, grpc_address, http_url, mesh_metadata, wait_idle, worker_status
from openai import OpenAI

PROMPTS = [
    "The quick brown fox",
    "def main():\n    return",
    "Return the number of items in a container.",
    # shares a prefix with the one above
    "Return the number of items in a container. Raise an error when",
    "x",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline(tiny_model):
    """Greedy completions of PROMPTS from the offline engine (the mesh must equal these)."""
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(tiny_model, num_blocks=256, block_size=8)
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    return {p: o for p, o in zip(PROMPTS, outs, strict=True)}


def _model_name(mesh) -> str:
    return mesh.options.model_dir.name


def _completion(client: OpenAI, mesh, prompt: str, **kw):
    return client.completions.create(
        model=_model_name(mesh),
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def _assert_no_leaks(mesh) -> None:
    for role, group in wait_idle(mesh).items():
        for status in group:
            assert status.integrity_checked and status.integrity_error == "", (
                role,
                status.integrity_error,
            )
            assert status.kv_blocks_used == 0, (role, status.instance_id, status.kv_blocks_used)
            assert status.num_running == 0 and status.num_waiting == 0, (role, status)


@pytest.mark.parametrize("mode", ["disagg", "agg"])
def test_openai_sdk_matches_offline_engine(mode, request, offline):
    mesh = request.getfixturevalue(f"{mode}_mesh")
    client = OpenAI(base_url=f"{http_url(mesh)}/v1", api_key="unused", max_retries=0)
    for prompt in PROMPTS:
        out = _completion(client, mesh, prompt)
        assert out.choices[0].text == offline[prompt].text, prompt
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == MAX_TOKENS
        assert out.usage.prompt_tokens == len(offline[prompt].prompt_token_ids)
    _assert_no_leaks(mesh)


def test_httpx_stream_matches_and_reports_usage(disagg_mesh, offline):
    prompt = PROMPTS[1]
    body = {
        "model": _model_name(disagg_mesh),
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces, usage, done = [], None, False
    with httpx.stream(
        "POST", f"{http_url(disagg_mesh)}/v1/completions", json=body, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"]:
                pieces.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert done
    assert "".join(pieces) == offline[prompt].text
    assert usage["completion_tokens"] == MAX_TOKENS
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_chat_completion_matches_offline_template(disagg_mesh, tiny_model):
    from pdmesh_engine import LLM, SamplingParams
    from pdmesh_engine.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "Name a container type."}]
    ids = Tokenizer.from_dir(tiny_model).encode_chat(messages)
    expected = LLM(tiny_model, num_blocks=64).generate(
        [ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    client = OpenAI(base_url=f"{http_url(disagg_mesh)}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model=_model_name(disagg_mesh),
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(ids)


def test_grpc_sdk_matches_offline_engine(disagg_mesh, offline):
    from pdmesh_client import Client

    with Client(grpc_address(disagg_mesh)) as client:
        for prompt in PROMPTS[:3]:
            result = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            assert result.text == offline[prompt].text
            assert list(result.token_ids) == offline[prompt].token_ids
            streamed = list(
                client.stream(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            )
            assert "".join(c.text for c in streamed) == offline[prompt].text


def test_nixl_moves_exactly_the_prompt_blocks(disagg_mesh, tiny_model):
    """Bytes pushed by prefill and received by decode equal the prompt blocks' KV, per request."""
    from pdmesh_engine.config import ModelConfig
    from pdmesh_engine.tokenizer import Tokenizer

    config, tokenizer = ModelConfig.from_dir(tiny_model), Tokenizer.from_dir(tiny_model)
    block_size = 8
    block_bytes = config.num_hidden_layers * block_size * config.kv_cache_dim * 4  # fp32 pool
    before = {role: worker_status(disagg_mesh, role)[0] for role in ("prefill", "decode")}
    client = OpenAI(base_url=f"{http_url(disagg_mesh)}/v1", api_key="unused", max_retries=0)
    prompts = [
        "A prompt of some length to move",
        "short",
        "Another prompt, a little longer than the first one",
    ]
    for prompt in prompts:
        _completion(client, disagg_mesh, prompt)
    expected = sum(math.ceil(len(tokenizer.encode(p)) / block_size) * block_bytes for p in prompts)
    after = {role: worker_status(disagg_mesh, role)[0] for role in ("prefill", "decode")}
    assert after["prefill"].kv_bytes_sent - before["prefill"].kv_bytes_sent == expected
    assert after["decode"].kv_bytes_received - before["decode"].kv_bytes_received == expected
    assert after["prefill"].transfer_failures == before["prefill"].transfer_failures


BAD_BODIES = [
    (b"{not json", 400),
    (json.dumps({"model": "MODEL"}).encode(), 400),  # no prompt
    (json.dumps({"model": "MODEL", "prompt": 5}).encode(), 400),  # wrong type
    (json.dumps({"model": "MODEL", "prompt": "hi", "max_tokens": -1}).encode(), 400),
    (json.dumps({"model": "MODEL", "prompt": "hi", "temperature": 1e9}).encode(), 400),
    (json.dumps({"model": "MODEL", "prompt": "hi", "top_p": 7}).encode(), 400),
    (json.dumps({"model": "MODEL", "prompt": ""}).encode(), 400),
    (json.dumps({"model": "MODEL", "prompt": "word " * 5000}).encode(), 400),  # over the context
    (json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), 404),
]


@pytest.mark.parametrize("raw,status", BAD_BODIES)
def test_bad_input_gets_openai_error_and_breaks_nothing(disagg_mesh, raw, status, offline):
    raw = raw.replace(b"MODEL", _model_name(disagg_mesh).encode())
    response = httpx.post(
        f"{http_url(disagg_mesh)}/v1/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    client = OpenAI(base_url=f"{http_url(disagg_mesh)}/v1", api_key="unused", max_retries=0)
    assert _completion(client, disagg_mesh, PROMPTS[0]).choices[0].text == offline[PROMPTS[0]].text


def test_client_disconnect_mid_stream_returns_blocks(disagg_mesh):
    body = {
        "model": _model_name(disagg_mesh),
        "prompt": "Keep going for a long time",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    abandon_stream(disagg_mesh, body)
    _assert_no_leaks(disagg_mesh)


def test_reservation_lease_expires_and_returns_blocks(disagg_mesh):
    from pdmesh_proto.common.v1 import common_pb2
    from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc

    decode = next(s for s in disagg_mesh.specs if s.role == "decode")
    before = worker_status(disagg_mesh, "decode")[0].lease_expiries
    with grpc.insecure_channel(decode.grpc_address) as channel:
        reply = decode_pb2_grpc.DecodeStub(channel).Reserve(
            decode_pb2.ReserveRequest(
                request_id="lease-test",
                prompt_token_ids=list(range(5, 45)),
                sampling=common_pb2.SamplingParams(max_tokens=4),
                lease_ms=300,
            ),
            timeout=30,
            metadata=mesh_metadata(disagg_mesh),
        )
    assert len(reply.target.groups[0].block_ids) == 5  # 40 tokens in blocks of 8
    time.sleep(1.0)
    assert worker_status(disagg_mesh, "decode")[0].lease_expiries == before + 1
    _assert_no_leaks(disagg_mesh)


def test_abort_during_prefill_returns_blocks_on_both_sides(disagg_mesh):
    """A client that hangs up right after sending a long prompt, while it is routed and
    prefilled, leaves nothing behind. (The read timeout is 1 ms, not the time a prefill takes:
    the whole mesh answered the first token of this prompt within 50 ms on a fast run, and the
    test must not depend on how fast the machine is.)"""
    prompt = "many words in a long prompt " * 60  # 842 tokens, of the mesh's 1,280 cache slots
    body = {"model": _model_name(disagg_mesh), "prompt": prompt, "max_tokens": 8, "stream": True}
    cancelled = _requests_ended(disagg_mesh, "cancelled")
    with pytest.raises(httpx.TimeoutException):
        with httpx.stream(
            "POST",
            f"{http_url(disagg_mesh)}/v1/completions",
            json=body,
            timeout=httpx.Timeout(60, read=0.001),
        ) as response:
            for _ in response.iter_lines():
                pass
    _assert_no_leaks(disagg_mesh)
    # admitted, then cancelled by the hang-up (a prompt the gateway refused would not count here)
    deadline = time.monotonic() + 10
    while _requests_ended(disagg_mesh, "cancelled") < cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _requests_ended(disagg_mesh, "cancelled") == cancelled + 1


def _requests_ended(mesh, status: str) -> float:
    """The gateway's count of requests that ended with `status` (pdmesh_requests_total)."""
    text = httpx.get(f"{http_url(mesh)}/metrics", timeout=10).text
    line = f'pdmesh_requests_total{{status="{status}"}} '
    return sum(float(row[len(line) :]) for row in text.splitlines() if row.startswith(line))


def test_mesh_view_lists_every_instance(disagg_mesh):
    instances = httpx.get(f"{http_url(disagg_mesh)}/mesh", timeout=10).json()
    rows = instances["instances"]
    assert instances["eplb"] == []  # no DEP instance here: nothing to balance
    roles = sorted(row["role"] for row in rows)
    assert roles == ["decode", "eplb", "gateway", "kvstore", "prefill"]
    decode = next(row for row in rows if row["role"] == "decode")
    assert decode["ready"] and "num_kv_blocks_free" in decode["stats"]
    metrics = httpx.get(f"{http_url(disagg_mesh)}/metrics", timeout=10).text
    assert "pdmesh_time_to_first_token_seconds" in metrics
