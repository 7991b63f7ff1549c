"""Trace replay for `pdmesh bench serve`: parsing, scaling, prompt sharing, arrivals and the metrics
(pure and fast; the SSE reader runs against an in-process httpx.MockTransport, no sockets)."""

from __future__ import annotations

import asyncio
import json
import statistics
from itertools import pairwise

import httpx
import pytest

from pdmesh_bench import serve
from pdmesh_bench.traces import (
    MIN_BLOCK_TOKENS,
    PromptBuilder,
    TraceRequest,
    choose_arrivals,
    load_trace,
    make_jobs,
    p90_user_tokens_per_s,
    parse_mooncake,
    percentile_of,
    plan_scaling,
    poisson_arrivals,
    scale_requests,
    scaled_block_size,
    synthetic_requests,
    trace_arrivals,
)

MOONCAKE = [
    '{"timestamp": 1000, "input_length": 1100, "output_length": 50, "hash_ids": [0, 1, 2]}',
    '{"timestamp": 1500, "input_length": 1600, "output_length": 400, "hash_ids": [0, 1, 3, 4]}',
    "",
    '{"timestamp": 3000, "input_length": 85000, "output_length": 900, "hash_ids": '
    + str(list(range(10, 177)))
    + "}",
]


def _trace_requests(n: int = 200) -> list[TraceRequest]:
    """Production-like lengths: inputs 500..85K, outputs 10..2K."""
    return [
        TraceRequest(
            i * 0.3,
            500 + (i * 7919) % 85_000,
            10 + (i * 104729) % 2000,
            tuple(range(i, i + 1 + (500 + (i * 7919) % 85_000) // 512)),
        )
        for i in range(n)
    ]


def test_parse_mooncake() -> None:
    trace = parse_mooncake(MOONCAKE)
    assert trace.format == "mooncake" and trace.block_tokens == 512
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.5, 2.0]
    assert trace.requests[1] == TraceRequest(0.5, 1600, 400, (0, 1, 3, 4))
    with pytest.raises(ValueError, match="line 2"):
        parse_mooncake(
            ['{"timestamp": 0, "input_length": 1, "output_length": 1}', '{"timestamp": 1}']
        )


def test_load_formats(tmp_path) -> None:
    (tmp_path / "t.jsonl").write_text("\n".join(MOONCAKE))
    assert len(load_trace(tmp_path / "t.jsonl").requests) == 3
    (tmp_path / "a.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.5000000,374,44\n2023-11-16 18:15:48.0000000,396,109\n"
    )
    azure = load_trace(tmp_path / "a.csv")
    assert azure.block_tokens is None and azure.requests[1] == TraceRequest(1.5, 396, 109)
    session = {
        "id": "s",
        "block_size": 64,
        "requests": [
            {"t": 2.0, "in": 300, "out": 5, "hash_ids": [1, 2, 3, 4, 5]},
            {
                "t": 10.0,
                "type": "subagent",
                "requests": [{"t": 1.0, "in": 100, "out": 2, "hash_ids": [7, 8]}],
            },
        ],
    }
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "one.json").write_text(json.dumps(session))
    (tmp_path / "dir" / "two.json").write_text(json.dumps(session))
    agentic = load_trace(tmp_path / "dir" / "one.json")
    assert agentic.block_tokens == 64 and [
        (r.arrival_s, r.input_len) for r in agentic.requests
    ] == [(0, 300), (9, 100)]
    merged = load_trace(tmp_path / "dir").requests
    # sessions do not share ids
    assert len(merged) == 4 and merged[0].hash_ids != merged[1].hash_ids


@pytest.mark.parametrize("context", [2048, 4096])
def test_scaling_fits_the_context(context: int) -> None:
    requests = _trace_requests()
    scaling = plan_scaling(requests, context, 512, percentile=99)
    scaled = scale_requests(requests, scaling)
    assert 0 < scaling.factor < 1
    assert all(
        r.input_len >= 1 and r.output_len >= 1 and r.input_len + r.output_len <= context
        for r in scaled
    )
    fits = sum(
        round(r.input_len * scaling.factor) + round(r.output_len * scaling.factor) <= context
        for r in requests
    )
    assert fits >= 0.98 * len(requests)  # the p99 fits without clamping
    assert scaling.inputs_clamped == len(requests) - fits
    assert scaling.block_tokens == max(MIN_BLOCK_TOKENS, round(512 * scaling.factor))
    info = scaling.to_dict()
    assert {"factor", "block_tokens", "inputs_clamped", "outputs_clamped", "rule"} <= info.keys()


def test_unscaled_lengths_are_only_clamped() -> None:
    requests = [TraceRequest(0, 100, 10), TraceRequest(0, 5000, 3000)]
    scaling = plan_scaling(requests, 2048, 512, enabled=False)
    scaled = scale_requests(requests, scaling)
    assert scaling.factor == 1.0 and scaling.block_tokens == 512
    assert scaled[0] == requests[0]
    assert scaled[1].output_len == 1024 and scaled[1].input_len == 1024
    assert (scaling.outputs_clamped, scaling.inputs_clamped) == (1, 1)


def test_tiny_blocks_group_hash_ids() -> None:
    assert scaled_block_size(512, 0.05) == (26, 1)
    tokens, group = scaled_block_size(64, 0.0115)  # 0.74 tokens per id: group ids
    assert group == 6 and tokens >= MIN_BLOCK_TOKENS
    builder = PromptBuilder(tokens, seed=1, hash_ids_per_block=group)
    a = builder.build(0, 5 * tokens, list(range(40)))
    b = builder.build(1, 5 * tokens, list(range(12)) + [99] * 28)
    assert (
        a[: 2 * tokens] == b[: 2 * tokens]
        and a[2 * tokens : 3 * tokens] != b[2 * tokens : 3 * tokens]
    )


def test_equal_hash_ids_give_identical_blocks() -> None:
    builder = PromptBuilder(block_tokens=8, seed=3)
    a = builder.build(0, 8 * 3 + 5, [10, 11, 12])
    b = builder.build(1, 8 * 3 + 5, [10, 11, 13])
    assert a[:16] == b[:16]  # blocks 10, 11 shared exactly
    assert a[16:24] != b[16:24]  # 12 vs 13
    assert a[24:] != b[24:]  # the partial tail is unique per request
    assert PromptBuilder(8, seed=3).block(12) == a[16:24]  # deterministic given the seed
    assert PromptBuilder(8, seed=4).block(12) != a[16:24]
    assert all(16 <= t < 1024 for t in a + b)


@pytest.mark.parametrize("input_len", [1, 7, 8, 40, 57, 200])
def test_prompt_length_is_the_scaled_input(input_len: int) -> None:
    builder = PromptBuilder(block_tokens=8)
    assert len(builder.build(0, input_len, list(range(6)))) == input_len


def test_jobs_from_a_scaled_trace() -> None:
    trace = parse_mooncake(MOONCAKE)
    scaling = plan_scaling(trace.requests, 2048, trace.block_tokens)
    scaled = scale_requests(trace.requests, scaling)
    jobs = make_jobs(scaled, scaling, trace_arrivals(scaled), seed=0, vocab_size=320)
    assert [len(j.prompt) for j in jobs] == [r.input_len for r in scaled]
    assert [j.max_tokens for j in jobs] == [r.output_len for r in scaled]
    block = scaling.block_tokens
    assert jobs[0].prompt[: 2 * block] == jobs[1].prompt[: 2 * block]
    assert jobs[0].prompt[2 * block : 3 * block] != jobs[1].prompt[2 * block : 3 * block]
    assert max(t for j in jobs for t in j.prompt) < 320


def test_synthetic_shared_prefix() -> None:
    requests, block = synthetic_requests(3, 100, 20, prefix_fraction=0.25)
    jobs = make_jobs(requests, plan_scaling(requests, 4096, block, enabled=False, factor=1.0), None)
    assert all(len(j.prompt) == 100 and j.max_tokens == 20 and j.arrival_s is None for j in jobs)
    assert jobs[0].prompt[:25] == jobs[2].prompt[:25] and jobs[0].prompt[25:] != jobs[2].prompt[25:]


def test_arrivals() -> None:
    requests = [TraceRequest(t, 1, 1) for t in (0.0, 0.5, 2.0)]
    assert trace_arrivals(requests) == [0.0, 0.5, 2.0]
    assert trace_arrivals(requests, time_scale=0.5) == [0.0, 0.25, 1.0]
    times = poisson_arrivals(4000, rate=8.0, seed=7)
    assert times == poisson_arrivals(4000, rate=8.0, seed=7) and times[0] == 0.0
    assert all(b >= a for a, b in pairwise(times))
    assert (len(times) - 1) / times[-1] == pytest.approx(8.0, rel=0.05)
    gaps = [b - a for a, b in pairwise(times)]
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8.0, rel=0.1)  # exponential: sd = mean
    assert choose_arrivals(requests, rate=None, concurrency=4) is None
    assert choose_arrivals(requests, rate=2.0, concurrency=None, seed=1) == poisson_arrivals(
        3, 2.0, 1
    )


def test_percentiles_and_p90_user() -> None:
    values = list(range(1, 101))  # 1..100
    assert percentile_of(values, 50) == pytest.approx(50.5)
    assert percentile_of(values, 90) == pytest.approx(90.1)
    assert percentile_of([5.0], 99) == 5.0
    speeds = [10.0] * 10 + [100.0] * 90  # 10% of users are slow
    assert p90_user_tokens_per_s(speeds) == pytest.approx(91.0)  # the 10th percentile, interpolated
    slow = p90_user_tokens_per_s(speeds)
    assert sum(s >= slow for s in speeds) >= 90  # 90% of users get at least this speed
    assert p90_user_tokens_per_s([]) is None


def test_check_host() -> None:
    for url in (
        "http://127.0.0.1:8000",
        "http://localhost:1/v1",
        "http://[::1]:8000",
        "http://127.0.0.2",
    ):
        serve.check_host(url)
    for url in ("http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1"):
        with pytest.raises(ValueError):
            serve.check_host(url)
    serve.check_host("http://example.com", allow_remote=True)


def _sse(chunks: list[dict]) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    )


def test_stream_metrics_with_a_mock_server() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if "ignore_eos" in body:
            return httpx.Response(400, json={"error": {"message": "unknown field ignore_eos"}})
        chunks = [
            {"choices": [{"index": 0, "text": t, "finish_reason": None}], "usage": None}
            for t in "abc"
        ]
        chunks[-1]["choices"][0]["finish_reason"] = "length"
        chunks.append(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": 40,
                    "completion_tokens": 3,
                    "total_tokens": 43,
                    "prompt_tokens_details": {"cached_tokens": 32},
                },
            }
        )
        return httpx.Response(
            200, content=_sse(chunks), headers={"content-type": "text/event-stream"}
        )

    async def go() -> list[serve.Result]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            sender = serve.Sender(
                client, "http://127.0.0.1/v1/completions", "m", 5.0, 2, progress_every=0
            )
            jobs = make_jobs(
                [TraceRequest(0, 40, 3)] * 2, plan_scaling([], 64, 8, enabled=False), [0.0, 0.0]
            )
            return await serve.closed_loop(sender, jobs, 1, None)

    results = asyncio.run(go())
    assert [b.get("ignore_eos") for b in seen] == [True, None, None]  # dropped once rejected
    assert all(
        r.ok and r.output_tokens == 3 and r.cached_tokens == 32 and len(r.token_times) == 3
        for r in results
    )
    summary = serve.summarize(results, duration_s=1.0)
    assert summary["num_errors"] == 0 and summary["output_tokens"] == 6
    assert (
        summary["input_tokens"],
        summary["cached_input_tokens"],
        summary["uncached_input_tokens"],
    ) == (80, 64, 16)
    assert summary["itl_ms"]["p50"] is not None and summary["tpot_ms"]["p50"] is not None


def test_errors_are_counted_not_fatal() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="boom")

    async def go() -> list[serve.Result]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            sender = serve.Sender(
                client, "http://127.0.0.1/v1/completions", "m", 5.0, 3, progress_every=0
            )
            jobs = make_jobs(
                [TraceRequest(0, 4, 2)] * 3, plan_scaling([], 64, 8, enabled=False), [0.0] * 3
            )
            return await serve.open_loop(sender, jobs, 0.0, None)

    summary = serve.summarize(asyncio.run(go()), duration_s=1.0)
    assert summary["num_errors"] == 3 and summary["num_completed"] == 0
    assert "HTTP 500: boom" in summary["error_messages"][0]
    assert summary["ttft_ms"]["p50"] is None and summary["p90_user_tokens_per_s"] is None
