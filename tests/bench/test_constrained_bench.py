"""Schema-constrained requests in the benchmarks: `pdmesh bench engine --constrained-share` (a tiny
in-process run on the embedded coder-v4) and `pdmesh bench serve --constrained-share` (the request
bodies, and the report against an in-process httpx.MockTransport: no mesh, no sockets)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from pdmesh.cli.main import main
from pdmesh_bench import serve
from pdmesh_bench.constrained import (
    SCHEMAS,
    choose_constrained,
    compact,
    constrained_params,
    is_valid,
    items_for,
    serve_schema,
    validation_error,
)
from pdmesh_bench.engine import constrained_count, parse_shares
from pdmesh_bench.traces import Job
from pdmesh_engine.grammar import check_grammar

pytest.importorskip("jsonschema")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


# ----- the schemas -----
@pytest.mark.parametrize("spec", SCHEMAS, ids=lambda s: s.name)
def test_schemas_compile_and_bound_their_items(spec) -> None:
    schema = spec.schema(2, 3)
    check_grammar("json_schema", json.dumps(schema))
    smallest = {spec.key: [spec.smallest] * 2}
    assert is_valid(compact(smallest), schema)
    assert "too short" in validation_error(compact({spec.key: [spec.smallest]}), schema)
    assert "not JSON" in validation_error(compact(smallest)[:-1], schema)
    assert spec.item_tokens(lambda text: list(text)) == len(compact(spec.smallest)) + 1
    with pytest.raises(ValueError):
        spec.schema(3, 2)


def test_sizing() -> None:
    assert items_for(49, 22) == 3 and items_for(1, 22) == 1 and items_for(0, 5) == 1
    assert serve_schema(SCHEMAS[0], 16)["properties"]["items"]["minItems"] == 1
    array = serve_schema(SCHEMAS[0], 128)["properties"]["items"]
    assert array["minItems"] == array["maxItems"] == 3
    params = constrained_params(SCHEMAS[1].schema(1, 2), 100, 0.7, 5)
    assert params.grammar_kind == "json_schema" and not params.ignore_eos
    assert json.loads(params.grammar) == SCHEMAS[1].schema(1, 2)
    assert (params.max_tokens, params.temperature, params.seed) == (100, 0.7, 5)


def test_shares_parse() -> None:
    assert parse_shares("0,0.5,1") == [0.0, 0.5, 1.0]
    for bad in ("", "0,2", "x", "0,0"):
        with pytest.raises(ValueError):
            parse_shares(bad)
    assert [constrained_count(s, 1) for s in (0, 0.5, 1)] == [0, 1, 1]
    assert [constrained_count(s, 32) for s in (0, 0.5, 1)] == [0, 16, 32]


# ----- pdmesh bench engine --constrained-share -----
def test_bench_engine_constrained_quick(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "constrained.json"
    argv = ["bench", "engine", "--constrained-share", "0,1", "--quick", "--concurrency", "2"]
    argv += ["--device", "cpu", "--dtype", "float32", "--torch-threads", "1"]
    assert main([*argv, "--rounds", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "constrained" and report["shares"] == [0.0, 1.0]
    assert [(r["concurrency"], r["share"]) for r in report["results"]] == [(2, 0.0), (2, 1.0)]
    plain, constrained = report["results"]
    for r in report["results"]:
        assert _positive(r["decode_step_ms"])
        assert len(r["decode_step_ms_rounds"]) == 2 and all(
            map(_positive, r["decode_step_ms_rounds"])
        )
        assert r["measured_steps"] == [report["output_len"]] * 2  # the whole window, each round
    assert plain["constrained"] == 0 and plain["overhead"] == 0
    assert plain["mask_ms"] is None and plain["constrained_total"] == 0
    assert constrained["constrained"] == 2 and constrained["constrained_total"] == 4
    assert constrained["valid"] == constrained["constrained_total"], constrained["errors"]
    assert constrained["overhead"] == pytest.approx(
        constrained["decode_step_ms"] / plain["decode_step_ms"] - 1
    )
    assert _positive(constrained["mask_ms"]) and constrained["mask_wait_ms"] >= 0
    assert _positive(constrained["mask_alone_ms"]) and plain["mask_alone_ms"] is None
    for low, high in constrained["constrained_tokens"]:
        assert report["output_len"] < low <= high  # the outputs outlasted the measured window
    assert set(report["schemas"]) == {s.name for s in SCHEMAS}
    assert "overhead" in capsys.readouterr().out


# ----- pdmesh bench serve --constrained-share -----
def _jobs(n: int, max_tokens: int = 64) -> list[Job]:
    return [Job(i, [16 + i, 17, 18], max_tokens, None) for i in range(n)]


def test_serve_bodies_carry_a_schema_for_the_share() -> None:
    jobs = _jobs(100)
    chosen = choose_constrained(100, 0.5, seed=7)
    assert chosen == choose_constrained(100, 0.5, seed=7)  # deterministic for a seed
    assert chosen != choose_constrained(100, 0.5, seed=8)
    sender = serve.Sender(None, "http://x/v1/completions", "m", 10.0, 100, 0, constrained=chosen)
    bodies = [sender.body(job) for job in jobs]
    carrying = [i for i, b in enumerate(bodies) if "response_format" in b]
    assert len(carrying) == 50 and carrying == sorted(chosen)
    assert {chosen[i] for i in carrying} == {s.name for s in SCHEMAS}  # all schemas drawn
    for i, body in enumerate(bodies):
        if i in chosen:
            fmt = body["response_format"]
            assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
            assert fmt["json_schema"]["name"] == chosen[i]
            assert fmt["json_schema"]["schema"] == sender.schema(jobs[i])
            assert "ignore_eos" not in body  # the grammar ends the output
        else:
            assert body["ignore_eos"] is True and sender.schema(jobs[i]) is None
    assert len(choose_constrained(100, 0.0, 1)) == 0 and len(choose_constrained(100, 1.0, 1)) == 100
    assert 20 <= len(choose_constrained(61, 0.33, 3)) <= 21
    with pytest.raises(ValueError):
        choose_constrained(10, 1.5, 0)
    with pytest.raises(ValueError, match="constrained-share"):
        serve.validate(serve.ServeOptions(synthetic=True, concurrency=1, constrained_share=2.0))


def test_serve_reports_constrained_requests_apart(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A fake server answers constrained requests with their schema's smallest valid JSON (one
    in four cut short), the rest with plain text; the report splits the two groups."""
    constrained_seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        body = json.loads(request.content)
        fmt = body.get("response_format")
        if fmt is None:
            pieces = ["a"] * 4
        else:
            constrained_seen.append(body)
            schema = fmt["json_schema"]["schema"]
            (key,) = schema["properties"]
            spec = next(s for s in SCHEMAS if s.key == key)
            n = schema["properties"][key]["minItems"]
            text = compact({key: [spec.smallest] * n})
            if len(constrained_seen) % 4 == 0:
                text = text[:-2]
            pieces = [text[:5], text[5:]]
        chunks = [{"choices": [{"index": 0, "text": p, "finish_reason": None}]} for p in pieces]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})

    monkeypatch.setattr(
        serve,
        "http_client",
        lambda o, n: httpx.AsyncClient(transport=httpx.MockTransport(handler)),
    )
    options = serve.ServeOptions(
        url="http://127.0.0.1:1",
        synthetic=True,
        concurrency=4,
        num_requests=24,
        input_len=32,
        output_len=128,
        progress_every=0,
        constrained_share=0.5,
    )
    result = serve.run_benchmark(options)
    s = result["structured"]
    assert s["constrained"]["requests"] == s["unconstrained"]["requests"] == 12
    assert s["constrained"]["completed"] == 12 and len(constrained_seen) == 12
    assert s["constrained"]["valid"] == 9 and len(s["invalid_examples"]) == 3
    for group in ("constrained", "unconstrained"):
        assert _positive(s[group]["ttft_ms"]["p50"]) and _positive(s[group]["itl_ms"]["p90"])
    rows = result["requests"]
    assert sum("schema" in row for row in rows) == 12
    serve.print_summary(result)
    assert "9/12 valid" in capsys.readouterr().out
