"""The decode roofline's arithmetic (`pdmesh_bench.machine`): fractions of the peaks, and of the
memory peak measured beside the runs."""

from __future__ import annotations

import pytest

from pdmesh_bench.machine import DecodeCostModel, MachinePeaks, memory_beside, roofline

COST = DecodeCostModel(
    dense_params=1000,
    lm_head_params=500,
    hidden_size=10,
    params_per_expert=100,
    num_moe_layers=2,
    num_experts=8,
    top_k=2,
    num_layers=3,
    num_heads=2,
    kv_lora_rank=4,
    rope_dim=2,
    bytes_per_param=2,
    kv_bytes_per_token=12,
)
PEAKS = MachinePeaks(1e9, 1e6, 512, 32, 2, 3)


def test_memory_beside_weights_each_run_by_its_seconds() -> None:
    # run 1: 1 s at (10 + 30) / 2 = 20; run 2: 3 s at (40 + 40) / 2 = 40 -> (20 + 120) / 4
    assert memory_beside([(1.0, 10.0, 30.0), (3.0, 40.0, 40.0)]) == pytest.approx(35.0)
    assert memory_beside([]) is None
    assert memory_beside([(0.0, 1.0, 1.0)]) is None


def test_roofline_fractions_of_the_start_and_beside_peaks() -> None:
    steps = [(0.5, [3, 5]), (0.25, [4, 6])]
    nbytes = COST.bytes([3, 5]) + COST.bytes([4, 6])
    got = roofline(COST, steps, PEAKS, memory_beside=2e6)
    assert got["decode_bytes_per_s"] == pytest.approx(nbytes / 0.75)
    assert got["bandwidth_fraction_of_peak"] == pytest.approx(nbytes / 0.75 / 1e6)
    assert got["bandwidth_fraction_beside"] == pytest.approx(nbytes / 0.75 / 2e6)
    assert got["memory_bytes_per_s_beside"] == 2e6
    plain = roofline(COST, steps, PEAKS)
    assert "bandwidth_fraction_beside" not in plain
    assert plain["bandwidth_fraction_of_peak"] == got["bandwidth_fraction_of_peak"]
    assert roofline(COST, [], PEAKS) == {}


def test_measure_memory_again_measures_a_positive_rate() -> None:
    assert PEAKS.measure_memory_again() > 0
