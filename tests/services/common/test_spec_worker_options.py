"""Speculative decoding options of workers and `pdmesh up`, and the speculation series a worker
exports."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdmesh_engine.spec_decode import SpecDecodeCounter
from pdmesh_service.worker.engine_options import (
    add_engine_options,
    add_speculative_options,
    engine_argv,
    worker_engine_config,
)
from pdmesh_service.worker.metrics import WorkerCollectors, WorkerMetrics


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    add_speculative_options(parser)
    return parser.parse_args(list(argv))


def test_workers_get_the_speculation_flags_back(tmp_path: Path) -> None:
    assert engine_argv(parse()) == []
    args = parse("--block-size", "8", "--speculative-method", "mtp")
    assert engine_argv(args) == [
        "--block-size",
        "8",
        "--speculative-method",
        "mtp",
        "--num-speculative-tokens",
        "1",
    ]
    config = worker_engine_config(parse(*engine_argv(args)))
    assert (config.speculative_method, config.num_speculative_tokens) == ("mtp", 1)
    draft = tmp_path / "draft"
    args = parse(
        "--speculative-method", "draft_model", "--num-speculative-tokens", "3",
        "--draft-model", str(draft),
    )  # fmt: skip
    assert engine_argv(args)[-6:] == [
        "--speculative-method",
        "draft_model",
        "--num-speculative-tokens",
        "3",
        "--draft-model",
        str(draft.resolve()),
    ]
    config = worker_engine_config(args)
    assert (config.speculative_method, config.num_speculative_tokens) == ("draft_model", 3)
    assert config.draft_model == str(draft)
    assert worker_engine_config(parse()).speculative_method is None
    with pytest.raises(ValueError, match="needs a speculative_method"):
        worker_engine_config(parse("--num-speculative-tokens", "2"))


def test_dep_instances_take_the_speculation_flags(tmp_path: Path) -> None:
    """`pdmesh serve prefill|decode --dep N` and `pdmesh up --prefill-dep/--decode-dep N` take the
    speculation flags (every rank drafts in lockstep)."""
    from pdmesh.launcher import MeshOptions
    from pdmesh_decode import server as decode_server
    from pdmesh_prefill import server as prefill_server

    spec = ("--speculative-method", "mtp", "--num-speculative-tokens", "2")
    for server in (decode_server, prefill_server):
        parser = argparse.ArgumentParser()
        server.add_arguments(parser)
        config = server.config_from_args(
            parser.parse_args(["--model", str(tmp_path), "--dep", "2", *spec])
        )
        assert config.dep.size == 2 and config.engine.speculative_method == "mtp"
        assert config.engine.num_speculative_tokens == 2
    options = MeshOptions(tmp_path, prefill_dep=2, decode_dep=2, worker_args=spec)
    assert options.dep("prefill") == options.dep("decode") == 2


def test_the_spec_series_follow_the_engine_totals() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics("decode-7", WorkerCollectors(registry))
    metrics.observe_spec_decode(None)  # speculation off: nothing
    assert b"pdmesh_spec_decode_verify_steps_total{" not in generate_latest(registry)
    counter = SpecDecodeCounter(2)
    counter.record(2, 1)
    metrics.observe_spec_decode(counter.stats())
    counter.record(2, 2)
    counter.record(1, 0)
    metrics.observe_spec_decode(counter.stats())
    metrics.observe_spec_decode(counter.stats())  # the same totals again: no double count

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"instance": "decode-7", **labels})

    assert value("pdmesh_spec_decode_draft_tokens_total", position="0") == 3
    assert value("pdmesh_spec_decode_draft_tokens_total", position="1") == 2
    assert value("pdmesh_spec_decode_accepted_tokens_total", position="0") == 2
    assert value("pdmesh_spec_decode_accepted_tokens_total", position="1") == 1
    assert value("pdmesh_spec_decode_verify_steps_total") == 3
    assert value("pdmesh_spec_decode_emitted_tokens_total") == 2 + 3 + 1


def test_draft_bytes_are_part_of_the_kv_bytes() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics("prefill-1", WorkerCollectors(registry))
    metrics.kv_sent(1000, 0.01, 200)
    metrics.kv_received(600, 100)
    stats = metrics.snapshot()
    assert (stats.kv_bytes_sent, stats.kv_draft_bytes_sent) == (1000, 200)
    assert (stats.kv_bytes_received, stats.kv_draft_bytes_received) == (600, 100)
    label = {"instance": "prefill-1"}
    assert registry.get_sample_value("pdmesh_kv_transfer_draft_bytes_total", label) == 200
    assert registry.get_sample_value("pdmesh_kv_received_draft_bytes_total", label) == 100
