"""`pdmesh bench routing`: its policies, how it reads the load's options, and its report."""

from __future__ import annotations

import pytest

from pdmesh_bench.routing import computed_tokens, policies, print_report, serve_options


def test_policies_put_the_baseline_first_and_set_the_gateway() -> None:
    prefill = policies("prefill", "auto")
    assert [p.name for p in prefill] == ["least-loaded", "cache-aware"]
    assert prefill[0].gateway_args == ("--prefill-routing", "least-loaded")
    disagg = {p.name: p for p in policies("disagg", "128")}
    assert list(disagg) == ["always", "never", "conditional"]
    assert disagg["never"].mode == "agg" and not disagg["never"].uses_prefill
    assert disagg["conditional"].gateway_args == ("--local-prefill-tokens", "128")
    with pytest.raises(ValueError, match="--compare"):
        policies("decode", "auto")


def test_the_load_is_bench_serve_options() -> None:
    load = serve_options("--synthetic --num-requests 7 --concurrency 3 --input-len 99")
    assert (load.synthetic, load.num_requests, load.concurrency, load.input_len) == (
        True,
        7,
        3,
        99,
    )
    with pytest.raises(SystemExit):
        serve_options("--no-such-option")


def _result(ttft_p90: float, cached: int, paths: dict[str, int]) -> dict:
    return {
        "num_completed": 4,
        "num_requests": 4,
        "ttft_ms": {"p50": ttft_p90 / 2, "p90": ttft_p90},
        "e2e_ms": {"p90": ttft_p90 * 2},
        "output_tokens_per_s": 10.0,
        "cache_hit_ratio": cached / 1000,
        "cached_of_reusable": cached / 800,
        "input_tokens": 1000,
        "cached_input_tokens": cached,
        "routing": {"prefill_paths": paths},
    }


def test_the_report_compares_every_policy_with_the_first(capsys) -> None:
    report = {
        "compare": "prefill",
        "config": {"serve": "--synthetic"},
        "policies": {
            "least-loaded": _result(900.0, 200, {"disagg": 4}),
            "cache-aware": _result(300.0, 700, {"disagg": 3, "local": 1}),
        },
    }
    print_report(report)
    out = capsys.readouterr().out
    assert "cache-aware vs least-loaded: TTFT p50 3.00x better, p90 3.00x better" in out
    assert "prompt tokens computed 0.38x" in out  # 300 / 800
    assert "disagg 3, local 1" in out
    assert computed_tokens(report["policies"]["cache-aware"]) == 300
