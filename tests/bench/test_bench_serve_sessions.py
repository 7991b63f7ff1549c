"""`pdmesh bench serve --sessions`: a trace's sessions replayed turn after turn (each turn sent
once the previous one was answered), all sessions at once; against an in-process
httpx.MockTransport (no sockets)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from pdmesh_bench import serve
from pdmesh_bench.traces import TraceRequest, load_trace, session_turns


def _agentic_dir(tmp_path: Path) -> Path:
    for name, turns in (("a", 4), ("b", 3)):
        requests = [
            {"t": 10.0 * k, "in": 128 * (k + 1), "out": 4, "hash_ids": list(range(1, 2 * k + 3))}
            for k in range(turns)
        ]
        (tmp_path / f"trace_{name}.json").write_text(
            json.dumps({"id": name, "block_size": 64, "requests": requests})
        )
    return tmp_path


def test_session_turns_group_by_session_in_turn_order(tmp_path: Path) -> None:
    trace = load_trace(_agentic_dir(tmp_path))
    sessions = session_turns(trace.requests)
    assert sorted(len(s) for s in sessions) == [3, 4]
    for turns in sessions:
        lengths = [trace.requests[i].input_len for i in turns]
        assert lengths == sorted(lengths)  # each session's context grows turn by turn
    assert [len(s) for s in session_turns(trace.requests, max_turns=2)] == [2, 2]
    assert session_turns([TraceRequest(0.0, 5, 1), TraceRequest(1.0, 5, 1)]) == [[0, 1]]


def test_sessions_send_each_turn_after_the_previous_answer(tmp_path: Path) -> None:
    options = serve.ServeOptions(
        url="http://127.0.0.1:1",
        trace=str(_agentic_dir(tmp_path)),
        sessions=True,
        max_turns=3,
        progress_every=0,
    )
    serve.validate(options)
    active: dict[tuple[int, ...], int] = {}
    overlaps: list[tuple[int, ...]] = []
    sent: list[int] = []
    most_at_once = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal most_at_once
        prompt = json.loads(request.content)["prompt"]
        key = tuple(prompt[:64])  # the session's first block: the same in all its turns
        if active.get(key):
            overlaps.append(key)
        active[key] = active.get(key, 0) + 1
        most_at_once = max(most_at_once, sum(active.values()))
        sent.append(len(prompt))
        await asyncio.sleep(0.02)
        active[key] -= 1
        usage = {"prompt_tokens": len(prompt), "completion_tokens": 1}
        body = (
            f"data: {json.dumps({'choices': [{'index': 0, 'text': 'a', 'finish_reason': None}]})}"
            f"\n\ndata: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> list[serve.Result]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            workload = serve.build_workload(options, 1024)
            assert workload.sessions is not None and len(workload.sessions) == 2
            sender = serve.Sender(client, "http://x/v1/completions", "m", 10.0, 6, 0)
            jobs = workload.jobs(0)
            return await serve.session_loop(sender, jobs, workload.sessions, 0.0, None, None)

    results = asyncio.run(go())
    assert len(results) == 6 and all(r.ok for r in results)
    assert not overlaps  # never two turns of one session in flight
    assert most_at_once == 2  # the two sessions ran side by side


def test_sessions_need_a_trace() -> None:
    with pytest.raises(ValueError, match="--sessions"):
        serve.validate(serve.ServeOptions(synthetic=True, concurrency=1, sessions=True))
