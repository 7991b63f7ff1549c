"""Smoke tests of `pdmesh bench engine` and `pdmesh bench forward` in `--quick` mode on the tiny
preset."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdmesh.cli.main import main
from pdmesh_kernels import cpu_layers


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_bench_engine_quick(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "engine.json"
    assert (
        main(
            [
                "bench",
                "engine",
                "--model",
                str(tiny_model),
                "--quick",
                "--torch-threads",
                "1",
                "--rounds",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        for key in (
            "engine_tokens_per_s",
            "hf_tokens_per_s",
            "ratio",
            "engine_prefill_s",
            "hf_prefill_s",
            "engine_decode_step_ms_median",
            "hf_decode_step_ms_median",
        ):
            assert _positive(r[key]), (key, r[key])
        assert r["ratio"] == pytest.approx(r["engine_tokens_per_s"] / r["hf_tokens_per_s"])
        assert r["output_tokens"] == r["concurrency"] * report["output_len"]
        assert len(r["engine_seconds"]) == len(r["hf_seconds"]) == r["rounds"] == 2
        assert 0 <= r["outputs_match"] <= r["concurrency"]
        assert _positive(r["roofline"]["flops_fraction_of_peak"])
        assert _positive(r["roofline"]["bandwidth_fraction_of_peak"])
        assert len(r["memory_bytes_per_s_beside"]) == 2
        assert all(_positive(v) for pair in r["memory_bytes_per_s_beside"] for v in pair)
        beside = r["roofline"]["memory_bytes_per_s_beside"]
        assert min(min(p) for p in r["memory_bytes_per_s_beside"]) <= beside
        assert beside <= max(max(p) for p in r["memory_bytes_per_s_beside"])
        assert r["roofline"]["bandwidth_fraction_beside"] == pytest.approx(
            r["roofline"]["decode_bytes_per_s"] / beside
        )
    assert _positive(report["machine"]["matmul_flops_per_s"])
    assert _positive(report["machine"]["memory_bytes_per_s"])
    assert _positive(report["kv_bytes_per_token"])
    assert _positive(report["memory"]["peak_rss_bytes"])
    assert _positive(report["memory"]["after_engine_load"]["rss_bytes"])
    assert "ratio" in capsys.readouterr().out


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_bench_forward_quick(
    tiny_model: Path,
    tmp_path: Path,
    phase: str,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDMESH_CPU_LAYERS", "0")  # the torch path, whose modules profile
    out = tmp_path / "forward.json"
    argv = [
        "bench",
        "forward",
        "--model",
        str(tiny_model),
        "--quick",
        "--phase",
        phase,
        "--json",
        str(out),
    ]
    assert main(argv + (["--profile"] if phase == "decode" else [])) == 0
    result = json.loads(out.read_text())
    assert result["phase"] == phase and result["layer_path"] == "torch"
    assert result["num_tokens"] == result["batch"] * (1 if phase == "decode" else result["context"])
    for key in ("median_ms", "p90_ms", "tokens_per_s", "kv_bytes_per_token"):
        assert _positive(result[key]), (key, result[key])
    assert result["p90_ms"] >= result["median_ms"]
    if phase == "decode":
        assert _positive(result["roofline"]["flops_fraction_of_peak"])
        assert result["top_ops"] and all(
            "self_cpu_ms_per_forward" in op for op in result["top_ops"]
        )
        assert "attention" in result["module_ms_per_forward"]
        ops = result["op_counts"]
        assert ops["total"] >= sum(ops["per_layer"]) > 0 and ops["moe_layer"] > ops["dense_layer"]
        assert "Self CPU" in capsys.readouterr().out


@pytest.mark.skipif(cpu_layers.library() is None, reason="no C compiler: no CPU layer path")
def test_bench_forward_on_the_c_layer_path(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "forward.json"
    argv = ["bench", "forward", "--model", str(tiny_model), "--quick", "--phase", "decode"]
    assert main([*argv, "--profile", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["layer_path"] == "c" and _positive(result["median_ms"])
    ops = result["op_counts"]  # the layers run in one C call: no aten op inside any layer
    assert sum(ops["per_layer"]) == 0 and 0 < ops["total"] <= 12


def test_bench_forward_profiles_every_part_of_a_v4_step(tmp_path: Path) -> None:
    """On DeepSeek-V4 the profile splits the step into each attention kind, the indexer, the
    compressors, the hyper-connections and the MoE."""
    from pdmesh.tools.model_init import init_model

    model = init_model(tmp_path / "v4", "tiny", arch="deepseek_v4", verbose=False)
    out = tmp_path / "forward.json"
    argv = ["bench", "forward", "--model", str(model), "--quick", "--phase", "decode"]
    assert main([*argv, "--context", "80", "--profile", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert _positive(result["median_ms"]) and _positive(result["kv_bytes_per_token"])
    parts = result["module_ms_per_forward"]
    for part in (
        "attention (sliding)",
        "attention (compressed)",
        "attention (heavily)",
        "attention.indexer (scores + top-k)",
        "attention.compressors (kv and indexer keys)",
        "mhc (hyper-connection weights, Sinkhorn)",
        "moe (router + experts + shared)",
    ):
        assert _positive(parts.get(part, 0.0)), (part, sorted(parts))


def test_bench_engine_against_transformers_on_v4(tmp_path: Path) -> None:
    """The V4 engine against transformers' DeepseekV4ForCausalLM: same greedy tokens."""
    pytest.importorskip("transformers")
    from pdmesh.tools.model_init import init_model

    model = init_model(tmp_path / "v4", "tiny", arch="deepseek_v4", verbose=False)
    out = tmp_path / "engine.json"
    argv = ["bench", "engine", "--model", str(model), "--quick", "--torch-threads", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["hf"]["class"] == "DeepseekV4ForCausalLM"
    for r in report["results"]:
        assert r["outputs_match"] == r["concurrency"]
        assert _positive(r["engine_tokens_per_s"]) and _positive(r["hf_tokens_per_s"])
        assert r["roofline"] is None  # the decode cost model is MLA's
