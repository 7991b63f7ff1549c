"""`pdmesh bench chaos`: the pure parts (workload, fault schedule, stream parsing, classification,
report) and one bounded run on a real local mesh of the tiny model whose decode ranks are killed."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdmesh.cli import bench_cmd
from pdmesh.cli.main import main
from pdmesh_bench.chaos import ChaosOptions
from pdmesh_bench.chaos_core import (
    CATEGORIES,
    MIGRATIONS,
    RETRIES,
    SEEDED_TEMPERATURE,
    Case,
    ChaosRun,
    Draws,
    Fault,
    Outcome,
    Reference,
    build_cases,
    classify,
    counter_total,
    error_key,
    failures,
    fault_schedule,
    http_error,
    is_idle,
    killable,
    leak_report,
    reference_of,
    summarize,
)


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one id per byte."""
    return list(text.encode())


# ----- the workload ----------------------------------------------------------------------------


def test_cases_are_deterministic_distinct_and_in_range() -> None:
    cases = build_cases(encode, num_prompts=12, num_seeded=3, min_tokens=24, max_tokens=48, seed=5)
    assert cases == build_cases(encode, 12, 3, 24, 48, seed=5)
    assert cases != build_cases(encode, 12, 3, 24, 48, seed=6)
    assert [c.index for c in cases] == list(range(15))
    greedy, seeded = cases[:12], cases[12:]
    assert len({c.prompt for c in greedy}) == 12
    assert len({len(c.prompt) for c in greedy}) > 3  # varied lengths
    assert all(c.temperature == 0 and c.seed is None for c in greedy)
    assert all(c.temperature == SEEDED_TEMPERATURE for c in seeded)
    assert len({c.seed for c in seeded}) == 3 and None not in {c.seed for c in seeded}
    assert [c.prompt for c in seeded] == [c.prompt for c in greedy[:3]]
    assert all(24 <= c.max_tokens <= 48 for c in cases)


def test_case_body_streams_with_usage_and_ignores_eos() -> None:
    greedy = Case(0, (5, 6, 7), 30).body("tiny")
    assert greedy == {
        "model": "tiny",
        "prompt": [5, 6, 7],
        "max_tokens": 30,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert Case(1, (5,), 8, 0.8, 1001).body("tiny")["seed"] == 1001


def test_draws_abort_only_the_asked_fraction_and_mid_stream() -> None:
    cases = [Case(i, (i + 1,), 10) for i in range(4)]
    never = Draws(random.Random(0), cases, 0.0)
    assert all(never.next()[1] is None for _ in range(200))
    always = Draws(random.Random(0), cases, 1.0)
    points = [always.next()[1] for _ in range(200)]
    assert all(p is not None and 1 <= p < 10 for p in points)
    some = [Draws(random.Random(s), cases, 0.5).next()[1] is None for s in range(400)]
    assert 0.35 < sum(some) / len(some) < 0.65
    first = Draws(random.Random(3), cases, 0.5)
    second = Draws(random.Random(3), cases, 0.5)
    assert [first.next() for _ in range(20)] == [second.next() for _ in range(20)]


def test_fault_schedule_is_seeded_and_inside_the_load() -> None:
    plan = fault_schedule(["decode", "prefill", "redis"], every_s=4, duration_s=12, seed=1)
    assert [f.at_s for f in plan] == [4, 8]
    long = fault_schedule(["decode", "prefill", "redis"], every_s=1, duration_s=60.5, seed=1)
    assert len(long) == 60 and {f.role for f in long} == {"decode", "prefill", "redis"}
    assert long == fault_schedule(["decode", "prefill", "redis"], 1, 60.5, seed=1)
    assert long != fault_schedule(["decode", "prefill", "redis"], 1, 60.5, seed=2)
    assert fault_schedule(["decode"], every_s=10, duration_s=10, seed=0) == []
    assert fault_schedule([], every_s=1, duration_s=10, seed=0) == []  # --kill none


def test_kill_none_means_load_without_faults_and_unknown_roles_are_refused() -> None:
    from pdmesh_bench.chaos import ChaosOptions, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    quiet = ChaosOptions.from_args(parser.parse_args(["chaos", "--model", "m", "--kill", "none"]))
    assert quiet.kill == ()
    quiet.validate()
    odd = ChaosOptions.from_args(parser.parse_args(["chaos", "--model", "m", "--kill", "gpu"]))
    with pytest.raises(ValueError, match="--kill"):
        odd.validate()


def test_a_kill_leaves_a_serving_peer_and_prefers_serving_victims() -> None:
    assert killable(["kvstore-0"], live=["kvstore-0"], serving=[]) == ["kvstore-0"]
    assert killable(["kvstore-0"], live=[], serving=[]) == []
    pair = ["decode-0", "decode-1"]
    assert killable(pair, live=pair, serving=pair) == pair
    # decode-0 is restarting: decode-1 is the only one SERVING, so it is spared
    assert killable(pair, live=pair, serving=["decode-1"]) == ["decode-0"]
    assert killable(pair, live=["decode-1"], serving=["decode-1"]) == []
    trio = ["p-0", "p-1", "p-2"]
    assert killable(trio, live=trio, serving=["p-1", "p-2"]) == ["p-1", "p-2"]


# ----- one request -----------------------------------------------------------------------------


def _chunk(text: str | None = None, usage: dict | None = None) -> str:
    body: dict = {"choices": [{"index": 0, "text": text}] if text is not None else []}
    if usage:
        body["usage"] = usage
    return "data: " + json.dumps(body)


def _streamed(lines: list[str]) -> Outcome:
    outcome = Outcome(0, 0.0)
    for line in lines:
        if not outcome.apply(line):
            break
    return outcome


def test_a_stream_accumulates_text_and_usage_up_to_done() -> None:
    outcome = _streamed(
        [
            ": keep-alive",
            _chunk("Hel"),
            "",
            _chunk("lo"),
            _chunk(""),
            _chunk(None, {"prompt_tokens": 3, "completion_tokens": 2}),
            "data: [DONE]",
            _chunk("after the end"),
        ]
    )
    assert (outcome.text, outcome.num_chunks, outcome.done) == ("Hello", 2, True)
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (3, 2)
    assert outcome.error is None


def test_an_error_event_ends_the_stream() -> None:
    event = 'data: {"error": {"message": "decode-1 is gone", "type": "unavailable"}}'
    outcome = _streamed([_chunk("a"), event, "data: [DONE]"])
    assert outcome.error == "error event: decode-1 is gone" and not outcome.done


def _case_and_reference() -> tuple[Case, Reference]:
    return Case(0, (1, 2, 3), 4), Reference("abcd", 3, 4)


def _completed(text: str = "abcd", prompt: int = 3, completion: int = 4) -> Outcome:
    return Outcome(0, 0.0, 1.0, text, prompt, completion, num_chunks=4, done=True)


def test_classification_of_every_kind_of_end() -> None:
    case, reference = _case_and_reference()
    assert classify(_completed(), case, reference) == "completed_correct"
    assert classify(_completed(text="abce"), case, reference) == "completed_wrong"
    assert classify(_completed(completion=5), case, reference) == "completed_wrong"
    assert classify(_completed(prompt=2), case, reference) == "completed_wrong"
    assert classify(Outcome(0, 0.0, error="HTTP 503: x"), case, reference) == "errored"
    assert classify(Outcome(0, 0.0, text="ab"), case, reference) == "errored"  # no [DONE]
    assert classify(Outcome(0, 0.0, hung=True), case, reference) == "hung"
    assert classify(Outcome(0, 0.0, text="ab", aborted=True), case, reference) == "aborted"


def test_a_reference_must_have_completed_in_full() -> None:
    case, _ = _case_and_reference()
    assert reference_of(_completed(), case) == Reference("abcd", 3, 4)
    with pytest.raises(ValueError, match="completion"):
        reference_of(_completed(completion=3), case)
    with pytest.raises(ValueError, match="HTTP 500"):
        reference_of(Outcome(0, 0.0, error="HTTP 500: boom"), case)
    with pytest.raises(ValueError):
        reference_of(Outcome(0, 0.0, text="abcd"), case)  # no [DONE]


def test_error_messages_are_read_and_grouped() -> None:
    body = b'{"error": {"message": "no decode rank is ready", "type": "unavailable"}}'
    assert http_error(503, body) == "HTTP 503: no decode rank is ready"
    assert http_error(502, b"<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"
    one = "HTTP 409: a live hand-off for request 'cmpl-9f2c1d0e4b7a' already exists"
    two = "HTTP 409: a live hand-off for request 'cmpl-0123456789ab' already exists"
    assert error_key(one) == error_key(two) != error_key("HTTP 503: no decode rank is ready")


def test_counters_are_read_from_a_prometheus_exposition() -> None:
    text = "\n".join(
        [
            f"# HELP {MIGRATIONS} Streams moved to another decode rank",
            f"# TYPE {MIGRATIONS} counter",
            f'{MIGRATIONS}{{reason="unavailable"}} 2.0',
            f'{MIGRATIONS}{{reason="deadline"}} 1.0',
            "pdmesh_gateway_migrations_created 1.7e9",
            "pdmesh_requests_total 40.0",
        ]
    )
    assert counter_total(text, MIGRATIONS) == 3.0
    assert counter_total(text, RETRIES) is None
    assert counter_total("", MIGRATIONS) is None


# ----- the report ------------------------------------------------------------------------------


def _status(**fields: object) -> SimpleNamespace:
    base = {"num_running": 0, "num_waiting": 0, "kv_blocks_used": 0, "integrity_error": ""}
    return SimpleNamespace(**{**base, **fields})


def test_leak_report_names_leaks_busy_and_unreachable_ranks() -> None:
    statuses = {
        "decode-0": _status(kv_blocks_used=3),
        "decode-1": _status(num_running=1, kv_blocks_used=2),
        "prefill-0": None,
        "prefill-1": _status(integrity_error="block 7 is free and held"),
    }
    leak = leak_report(statuses, 30.0)
    assert leak["leaked_blocks"] == {"decode-0": 3, "decode-1": 2, "prefill-1": 0}
    assert leak["unreachable"] == ["prefill-0"] and leak["busy"] == ["decode-1"]
    assert leak["integrity_errors"] == {"prefill-1": "block 7 is free and held"}
    assert leak["ranks"]["prefill-0"] is None and leak["ranks"]["decode-0"]["kv_blocks_used"] == 3
    assert [is_idle(s) for s in statuses.values()] == [False, False, False, True]


def _run() -> ChaosRun:
    case, reference = _case_and_reference()
    run = ChaosRun({0: case}, {0: reference}, duration_s=20.0)
    run.outcomes = [
        Outcome(0, 0.0, 1.0, "abcd", 3, 4, 4, True),  # before the fault
        Outcome(0, 4.0, 6.0, "abcd", 3, 4, 4, True),  # across the fault at 5 s
        Outcome(0, 7.0, 8.0, "abcd", 3, 4, 4, True),
        Outcome(0, 4.5, 5.5, aborted=True),
    ]
    run.faults = [Fault(5.0, "decode", "decode-0", 1234, True), Fault(10.0, "decode", None)]
    run.leak = leak_report({"decode-0": _status(), "decode-1": _status()}, 0.5)
    run.counters_before = {MIGRATIONS: 2.0, RETRIES: None}
    run.counters_after = {MIGRATIONS: 5.0, RETRIES: None}
    run.restarts = {"decode-0": 1}
    return run


def test_a_clean_run_passes_and_splits_latency_by_fault() -> None:
    report = summarize(_run())
    assert report["failures"] == []
    assert {c: report[c] for c in CATEGORIES} == {
        "completed_correct": 3,
        "completed_wrong": 0,
        "errored": 0,
        "hung": 0,
        "aborted": 1,
    }
    assert report["sent"] == 4 and report["migrated"] == 3.0 and report["retried"] is None
    assert report["faults"]["injected"] == 1 and report["faults"]["skipped"] == 1
    assert report["faults"]["per_role"] == {"decode": 1}
    assert report["latency_ms"]["during_faults"] == {"count": 1, "p50": 2000.0, "p99": 2000.0}
    outside = report["latency_ms"]["outside_faults"]
    assert outside["count"] == 2 and outside["p50"] == pytest.approx(1000.0)
    assert report["leaked_blocks"] == {"decode-0": 0, "decode-1": 0}
    assert report["restarts"] == {"decode-0": 1}
    json.dumps(report)  # the report is plain JSON


def test_losses_and_leaks_fail_the_run() -> None:
    run = _run()
    run.outcomes += [
        Outcome(0, 9.0, 9.5, "abXd", 3, 4, 4, True),
        Outcome(0, 9.0, 9.5, error="HTTP 503: no decode rank is ready"),
        Outcome(0, 9.0, 9.5, error="HTTP 503: no decode rank is ready"),
        Outcome(0, 9.0, 129.0, hung=True),
    ]
    run.leak = leak_report({"decode-0": _status(kv_blocks_used=4), "decode-1": None}, 30.0)
    report = summarize(run)
    assert (report["completed_wrong"], report["errored"], report["hung"]) == (1, 2, 1)
    assert report["errors_by_message"] == {"HTTP 503: no decode rank is ready": 2}
    assert report["wrong_examples"] == [
        {"case": 0, "why": "text differs from the reference at character 2", "during_fault": False}
    ]
    reasons = " | ".join(report["failures"])
    for part in ("1 completed_wrong", "1 hung", "2 errored", "leaked blocks", "unreachable"):
        assert part in reasons
    assert "the leak check did not run" in failures({**report, "leak_check": {}})


# ----- options and the command -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"host": "10.1.2.3"}, "non-loopback"),
        ({"kill": ("gateway",)}, "--kill"),
        ({"mode": "agg", "kill": ("prefill",)}, "disagg"),
        ({"abort_fraction": 1.5}, "abort-fraction"),
        ({"every": 0}, "--every"),
        ({"min_tokens": 50, "max_tokens": 40}, "min-tokens"),
    ],
)
def test_bad_options_are_refused(changes: dict, message: str) -> None:
    ChaosOptions("model").validate()
    with pytest.raises(ValueError, match=message):
        ChaosOptions("model", **changes).validate()


def test_the_command_is_registered(capsys: pytest.CaptureFixture) -> None:
    assert "chaos" in bench_cmd.BENCHMARKS
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "chaos", "--help"])
    assert exit_info.value.code == 0
    assert "--abort-fraction" in capsys.readouterr().out


# ----- a real mesh -----------------------------------------------------------------------------

# The end-to-end meshes' engine options (tests/integration/meshlib.py): small KV pools so leaks
# show up, a small token budget so chunked prefill happens.
WORKER_ARGS = (
    "--block-size 8 --num-blocks 160 --max-num-batched-tokens 64 --max-num-seqs 16 "
    "--torch-threads 1"
)


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    from pdmesh.tools.model_init import init_model

    root = tmp_path_factory.mktemp("bench_chaos")
    model = init_model(root / "tiny", preset="tiny", seed=0, verbose=False)
    out = root / "chaos.json"
    code = main(
        [
            "bench",
            "chaos",
            "--model",
            str(model),
            "--kill",
            "decode",
            "--every",
            "4",
            "--duration",
            "12",
            "--concurrency",
            "4",
            "--num-prompts",
            "8",
            "--num-seeded",
            "2",
            "--timeout-s",
            "30",
            f"--worker-args={WORKER_ARGS}",
            "--log-dir",
            str(root / "logs"),
            "--out",
            str(out),
        ]
    )
    return code, json.loads(Path(out).read_text())


@pytest.mark.timeout(300)
def test_killing_decode_ranks_under_load(chaos_run: tuple[int, dict]) -> None:
    code, report = chaos_run
    assert code == (1 if report["failures"] else 0)
    for key in (*CATEGORIES, "sent", "migrated", "retried", "errors_by_message", "restarts"):
        assert key in report
    assert report["sent"] == sum(report[c] for c in CATEGORIES) > 0
    assert report["aborted"] == 0  # no --abort-fraction
    faults = report["faults"]
    assert faults["per_role"].get("decode", 0) == faults["injected"] >= 1
    killed = {e["name"] for e in faults["events"] if e["name"]}
    assert killed <= {"decode-0", "decode-1"}
    assert sum(report["restarts"].get(name, 0) for name in killed) >= 1
    leak = report["leak_check"]
    assert leak["ran"] and not leak["unreachable"]
    assert set(leak["ranks"]) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert all(r["kv_blocks_total"] > 0 for r in leak["ranks"].values())
    # the zero-loss promise in part: nothing wrong, nothing leaked (errors: see the report)
    assert report["completed_wrong"] == 0, report["wrong_examples"]
    assert report["completed_correct"] > 0
    assert sum(report["leaked_blocks"].values()) == 0, report["leaked_blocks"]
    assert report["hung"] == 0
