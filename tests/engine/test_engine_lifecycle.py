"""The engine end to end on a tiny random-weight checkpoint: abort, preemption, LLM.generate and the
CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh.cli.main import main as cli_main
from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
LLM_CONFIG = dict(num_blocks=256, block_size=16)  # the CLI runs with the same flags
CLI_ENGINE_FLAGS = ["--num-blocks", "256", "--block-size", "16"]
PROMPTS = ["Hello world", "The sky is", "def f(x):", "Return the number of", "é ü ñ 日本", "a"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pdmesh.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("engine") / "tiny", preset="tiny", seed=0, verbose=False
    )


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, EngineConfig(**LLM_CONFIG))


def prompt_ids(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 1000 + 4 for i in range(n)]  # ids 4.. (0-3 are special tokens)


def drive(
    engine: EngineCore, after_step=None, max_steps: int = 1000
) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step until done, checking block integrity after every step."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for n in range(max_steps):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
        engine.check_integrity()
        if after_step is not None:
            after_step(n)
    assert not engine.has_unfinished
    engine.check_integrity()
    assert engine.kv_stats().num_used == 0
    return tokens, reasons


def reference(
    model_dir: Path, prompts: dict[str, list[int]], params: dict[str, SamplingParams]
) -> dict[str, list[int]]:
    """The same requests alone on a roomy engine."""
    engine = EngineCore(model_dir, EngineConfig(block_size=4, num_blocks=512))
    for rid, ids in prompts.items():
        engine.add_request(ids, params[rid], request_id=rid)
    tokens, reasons = drive(engine)
    assert set(reasons) == set(prompts)
    return tokens


# ----- EngineCore: abort and preemption -----


def test_abort_mid_prefill_and_mid_decode_returns_every_block(model_dir: Path) -> None:
    engine = EngineCore(
        model_dir, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16)
    )
    prompts = {
        "long": prompt_ids(40, 1),
        "p1": prompt_ids(5, 2),
        "p2": prompt_ids(9, 3),
        "p3": prompt_ids(12, 4),
        "gone": prompt_ids(6, 5),
    }
    params = {rid: SamplingParams(max_tokens=10, **GREEDY) for rid in prompts}
    for rid, ids in prompts.items():
        assert engine.add_request(ids, params[rid], request_id=rid) == rid
    assert engine.abort("gone")  # aborted while waiting
    requests = dict(engine.scheduler.requests)
    aborted: dict[str, int] = {}

    def after_step(n: int) -> None:
        long_req, p2 = requests["long"], requests["p2"]
        if "long" not in aborted and 0 < long_req.num_computed_tokens < 40:
            assert engine.abort("long")  # between two prefill chunks
            aborted["long"] = long_req.num_computed_tokens
        if "p2" not in aborted and p2.num_output_tokens >= 3:
            assert engine.abort("p2")  # while decoding
            aborted["p2"] = p2.num_output_tokens
        engine.check_integrity()

    tokens, reasons = drive(engine, after_step)
    assert set(aborted) == {"long", "p2"} and aborted["p2"] < 10
    assert reasons == {"p1": "length", "p3": "length"}
    assert "gone" not in tokens and "long" not in tokens
    assert not engine.abort("long") and not engine.abort("no-such-request")
    # the survivors' KV was not disturbed by the aborted neighbours
    survivors = {rid: prompts[rid] for rid in ("p1", "p3")}
    assert {rid: tokens[rid] for rid in survivors} == reference(model_dir, survivors, params)
    assert engine.kv_stats().num_used == 0


def test_preemption_with_few_blocks_finishes_everything(model_dir: Path) -> None:
    engine = EngineCore(
        model_dir, EngineConfig(block_size=4, num_blocks=10, max_num_batched_tokens=32)
    )
    assert engine.max_model_len == 40  # capped by the pool
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        preempted.extend(out.preempted_ids)
        return out

    engine.scheduler.schedule = spy
    prompts = {f"r{i}": prompt_ids(6 + 2 * i, 10 + i) for i in range(4)}
    params = {rid: SamplingParams(max_tokens=14, **GREEDY) for rid in prompts}
    params["r3"] = SamplingParams(max_tokens=14, temperature=1.0, seed=7, ignore_eos=True)
    for rid, ids in prompts.items():
        engine.add_request(ids, params[rid], request_id=rid)
    tokens, reasons = drive(engine)
    assert preempted, "the pool was never short"
    assert reasons == {rid: "length" for rid in prompts}
    assert all(len(t) == 14 for t in tokens.values())
    # recomputation after preemption gives what an unpressured engine gives (seeded row included)
    assert tokens == reference(model_dir, prompts, params)


def test_engine_rejects_bad_requests(model_dir: Path) -> None:
    engine = EngineCore(model_dir, EngineConfig(block_size=4, num_blocks=8))
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="context"):
        engine.add_request(prompt_ids(32, 0), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([5, 1024], SamplingParams())
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request([5], SamplingParams(stop_token_ids=[4096]))
    engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], SamplingParams(), request_id="x")
    tokens, reasons = drive(engine)
    assert list(tokens) == ["x"] and len(tokens["x"]) <= 2


# ----- LLM.generate -----


def test_generate_text_matches_decoded_token_ids(llm: LLM) -> None:
    params = [
        SamplingParams(max_tokens=1 + (5 * i) % 12, temperature=1.0, seed=100 + i)
        for i in range(len(PROMPTS))
    ]
    outs = llm.generate(PROMPTS, params)
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in PROMPTS]
    for out, p in zip(outs, params, strict=True):
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert 0 < len(out.token_ids) <= p.max_tokens
        assert out.finish_reason in ("length", "stop")
        assert (out.finish_reason == "length") == (
            len(out.token_ids) == p.max_tokens and out.token_ids[-1] != 1
        )
    assert llm.engine.kv_stats().num_used == 0
    llm.engine.check_integrity()


def _stop_candidate(text: str) -> str:
    for k in range(2, len(text) - 3):
        s = text[k : k + 3]
        if "\ufffd" not in s and s.strip() and text.find(s) >= 1:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_truncate_text_and_finish_with_stop(llm: LLM) -> None:
    prompt = "The sky is"
    ref = llm.generate(prompt, SamplingParams(max_tokens=16, **GREEDY))[0]
    stop = _stop_candidate(ref.text)
    index = ref.text.find(stop)
    later = ref.text[-2:] if ref.text.find(ref.text[-2:]) > index else "\x00never"

    out = llm.generate(prompt, SamplingParams(max_tokens=16, stop=[later, stop], **GREEDY))[0]
    assert out.text == ref.text[:index]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    assert llm.tokenizer.decode(out.token_ids).startswith(ref.text[:index] + stop)
    # generation ended at the token completing it
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])

    kept = llm.generate(
        prompt, SamplingParams(max_tokens=16, stop=stop, include_stop_str_in_output=True, **GREEDY)
    )[0]
    assert kept.text == ref.text[: index + len(stop)]
    assert kept.token_ids == out.token_ids and kept.finish_reason == "stop"

    # a stop string that never appears changes nothing
    same = llm.generate(prompt, SamplingParams(max_tokens=16, stop="\x00never", **GREEDY))[0]
    assert (same.text, same.token_ids, same.finish_reason) == (ref.text, ref.token_ids, "length")
    assert llm.engine.kv_stats().num_used == 0


def test_min_tokens_defers_stop_tokens(llm: LLM) -> None:
    prompt = "Return the number of"
    ref = llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))[0]
    stops = sorted(set(ref.token_ids))
    first = llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=stops, **GREEDY))[0]
    assert (first.token_ids, first.finish_reason, first.stop_reason) == (
        ref.token_ids[:1],
        "stop",
        ref.token_ids[0],
    )

    out = llm.generate(
        prompt,
        SamplingParams(
            max_tokens=12, min_tokens=5, stop_token_ids=stops, temperature=0.0, ignore_eos=False
        ),
    )[0]
    assert len(out.token_ids) >= 5
    # neither stop ids nor EOS before min_tokens
    assert not set(out.token_ids[:5]) & set(stops + [1])
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in stops + [1] and len(out.token_ids) > 5
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 12


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates(llm: LLM) -> None:
    prompt = "def f(x):"
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].token_ids
    assert llm.generate(prompt, seeded)[0].token_ids == alone
    batch = llm.generate(
        ["Hello world", prompt, "a", prompt],
        [
            SamplingParams(max_tokens=12, temperature=1.0),
            seeded,
            SamplingParams(max_tokens=5, **GREEDY),
            seeded,
        ],
    )
    assert batch[1].token_ids == alone and batch[3].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=4321, ignore_eos=True)
    assert llm.generate(prompt, other_seed)[0].token_ids != alone


def test_logprobs_with_the_requested_number_of_alternatives(llm: LLM) -> None:
    params = [
        SamplingParams(max_tokens=6, logprobs=3, **GREEDY),
        SamplingParams(max_tokens=5, logprobs=0, **GREEDY),
        SamplingParams(max_tokens=4, logprobs=5, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=4, **GREEDY),
    ]
    outs = llm.generate(["Hello world", "The sky is", "a", "def f(x):"], params)
    for out, p in zip(outs, params, strict=True):
        if p.logprobs is None:
            assert out.logprobs == [] and out.top_logprobs == []
            continue
        assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids) == p.max_tokens
        for token, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
            assert len(top) == p.logprobs
            assert lp <= 0.0
            ids, lps = [t for t, _ in top], [v for _, v in top]
            assert len(set(ids)) == len(ids) and lps == sorted(lps, reverse=True)
            assert all(v <= 0.0 for v in lps) and sum(2.718281828**v for v in lps) <= 1.0 + 1e-5
            if top:
                assert lp <= lps[0] + 1e-6
            if token in ids:
                assert lps[ids.index(token)] == pytest.approx(lp, abs=1e-5)
            if p.is_greedy and top:
                assert ids[0] == token
    # the same request alone: the same logprobs
    alone = llm.generate("Hello world", params[0])[0]
    assert alone.token_ids == outs[0].token_ids
    assert alone.logprobs == pytest.approx(outs[0].logprobs, abs=1e-4)


# ----- the CLI -----


def test_cli_generate_json_matches_llm(llm: LLM, model_dir: Path, tmp_path: Path) -> None:
    items = [
        {"prompt": "Hello world"},
        {"prompt_ids": [5, 6, 7, 8]},
        {"prompt": "The sky is", "max_tokens": 3},
        {"prompt": "a", "temperature": 1.0, "seed": 9},
    ]
    file = tmp_path / "prompts.jsonl"
    file.write_text("\n".join(json.dumps(i) for i in items) + "\n\n")
    result = run_cli(
        "generate",
        "--model",
        str(model_dir),
        "--prompts-file",
        str(file),
        "--max-tokens",
        "8",
        "--json",
        *CLI_ENGINE_FLAGS,
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == len(items)
    params = [
        SamplingParams(max_tokens=8, temperature=0.0),
        SamplingParams(max_tokens=8, temperature=0.0),
        SamplingParams(max_tokens=3, temperature=0.0),
        SamplingParams(max_tokens=8, temperature=1.0, seed=9),
    ]
    expected = llm.generate(
        [{k: v for k, v in i.items() if k in ("prompt", "prompt_ids")} for i in items], params
    )
    for record, out in zip(records, expected, strict=True):
        assert {"token_ids", "text", "finish_reason"} <= set(record)
        assert (record["token_ids"], record["text"], record["finish_reason"]) == (
            out.token_ids,
            out.text,
            out.finish_reason,
        )
        assert record["prompt_tokens"] == len(out.prompt_token_ids)
    assert [len(r["token_ids"]) for r in records][2] <= 3


def test_cli_bad_sampling_value_exits_2(model_dir: Path, tmp_path: Path) -> None:
    file = tmp_path / "prompts.jsonl"
    file.write_text(
        json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "x", "top_p": 1.5}) + "\n"
    )
    result = run_cli("generate", "--model", str(model_dir), "--prompts-file", str(file), "--json")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "prompt 2" in result.stderr and "top_p" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_prompt_ids(llm: LLM, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli_main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompt-ids",
                "1,2,3",
                "--max-tokens",
                "5",
                "--json",
                *CLI_ENGINE_FLAGS,
            ]
        )
        == 0
    )
    [line] = capsys.readouterr().out.splitlines()
    record = json.loads(line)
    expected = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert record["token_ids"] == expected.token_ids and record["prompt_tokens"] == 3
    assert record["text"] == expected.text


def test_cli_prompt_longer_than_context_exits_2(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = ",".join(str(4 + i) for i in range(20))
    code = cli_main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt-ids",
            ids,
            "--max-model-len",
            "16",
            "--num-blocks",
            "64",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "20 tokens" in captured.err and "16 tokens" in captured.err


def test_cli_bad_prompt_ids_exit_2(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "--model", str(model_dir), "--prompt-ids", "1,x,3"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err
