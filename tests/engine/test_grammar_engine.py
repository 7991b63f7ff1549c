"""Structured outputs in the engine (`pdmesh_engine.grammar`, the sampler's masks, the runners).

- Grammar kinds map to llguidance grammars; bad grammars are ValueErrors with the compiler's words.
- `fill_masks`: a row allows exactly what the grammar allows there; draft rows follow the drafts
  and stop at the first forbidden one; the states are left where they were.
- On the trained V3 (`coder`) and V4 (`coder-v4`) models: every output of a set of JSON schemas
  validates (greedy and sampled), regex and choice outputs match, the request ends with EOS.
- Greedy constrained output equals with speculative decoding on (V3 draft model, V4 MTP, K = 2):
  the verify rows are masked after the drafts before them.
- A migrated request (its earlier tokens at the end of its prompt, `prior_output_tokens`) replays
  them into its grammar and continues exactly as the unmigrated one.
- Unconstrained requests batched beside constrained ones decode as they do alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import numpy as np
import pytest

from pdmesh_engine import LLM, SamplingParams
from pdmesh_engine.checkpoint import embedded_model_dir
from pdmesh_engine.grammar import GrammarCompiler, check_grammar, fill_masks, grammar_source

BASE = dict(device="cpu", dtype="float32", num_threads=1)
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": -1, "maximum": 1},
                "minItems": 1,
                "maxItems": 4,
            },
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                "required": ["id", "ok"],
                "additionalProperties": False,
            },
        },
        "required": ["color", "scores", "owner"],
        "additionalProperties": False,
    },
]
PROMPTS = ["Describe the user as JSON:", "def parse(record):\n    return", "A config file:"]


def constrained(schema: dict[str, Any], **kw: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=kw.pop("max_tokens", 160),
        grammar_kind="json_schema",
        grammar=json.dumps(schema),
        **kw,
    )


@pytest.fixture(scope="module")
def coder_v4() -> LLM:
    return LLM(embedded_model_dir("coder-v4"), **BASE)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.from_model_dir(embedded_model_dir("coder-v4"), 4096, [1])


def test_grammar_kinds_and_errors() -> None:
    for kind, text in [
        ("json_schema", json.dumps(SCHEMAS[0])),
        ("json_object", None),
        ("regex", r"[a-z]{2,5}"),
        ("lark", 'start: "a" | "b"'),
        ("ebnf", 'root ::= "yes" | "no"'),
        ("choice", '["x", "y"]'),
    ]:
        check_grammar(kind, text)
    with pytest.raises(ValueError, match="not JSON"):
        grammar_source("json_schema", "{nope")
    with pytest.raises(ValueError, match="regex grammar does not compile"):
        check_grammar("regex", "a(")
    with pytest.raises(ValueError, match="list of strings"):
        grammar_source("choice", "[1, 2]")
    with pytest.raises(ValueError, match="grammar_kind must be one of"):
        SamplingParams(grammar_kind="xml", grammar="<a/>")
    with pytest.raises(ValueError, match="needs the grammar's text"):
        SamplingParams(grammar_kind="regex")
    with pytest.raises(ValueError, match="ignore_eos cannot"):
        SamplingParams(grammar_kind="json_object", ignore_eos=True)


def test_fill_masks_rows_and_drafts(compiler: GrammarCompiler) -> None:
    """Row r allows what the state allows; draft rows follow the drafts and stop at a forbidden
    one; the state is not moved."""
    vocab = 4096
    state = compiler.start("choice", json.dumps(["yes", "no"]))
    tokenizer = compiler.tokenizer
    yes = tokenizer.tokenize_str("yes")
    first = fill_masks([(state, 0, ())], 1, vocab)[0]
    assert first[yes[0]] and first.sum() < vocab  # "yes" may start; most tokens may not
    for token in np.flatnonzero(first):  # every allowed token starts "yes" or "no"
        text = tokenizer.decode_str([int(token)])
        assert "yes".startswith(text) or "no".startswith(text), text
    # drafts: [yes..., EOS] then a forbidden token; rows after a forbidden draft stay all True
    drafts = [*yes, 1, 5]
    masks = fill_masks([(state, 1, drafts)], 2 + len(drafts), vocab)
    assert masks[0].all()  # a row no state names
    assert (masks[1] == first).all()
    assert masks[1 + len(yes)][1] and masks[1 + len(yes)].sum() == 1  # complete: only EOS
    assert masks[-1].all()  # past the forbidden draft
    assert (fill_masks([(state, 0, ())], 1, vocab)[0] == first).all()  # state unmoved


def test_replay_checks_the_tokens(compiler: GrammarCompiler) -> None:
    tokens = compiler.tokenizer.tokenize_str("yes")
    state = compiler.start("choice", '["yes", "no"]', replay=tokens)
    assert not state.failed
    with pytest.raises(ValueError, match="does not fit the choice grammar"):
        compiler.start("choice", '["yes", "no"]', replay=compiler.tokenizer.tokenize_str("maybe"))


@pytest.mark.parametrize("model", ["coder", "coder-v4"])
def test_json_schema_outputs_validate(model: str, coder_v4: LLM) -> None:
    llm = coder_v4 if model == "coder-v4" else LLM(embedded_model_dir(model), **BASE)
    params = [
        constrained(schema, temperature=t, seed=i)
        for i, (schema, t) in enumerate((s, t) for s in SCHEMAS for t in (0.0, 0.7, 1.0))
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outputs = llm.generate(prompts, params)
    for out, p in zip(outputs, params, strict=True):
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        assert out.token_ids[-1] in llm.engine.model_config.eos_token_ids
        jsonschema.validate(json.loads(out.text), json.loads(p.grammar or ""))


def test_regex_choice_and_json_object(coder_v4: LLM) -> None:
    params = [
        SamplingParams(max_tokens=40, grammar_kind="regex", grammar=r"[0-9]{3}-[a-z]{2,4}"),
        SamplingParams(max_tokens=40, grammar_kind="choice", grammar='["alpha", "beta gamma"]'),
        SamplingParams(max_tokens=120, temperature=0.0, grammar_kind="json_object"),
    ]
    regex, choice, obj = coder_v4.generate(PROMPTS, params)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", regex.text), regex.text
    assert choice.text in ("alpha", "beta gamma")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:  # an object the model kept open until max_tokens: still a valid JSON prefix
        assert obj.text.startswith("{")


@pytest.mark.parametrize("model", ["coder", "coder-v4"])
def test_speculation_keeps_constrained_greedy_output(model: str, coder_v4: LLM) -> None:
    spec: dict[str, Any] = (
        dict(speculative_method="mtp", num_speculative_tokens=2)
        if model == "coder-v4"
        else dict(
            speculative_method="draft_model",
            num_speculative_tokens=2,
            draft_model=str(embedded_model_dir("coder-draft")),
        )
    )
    plain = coder_v4 if model == "coder-v4" else LLM(embedded_model_dir(model), **BASE)
    fast = LLM(embedded_model_dir(model), **BASE, **spec)
    params = [constrained(s, temperature=0.0) for s in SCHEMAS] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    got = [o.token_ids for o in fast.generate(prompts, params)]
    assert got == want
    stats = fast.engine.spec_decode_stats()
    assert stats is not None and stats.num_accepted_tokens > 0


def test_migrated_request_continues_exactly(coder_v4: LLM) -> None:
    prompt = coder_v4.tokenizer.encode(PROMPTS[0])
    for temperature in (0.0, 0.8):
        params = constrained(SCHEMAS[1], temperature=temperature, seed=11)
        (whole,) = coder_v4.generate([prompt], [params])
        cut = len(whole.token_ids) // 2
        moved = SamplingParams(
            **{
                **params.__dict__,
                "max_tokens": params.max_tokens - cut,
                "prior_output_tokens": cut,
            }
        )
        (rest,) = coder_v4.generate([prompt + whole.token_ids[:cut]], [moved])
        assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids


def test_unconstrained_rows_are_unchanged(coder_v4: LLM) -> None:
    free = SamplingParams(max_tokens=24, temperature=0.0)
    alone = coder_v4.generate(PROMPTS, [free] * len(PROMPTS))
    mixed = coder_v4.generate(
        [*PROMPTS, *PROMPTS], [free] * len(PROMPTS) + [constrained(SCHEMAS[0])] * len(PROMPTS)
    )
    assert [o.token_ids for o in mixed[: len(PROMPTS)]] == [o.token_ids for o in alone]
