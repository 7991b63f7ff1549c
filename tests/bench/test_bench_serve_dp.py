"""`pdmesh bench serve` additions: DP mirror/lag replays (copy schedule, seeds, per-rank figures,
the imbalance cost), the trace's reusable prefix, per-request rows and the TTFT plots. Pure and
fast; the replay loop runs against an in-process httpx.MockTransport (no sockets)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from pdmesh_bench import dp_replay, plots, serve
from pdmesh_bench.dp_replay import (
    Copy,
    busy_time,
    copy_seed,
    imbalance_cost,
    prefill_throughput,
    rank_figures,
    replays_of,
    schedule_copies,
)
from pdmesh_bench.traces import (
    TraceRequest,
    make_jobs,
    mix_long_prompts,
    plan_scaling,
    reusable_prefix_tokens,
    scale_requests,
    synthetic_requests,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# ----- copies --------------------------------------------------------------------------------


def test_mirror_sends_every_job_to_every_rank_at_its_arrival() -> None:
    copies = schedule_copies([0.0, 0.5, 1.25], dp_size=3, lag_s=0.0)
    assert len(copies) == 9
    assert copies[:3] == [Copy(0, 0, 0.0), Copy(0, 1, 0.0), Copy(0, 2, 0.0)]
    assert {(c.index, c.rank) for c in copies} == {(i, r) for i in range(3) for r in range(3)}
    assert all(c.send_s == [0.0, 0.5, 1.25][c.index] for c in copies)


def test_lag_delays_rank_r_by_r_times_the_lag() -> None:
    copies = schedule_copies([0.0, 0.5, 1.25], dp_size=3, lag_s=0.4)
    assert all(math.isclose(c.send_s, [0.0, 0.5, 1.25][c.index] + 0.4 * c.rank) for c in copies)
    assert [c.send_s for c in copies] == sorted(c.send_s for c in copies)  # in send order
    assert [(c.index, c.rank) for c in copies[:4]] == [(0, 0), (0, 1), (1, 0), (0, 2)]
    # one rank: lag is the mirror
    assert schedule_copies([0.0, 1.0], 1, 0.4) == schedule_copies([0.0, 1.0], 1, 0.0)
    with pytest.raises(ValueError):
        schedule_copies([0.0], 0, 0.1)
    with pytest.raises(ValueError):
        schedule_copies([0.0], 2, -1.0)


def test_replay_plans_and_seeds() -> None:
    assert [k for _, k, _ in replays_of("both", 0.3)] == ["mirror", "lag", "mirror"]
    assert replays_of("both", 0.3)[1] == ("lag", "lag", 0.3)
    assert replays_of("mirror", 0.3) == [("mirror", "mirror", 0.0)]
    assert replays_of("lag", 0.3) == [("lag", "lag", 0.3)]
    assert [n for n, _, _ in replays_of("both", 0.3, rounds=2)] == [
        "mirror",
        "lag",
        "mirror-2",
        "lag-2",
        "mirror-3",
    ]
    with pytest.raises(ValueError):
        replays_of("sideways", 0.3)
    seeds = {copy_seed(7, replay, rank) for replay in range(3) for rank in range(8)}
    assert len(seeds) == 24  # every (replay, rank) copy gets its own prompts
    assert copy_seed(0, 0, 0) != copy_seed(1, 0, 0)


def test_copies_share_lengths_but_no_block() -> None:
    """Copies of one replay on two ranks, and the next replay: same lengths and prefix structure,
    disjoint token blocks (no cross-copy cache hits)."""
    requests = [TraceRequest(0.0, 40, 2, (0, 1)), TraceRequest(0.1, 40, 2, (0, 2))]
    scaling = plan_scaling(requests, 128, 16, enabled=False)

    def jobs(seed: int) -> list[list[int]]:
        return [j.prompt for j in make_jobs(requests, scaling, [0.0, 0.1], seed)]

    a, b, c = jobs(copy_seed(0, 0, 0)), jobs(copy_seed(0, 0, 1)), jobs(copy_seed(0, 1, 0))
    for prompts in (a, b, c):
        assert [len(p) for p in prompts] == [40, 40]
        assert prompts[0][:16] == prompts[1][:16]  # the shared first block, inside one copy
    assert a[0][:16] != b[0][:16] and a[0][:16] != c[0][:16]


# ----- figures -------------------------------------------------------------------------------


def _result(index: int, rank: int, start: float, ttft: float, prompt: int = 100) -> serve.Result:
    r = serve.Result(index, start, rank, ok=True, prompt_tokens=prompt, output_tokens=2)
    r.token_times = [start + ttft, start + ttft + 0.01]
    r.end = start + ttft + 0.01
    return r


def test_rank_figures_exclude_the_lag_offset_and_idle_gaps() -> None:
    # rank 1 starts 5 s late (lag); both ranks idle between 0.5 s and 1 s after their start
    results = [
        _result(0, 0, 0.0, 0.5),
        _result(1, 0, 1.0, 1.0),
        _result(2, 0, 1.5, 1.0),  # overlaps the one before: counted once
        _result(0, 1, 5.0, 0.5),
        _result(1, 1, 6.0, 1.0),
        _result(2, 1, 6.5, 1.0),
    ]
    failed = serve.Result(3, 5.5, 1, error="HTTP 500", prompt_tokens=100)
    ranks = rank_figures([*results, failed], 2)
    assert [r["busy_s"] for r in ranks] == [2.0, 2.0]  # 0.5 + 1.5, not the spans
    assert [r["span_s"] for r in ranks] == [2.5, 2.5]
    assert [r["num_requests"] for r in ranks] == [3, 4] and ranks[1]["num_completed"] == 3
    assert ranks[0]["prompt_tokens_per_s"] == 150.0
    assert math.isclose(ranks[1]["ttft_ms"]["mean"], 2500 / 3)
    throughput, busy = prefill_throughput(ranks)
    assert busy == 2.0 and throughput == 300.0  # 600 tokens over 2 s, not over the 9 s span
    assert prefill_throughput([*ranks, {**ranks[0], "busy_s": None}]) == (None, None)


def test_busy_time_is_the_union_of_intervals() -> None:
    assert busy_time([]) == 0.0
    assert busy_time([(0.0, 1.0), (2.0, 3.0)]) == 2.0
    assert busy_time([(0.0, 2.0), (1.0, 3.0), (0.5, 1.5)]) == 3.0
    assert busy_time([(4.0, 5.0), (0.0, 10.0)]) == 10.0


def _replay(kind: str, throughput: float | None, ttft: float, name: str = "") -> dict:
    stats = {"p50": ttft, "p90": 2 * ttft, "mean": 1.5 * ttft}
    return {
        "name": name or kind,
        "kind": kind,
        "prefill_tokens_per_s": throughput,
        "ttft_ms": stats,
    }


def test_imbalance_cost_against_the_mean_mirror() -> None:
    cost = imbalance_cost(
        [
            _replay("mirror", 1000.0, 100.0),
            _replay("lag", 850.0, 150.0),
            _replay("mirror", 900.0, 100.0),
        ]
    )
    assert cost is not None
    assert math.isclose(cost["throughput"], 1 - 850 / 950)
    assert math.isclose(cost["ttft_p50_ratio"], 1.5) and math.isclose(cost["ttft_p90_ratio"], 1.5)
    assert math.isclose(cost["mirror_spread"], 100 / 950)
    [only] = cost["per_round"]
    assert math.isclose(only["throughput"], 1 - 850 / 950) and only["ttft_mean_ratio"] == 1.5


def test_per_round_costs_compare_each_lag_with_its_neighbours() -> None:
    replays = [
        _replay("mirror", 1000.0, 100.0),
        _replay("lag", 900.0, 120.0),
        _replay("mirror", 1000.0, 100.0, "mirror-2"),
        _replay("lag", 400.0, 300.0, "lag-2"),
        _replay("mirror", 600.0, 200.0, "mirror-3"),
    ]
    rounds = imbalance_cost(replays)["per_round"]
    assert [r["lag"] for r in rounds] == ["lag", "lag-2"]
    assert rounds[1]["mirrors"] == ["mirror-2", "mirror-3"]
    assert math.isclose(rounds[0]["throughput"], 0.1) and math.isclose(rounds[1]["throughput"], 0.5)
    assert math.isclose(rounds[1]["ttft_mean_ratio"], 2.0)
    assert imbalance_cost([_replay("mirror", 1000.0, 1.0)]) is None
    partial = imbalance_cost([_replay("mirror", None, 1.0), _replay("lag", 5.0, 1.0)])
    assert (
        partial is not None and partial["throughput"] is None and partial["mirror_spread"] is None
    )


# ----- reusable prefix -----------------------------------------------------------------------


def test_reusable_prefix_counts_chains_seen_earlier() -> None:
    requests = [
        TraceRequest(0.0, 40, 1, (1, 2, 3)),  # first: nothing seen
        TraceRequest(0.1, 40, 1, (1, 2, 4)),  # 1, 2 seen as a chain
        TraceRequest(0.2, 40, 1, (2, 3)),  # 2 seen, but not as a chain from the start
        TraceRequest(0.3, 25, 1, (1, 2, 3, 5)),  # 1, 2, 3 seen; only 2 whole blocks fit 25 tokens
        TraceRequest(0.4, 40, 1, (1, 2, 4, 9)),  # 1, 2, 4 seen (request 1)
        TraceRequest(0.5, 30, 1, ()),
    ]
    scaling = plan_scaling(requests, 64, 10, enabled=False)  # block 10 tokens, one id each
    assert reusable_prefix_tokens(requests, scaling) == [0, 20, 0, 20, 30, 0]


def test_reusable_prefix_follows_scaled_grouped_blocks() -> None:
    """Scaled so far that two hash ids make one prompt block: a chain is reusable only where
    whole groups match."""
    requests = [
        TraceRequest(0.0, 4000, 10, (1, 2, 3, 4)),
        TraceRequest(0.1, 4000, 10, (1, 2, 3, 5)),
        TraceRequest(0.2, 4000, 10, (1, 2, 3, 4, 6, 7)),
    ]
    scaling = plan_scaling(requests, 64, 512, factor=0.005)  # 2.56 tokens per id: 2 ids per block
    assert (scaling.hash_ids_per_block, scaling.block_tokens) == (2, 5)
    scaled = scale_requests(requests, scaling)
    assert [r.input_len for r in scaled] == [20, 20, 20]
    assert reusable_prefix_tokens(scaled, scaling) == [0, 5, 10]


def test_long_prompt_mix() -> None:
    requests, _ = synthetic_requests(200, 32, 4)
    mixed = mix_long_prompts(requests, 512, 0.25, seed=1)
    lengths = [r.input_len for r in mixed]
    assert set(lengths) == {32, 512} and 20 < lengths.count(512) < 80
    assert mixed == mix_long_prompts(requests, 512, 0.25, seed=1)  # seeded
    assert [r.input_len for r in mix_long_prompts(requests, 512, 0.0)] == [32] * 200
    with pytest.raises(ValueError):
        mix_long_prompts(requests, 512, 1.5)


def test_summary_rows_and_reusable_share() -> None:
    a, b = _result(0, 0, 0.0, 0.2, prompt=40), _result(1, 0, 0.0, 0.4, prompt=40)
    a.cached_tokens, b.cached_tokens = 0, 16
    failed = serve.Result(2, 0.0, None, error="boom", prompt_tokens=40)
    summary = serve.summarize([a, b, failed], 1.0, reusable=[0, 20, 40])
    assert summary["reusable_input_tokens"] == 20  # failed requests do not count
    assert summary["cached_of_reusable"] == 16 / 20
    rows = summary["requests"]
    assert (
        [r["index"] for r in rows] == [0, 1, 2] and rows[0]["rank"] == 0 and "rank" not in rows[2]
    )
    assert math.isclose(rows[1]["ttft_ms"], 400.0) and rows[1]["cached_tokens"] == 16
    assert rows[2] == {
        "index": 2,
        "ok": False,
        "ttft_ms": None,
        "e2e_ms": None,
        "prompt_tokens": 40,
        "cached_tokens": 0,
        "output_tokens": 0,
    }
    assert serve.summarize([a], 1.0)["reusable_input_tokens"] is None


# ----- the replay loop against a mock server -------------------------------------------------


def _sse(chunks: list[dict]) -> bytes:
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return body + b"data: [DONE]\n\n"


def _mock_server(seen: list[tuple[int | None, list[int]]], dp_size: int):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 256}]})
        if request.url.path == "/mesh":
            rows = [{"role": "prefill", "rank": r, "dp_size": dp_size} for r in range(dp_size)]
            return httpx.Response(
                200, json={"instances": [*rows, {"role": "decode", "dp_size": 1}]}
            )
        body = json.loads(request.content)
        header = request.headers.get("X-Data-Parallel-Rank")
        seen.append((None if header is None else int(header), body["prompt"]))
        chunks = [{"choices": [{"index": 0, "text": "a", "finish_reason": None}]}]
        chunks.append(
            {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}}
        )
        return httpx.Response(
            200, content=_sse(chunks), headers={"content-type": "text/event-stream"}
        )

    return handler


def test_dp_replay_both_pins_every_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp_replay, "SETTLE_S", 0.0)
    seen: list[tuple[int | None, list[int]]] = []
    options = serve.ServeOptions(
        synthetic=True,
        rate=200.0,
        num_requests=4,
        input_len=24,
        output_len=1,
        progress_every=0,
        dp_replay="both",
        lag_s=0.01,
        long_input_len=48,
        long_fraction=0.5,
    )
    serve.validate(options)

    async def go() -> dict:
        transport = httpx.MockTransport(_mock_server(seen, 2))
        async with httpx.AsyncClient(transport=transport) as client:
            workload = serve.build_workload(options, 256)
            config = {"url": "http://127.0.0.1:1", "model": "m"}
            return await dp_replay.run_replays(options, client, workload, config)

    result = asyncio.run(go())
    dp = result["dp_replay"]
    assert dp["dp_size"] == 2 and [r["name"] for r in dp["replays"]] == [
        "mirror",
        "lag",
        "mirror-2",
    ]
    assert result["num_requests"] == 3 * 4 * 2 == len(seen) and result["num_errors"] == 0
    assert sorted(rank for rank, _ in seen) == [0] * 12 + [1] * 12
    assert len({tuple(p) for _, p in seen}) == 24  # no two copies share a prompt
    for replay in dp["replays"]:
        assert [k["num_completed"] for k in replay["ranks"]] == [4, 4]
        assert sorted(r["rank"] for r in replay["requests"]) == [0] * 4 + [1] * 4
        assert replay["prefill_tokens_per_s"] > 0
    cost = dp["imbalance_cost"]
    assert cost is not None and math.isfinite(cost["throughput"])
    assert math.isfinite(cost["ttft_p50_ratio"])


def test_dp_replay_options_are_checked() -> None:
    base = {"synthetic": True, "rate": 1.0}
    with pytest.raises(ValueError, match="--rate"):
        serve.validate(serve.ServeOptions(synthetic=True, concurrency=2, dp_replay="both"))
    with pytest.raises(ValueError):
        serve.validate(serve.ServeOptions(**base, dp_replay="lag", lag_s=-1.0))
    with pytest.raises(ValueError):
        serve.validate(serve.ServeOptions(**base, dp_replay="mirror", dp_size=0))
    with pytest.raises(ValueError):
        serve.validate(serve.ServeOptions(**base, dp_replay="both", dp_rounds=0))
    with pytest.raises(ValueError, match="--plot"):
        serve.validate(serve.ServeOptions(**base, plot_compare=["a.json"]))


# ----- plots ---------------------------------------------------------------------------------


def _fake_run(path: Path, ttfts: list[float], label: str | None = None, dp: bool = False) -> Path:
    rows = [{"ok": True, "ttft_ms": t, "e2e_ms": t + 5, "prompt_tokens": 8} for t in ttfts]
    rows.append({"ok": False, "ttft_ms": None})
    result: dict = {"config": {"label": label}, "requests": rows}
    if dp:
        replays = [{"name": "mirror", "requests": rows}, {"name": "lag", "requests": rows[:2]}]
        result = {"config": {"label": label}, "dp_replay": {"replays": replays}}
    path.write_text(json.dumps(result))
    return path


def test_plot_compare_writes_a_png(tmp_path: Path) -> None:
    a = _fake_run(tmp_path / "dep2.json", [10.0, 20.0, 400.0], label="DEP2")
    b = _fake_run(tmp_path / "dep4.json", [15.0, 30.0, 900.0], dp=True)
    curves = plots.compare_curves([a, b])
    assert [label for label, _ in curves] == ["DEP2", "dep4 mirror", "dep4 lag"]
    assert curves[0][1] == [10.0, 20.0, 400.0]  # completed rows only, sorted
    assert plots.is_log_scale(curves)
    out = plots.write_ttft_plot(tmp_path / "out" / "ttft.png", curves)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    with pytest.raises(ValueError):
        plots.write_ttft_plot(tmp_path / "empty.png", [("x", [])])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a bench serve"):
        plots.load_result(tmp_path / "bad.json")


def test_plot_only_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pdmesh bench serve --plot PNG --plot-compare A.json B.json` sends nothing."""
    a = _fake_run(tmp_path / "a.json", [1.0, 2.0])
    b = _fake_run(tmp_path / "b.json", [3.0, 4.0])
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--plot", str(tmp_path / "p.png"), "--plot-compare", str(a), str(b)]
    )
    assert args.run(args) == 0
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_MAGIC)
    assert "wrote" in capsys.readouterr().out
    assert plots.run_label({"config": {}}, a) == "a" and plots.run_label({}, None) == "this run"
