"""Speculative decoding in the engine (MTP and a separate draft model) on tiny random checkpoints.

Random weights accept few drafts, so the target serves as its own draft model too: then greedy
acceptance must be 100%, which exercises the accept path (several tokens per step, the KV kept for
accepted drafts only). Greedy output must equal speculation off token for token, with continuous
batching, chunked prefill, prefix-cache hits and preemption; MTP and draft-model drafts must equal
what the proposer computes from scratch on the same tokens (its own KV cache is kept right).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from spec_checks import check_drafts_repeat

from pdmesh.cli.main import main as cli_main
from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BASE = dict(num_blocks=96, block_size=16, device="cpu", num_threads=1)
# lengths 3..45: single-block and multi-block prompts, one shares a 32-token prefix with another
PROMPTS = [[(5 + 11 * i + 7 * k) % 1000 + 4 for i in range(n)] for k, n in enumerate([3, 17, 45])]
PROMPTS.append(PROMPTS[2][:32] + [9, 10, 11, 12, 13])


def spec(spec_models: dict[str, Path], method: str, k: int) -> dict[str, object]:
    """EngineConfig fields: "mtp", "draft" (tiny-draft) or "self" (the target drafts itself)."""
    if method == "mtp":
        return dict(speculative_method="mtp", num_speculative_tokens=k)
    draft = spec_models["draft" if method == "draft" else "tiny"]
    return dict(speculative_method="draft_model", num_speculative_tokens=k, draft_model=str(draft))


def generate(spec_models: dict[str, Path], prompts, params, **config) -> tuple[list, LLM]:
    llm = LLM(spec_models["tiny"], EngineConfig(**{**BASE, **config}))
    outputs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return outputs, llm


@pytest.fixture(scope="module")
def reference(spec_models: dict[str, Path]) -> list[list[int]]:
    """Greedy tokens with speculation off, chunked prefill (budget 24), run twice (prefix hits)."""
    outputs, _ = generate(spec_models, PROMPTS, GREEDY, max_num_batched_tokens=24)
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("method", ["mtp", "draft", "self"])
def test_greedy_output_equals_speculation_off(
    spec_models: dict[str, Path], reference: list[list[int]], method: str, k: int
) -> None:
    llm = LLM(
        spec_models["tiny"],
        EngineConfig(**BASE, max_num_batched_tokens=24, **spec(spec_models, method, k)),
    )
    for _ in range(2):  # the second round hits the prefix cache
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outputs] == reference
        llm.engine.check_integrity()
    kv = llm.engine.kv_stats()
    assert kv.prefix_hits > 0 and kv.num_used == 0
    stats = llm.engine.spec_decode_stats()
    assert stats is not None and stats.num_verify_steps > 0
    if method == "self":  # the target drafting for itself: every draft is accepted
        assert stats.num_accepted_per_position == stats.num_drafts_per_position
        assert stats.num_drafts_per_position[k - 1] > 0
        assert stats.mean_accepted_length == pytest.approx(
            1 + stats.num_accepted_tokens / stats.num_verify_steps
        )
        assert stats.mean_accepted_length > 1.5


@pytest.mark.parametrize("method", ["mtp", "self"])
def test_greedy_output_with_preemption_equals_speculation_off(
    spec_models: dict[str, Path], method: str
) -> None:
    """8 blocks of 16 for 4 requests growing to ~70 tokens: requests are preempted and
    recomputed."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    small = dict(num_blocks=8, max_num_batched_tokens=16)
    off, _ = generate(spec_models, PROMPTS, params, **small)
    on, llm = generate(spec_models, PROMPTS, params, **small, **spec(spec_models, method, 3))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert llm.engine.kv_stats().num_used == 0


def test_acceptance_is_complete_with_the_target_as_its_own_draft(
    spec_models: dict[str, Path],
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs, llm = generate(spec_models, PROMPTS[:2], params, **spec(spec_models, "self", 4))
    stats = llm.engine.spec_decode_stats()
    assert stats is not None and stats.acceptance_rate == 1.0
    assert stats.acceptance_rate_per_position == (1.0, 1.0, 1.0, 1.0)
    # each request: one token from its prefill step, then verify steps of up to 5 tokens each
    assert stats.num_emitted_tokens == sum(len(o.token_ids) - 1 for o in outputs)
    assert llm.engine.status().spec_decode == stats
    assert stats.num_verify_steps < 2 * (40 // 5 + 1)


@pytest.mark.parametrize(("method", "warm"), [("mtp", False), ("draft", False), ("mtp", True)])
def test_drafts_equal_the_proposer_run_from_scratch(
    spec_models: dict[str, Path], method: str, warm: bool
) -> None:
    """After every step the request's drafts equal those a fresh engine proposes from a prefill of
    the same tokens: the proposer's own KV (written over verify rows, rewritten after rejections,
    recursion positions) stays right. `warm`: the request's first 32 tokens are in the prefix
    cache, computed by a request that continued differently (MTP's entry at a block's last
    position depends on the next token: the last hit block is recomputed)."""
    config = EngineConfig(**BASE, **spec(spec_models, method, 3))
    engine = EngineCore(spec_models["tiny"], config)
    prompt = PROMPTS[1]
    if warm:
        engine.add_request(PROMPTS[2], SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished:
            engine.step()
        prompt = PROMPTS[3]
    request_id = engine.add_request(
        prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    assert (
        check_drafts_repeat(engine, request_id, lambda: EngineCore(spec_models["tiny"], config))
        >= 5
    )
    assert engine.kv_stats().prefix_hits == (16 if warm else 0)  # 2 blocks hit, the last dropped


def test_stop_strings_stop_tokens_and_logprobs_equal_speculation_off(
    spec_models: dict[str, Path],
) -> None:
    cases = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=["e"]),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[" a", "at"]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=30, temperature=0.0, min_tokens=3),
    ]
    prompts = ["Hello world", "The sky is", "def f(x):", "a"]
    off, _ = generate(spec_models, prompts * len(cases), [c for c in cases for _ in prompts])
    stop_id = off[2 * len(prompts)].token_ids[3]  # the 4th token of a max_tokens=7 run
    for method in ("mtp", "self"):
        on, _ = generate(
            spec_models,
            prompts * len(cases),
            [c for c in cases for _ in prompts],
            **spec(spec_models, method, 3),
        )
        for a, b in zip(on, off, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.stop_reason,
            )
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert len(a.top_logprobs) == len(b.top_logprobs)
            for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True):
                assert [t for t, _ in x] == [t for t, _ in y]
    assert any(o.finish_reason == "stop" and isinstance(o.stop_reason, str) for o in off)
    assert any(o.logprobs for o in off)
    # a stop token id: the request stops at it even when a verify step accepted tokens past it
    params = SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]
    )
    off2, _ = generate(spec_models, prompts[:1], params)
    on2, llm = generate(spec_models, prompts[:1], params, **spec(spec_models, "self", 4))
    assert on2[0].token_ids == off2[0].token_ids and on2[0].stop_reason == stop_id
    assert len(on2[0].token_ids) <= 4 and on2[0].token_ids[-1] == stop_id
    stats = llm.engine.spec_decode_stats()
    assert stats is not None and stats.num_emitted_tokens > len(on2[0].token_ids) - 1


def test_max_tokens_is_never_exceeded(spec_models: dict[str, Path]) -> None:
    for max_tokens in (1, 2, 5, 6):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        off, _ = generate(spec_models, PROMPTS, params)
        on, _ = generate(spec_models, PROMPTS, params, **spec(spec_models, "self", 4))
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        assert all(len(o.token_ids) == max_tokens for o in on)


def test_context_end_is_respected(spec_models: dict[str, Path]) -> None:
    """max_model_len 40: drafts are trimmed so no position reaches it."""
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    off, _ = generate(spec_models, PROMPTS[:2], params, max_model_len=40)
    on, _ = generate(
        spec_models, PROMPTS[:2], params, max_model_len=40, **spec(spec_models, "self", 4)
    )
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert all(o.finish_reason == "length" for o in on)


@pytest.mark.parametrize("method", ["mtp", "self"])
def test_sampled_requests_are_reproducible_and_leave_no_blocks(
    spec_models: dict[str, Path], method: str
) -> None:
    params = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(
            max_tokens=16, temperature=0.8, top_k=20, top_p=0.9, seed=4, ignore_eos=True
        ),
        SamplingParams(max_tokens=16, temperature=1.0, min_tokens=5, seed=5),
    ]
    first, llm = generate(spec_models, PROMPTS[:3], params, **spec(spec_models, method, 3))
    second = llm.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert llm.engine.runner.spec.draft_probs  # the last finished is reported with the next step
    llm.engine.step()
    assert not llm.engine.runner.spec.draft_probs  # kept distributions are dropped at the end
    llm.engine.check_integrity()
    assert llm.engine.kv_stats().num_used == 0


@pytest.mark.parametrize("method", ["mtp", "self"])
def test_aborts_mid_speculation_return_every_block(
    spec_models: dict[str, Path], method: str
) -> None:
    engine = EngineCore(
        spec_models["tiny"],
        EngineConfig(**{**BASE, "num_blocks": 12}, **spec(spec_models, method, 3)),
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True)
    ids = [engine.add_request(p, params if i % 2 else sampled) for i, p in enumerate(PROMPTS)]
    for _ in range(4):
        engine.step()
        engine.check_integrity()
    assert any(
        engine.scheduler.requests[i].spec_token_ids for i in ids if i in engine.scheduler.requests
    )
    engine.abort(ids[0])
    engine.abort(ids[3])
    engine.check_integrity()
    for _ in range(3):
        engine.step()
        engine.check_integrity()
    engine.abort(ids[1])
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    assert engine.kv_stats().num_used == 0
    engine.step()  # reports the last finished request to the runner
    assert not engine.runner.spec.draft_probs and not engine.runner.generators


def test_configuration_errors_are_clear(spec_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs draft_model"):
        EngineConfig(speculative_method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        EngineConfig(speculative_method="mtp", num_speculative_tokens=9)
    with pytest.raises(ValueError, match="needs a speculative_method"):
        EngineConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_method must be"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="MTP layer"):
        EngineCore(
            spec_models["draft"],
            EngineConfig(**BASE, speculative_method="mtp", num_speculative_tokens=1),
        )
    other = tmp_path / "other-vocab"
    shutil.copytree(spec_models["draft"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 2048}))
    with pytest.raises(ValueError, match="vocab_size 2048"):
        EngineCore(spec_models["tiny"], EngineConfig(**BASE, **spec({"draft": other}, "draft", 2)))


def test_cli_generate_with_speculation_matches_without(
    spec_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["generate", "--model", str(spec_models["tiny"]), "--prompt", "The sky is", "--json"]
    common += ["--max-tokens", "12", "--ignore-eos", "--num-blocks", "64"]
    assert cli_main(common) == 0
    off = json.loads(capsys.readouterr().out)
    flags = ["--speculative-method", "draft_model", "--draft-model", str(spec_models["draft"])]
    assert cli_main([*common, *flags, "--num-speculative-tokens", "3"]) == 0
    assert json.loads(capsys.readouterr().out) == off
    assert cli_main([*common, "--speculative-method", "mtp"]) == 0
    assert json.loads(capsys.readouterr().out) == off
    # no --draft-model: the embedded coder-draft, whose vocabulary is not tiny's
    assert cli_main([*common, "--speculative-method", "draft_model"]) == 2
    assert "a draft must share the target's tokenizer" in capsys.readouterr().err
