"""Reading llama.cpp's llama-batched-bench (for `bench engine --against llama.cpp`): its table, and
a run of a stand-in binary that prints the table for the arguments it was given."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from pdmesh_bench.llamacpp import batched_bench_argv, parse_batched_bench, run_batched_bench

TABLE = """
main: n_kv_max = 8256, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   256 |    128 |    1 |    384 |    0.123 |  2081.30 |    0.940 |   136.17 |    1.063 |   361.24 |
|   256 |    128 |   32 |  12288 |    3.900 |  2100.51 |   14.321 |   286.01 |   18.221 |   674.40 |
"""


def test_the_table_rows_are_read() -> None:
    one, many = parse_batched_bench(TABLE)
    assert (one.prompt_len, one.output_len, one.batch) == (256, 128, 1)
    assert one.decode_tokens_per_s == 136.17 and one.step_ms == pytest.approx(7.34, abs=0.01)
    assert many.batch == 32 and many.decode_tokens_per_s == 286.01
    with pytest.raises(ValueError, match="no result rows"):
        parse_batched_bench("error: failed to load model")


FAKE = """#!{python}
import sys
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
pp, tg = int(value("-npp")), int(value("-ntg"))
print("| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |")
for b in value("-npl").split(","):
    b = int(b)
    t_tg = tg * 0.01 * (1 + b / 8)  # a step of 10 ms, longer with the batch
    speed = b * tg / t_tg
    print(f"| {{pp}} | {{tg}} | {{b}} | 0 | 0.1 | 100.0 | {{t_tg:.3f}} | {{speed:.2f}} | 1 | 1 |")
"""


def test_a_run_passes_the_workload_and_returns_a_row_per_concurrency(tmp_path: Path) -> None:
    binary = tmp_path / "llama-batched-bench"
    binary.write_text(FAKE.format(python=sys.executable))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    rows = run_batched_bench(binary, tmp_path / "m.gguf", 64, 16, [1, 8], threads=2)
    assert sorted(rows) == [1, 8]
    assert rows[1].prompt_len == 64 and rows[1].output_len == 16
    assert rows[8].step_ms == pytest.approx(20.0, abs=0.1)
    assert rows[8].decode_tokens_per_s == pytest.approx(8 * 16 / 0.32, rel=1e-3)
    argv = batched_bench_argv(binary, tmp_path / "m.gguf", 64, 16, [1, 8], threads=2)
    assert argv[argv.index("-t") + 1] == "2" and int(argv[argv.index("-c") + 1]) >= 8 * 80


def test_a_failing_binary_is_an_error(tmp_path: Path) -> None:
    binary = tmp_path / "broken"
    binary.write_text("#!/bin/sh\necho 'cannot open model' >&2\nexit 3\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="exited with 3: cannot open model"):
        run_batched_bench(binary, tmp_path / "m.gguf", 8, 4, [1], threads=1)


def test_bench_engine_against_llama_cpp_puts_its_figures_beside_ours(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pytest.importorskip("transformers")
    import json

    import torch

    from pdmesh.cli.main import main
    from pdmesh.tools.model_init import init_model

    model = init_model(tmp_path / "tiny", "tiny")
    binary = tmp_path / "llama-batched-bench"
    binary.write_text(FAKE.format(python=sys.executable))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "engine.json"
    threads = torch.get_num_threads()
    argv = ["bench", "engine", "--model", str(model), "--quick", "--torch-threads", "1"]
    against = ["--against", "llama.cpp", "--llama-batched-bench", str(binary)]
    try:
        assert main([*argv, *against]) != 0  # no GGUF: refused before any work
        assert "--gguf" in capsys.readouterr().err
        assert main([*argv, *against, "--gguf", str(tmp_path / "m.gguf"), "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    for row in json.loads(out.read_text())["results"]:
        c = row["concurrency"]
        assert row["llamacpp_decode_step_ms"] == pytest.approx(10 * (1 + c / 8), rel=1e-3)
        assert row["engine_decode_tokens_per_s"] == pytest.approx(
            c * 1e3 / row["engine_decode_step_ms_median"]
        )
        assert row["decode_ratio_vs_llamacpp"] == pytest.approx(
            row["engine_decode_tokens_per_s"] / row["llamacpp_decode_tokens_per_s"]
        )
    assert "llama.cpp tok/s" in capsys.readouterr().out
