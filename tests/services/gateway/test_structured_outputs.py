"""Structured outputs at the gateway: response_format and vLLM's guided_* / structured_outputs map
to the engine's grammar (kind, text) on both endpoints; a bad or uncompilable one, or two at once,
is a 400 naming the field; the OpenAPI document describes them; the grammars the gateway builds,
walked at random on the trained models' tokenizer, give outputs that fit what was asked."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh_engine.grammar import GrammarCompiler, fill_masks
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.core import ModelInfo
from pdmesh_gateway.openai_api import parse_chat, parse_completion
from pdmesh_gateway.openapi import build_openapi
from pdmesh_gateway.structured import STRUCTURED_OUTPUTS
from pdmesh_service.errors import InvalidArgument

CHECKPOINT = Path(__file__).resolve().parents[3] / "engine/pdmesh_engine/checkpoints/coder-v4"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
BASES = {
    "completion": (parse_completion, {"prompt": "Hello", "max_tokens": 4}),
    "chat": (parse_chat, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
}
KINDS = list(BASES)


def _parse(kind: str, tok, model, **update: Any) -> Any:
    parse, base = BASES[kind]
    return parse({**base, **update}, tok, model)


def _grammar(kind: str, tok, model, **update: Any) -> tuple[str | None, str | None]:
    params = _parse(kind, tok, model, **update).request.params
    return params.grammar_kind, params.grammar


def _refused(kind: str, tok, model, **update: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        _parse(kind, tok, model, **update)
    assert info.value.http_status == 400
    return info.value


def _format(schema: Any = SCHEMA, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **extra}}


MAPPED = [
    ({"response_format": {"type": "text"}}, (None, None)),
    ({"response_format": {"type": "json_object"}}, ("json_object", None)),
    ({"response_format": _format()}, ("json_schema", json.dumps(SCHEMA))),
    ({"response_format": _format(strict=True)}, ("json_schema", json.dumps(SCHEMA))),
    ({"response_format": _format(strict=False, description="x")},
     ("json_schema", json.dumps(SCHEMA))),
    ({"response_format": _format(schema=None)}, ("json_schema", "{}")),
    ({"guided_json": SCHEMA}, ("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, ("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[a-c]{2,4}"}, ("regex", "[a-c]{2,4}")),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, ("ebnf", 'root ::= "yes" | "no"')),
    ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+")),
    ({"structured_outputs": {"grammar": "start: /[0-9]+/"}}, ("ebnf", "start: /[0-9]+/")),
    ({"structured_outputs": {"choice": ["x"]}}, ("choice", '["x"]')),
    ({"structured_outputs": {"json_object": True}}, ("json_object", None)),
    ({"structured_outputs": {"json_object": False, "regex": None}}, (None, None)),
    ({"structured_outputs": {}}, (None, None)),
    ({"guided_json": None, "guided_choice": None, "response_format": None}, (None, None)),
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("update", "expected"), MAPPED)
def test_fields_map_to_the_engine_grammar(tok, model, kind: str, update, expected) -> None:
    assert _grammar(kind, tok, model, **update) == expected


REFUSED = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": _format() | {"json_schema": {"name": "a b", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": _format(strict="yes")}, "response_format.json_schema.strict"),
    ({"response_format": _format(schema=[1])}, "response_format.json_schema.schema"),
    ({"response_format": _format(schema={"type": "nope"})}, "response_format"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": ["root"]}, "guided_grammar"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "a+", "min_tokens": 1}, "min_tokens"),
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("update", "param"), REFUSED)
def test_bad_constraints_are_a_400_naming_the_field(tok, model, kind, update, param) -> None:
    error = _refused(kind, tok, model, **update)
    assert error.param == param, str(error)
    if len([k for k in update if k != "ignore_eos" and k != "min_tokens"]) > 1:
        assert all(name in str(error) for name in update)  # both fields named


def test_a_structured_output_cannot_go_with_forced_tool_calls(tok) -> None:
    model = ModelInfo("tiny", "tiny-dir", 4096, tok.vocab_size)
    tools = [{"type": "function", "function": {"name": "f"}}]
    error = _refused("chat", tok, model, tools=tools, tool_choice="required", guided_choice=["a"])
    assert error.param == "guided_choice" and "tool_choice" in str(error)
    kind, _ = _grammar("chat", tok, model, tools=tools, guided_choice=["a"])  # auto: allowed
    assert kind == "choice"


def test_the_document_describes_the_structured_fields(model) -> None:
    document = build_openapi(model, max_body_bytes=1 << 20)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema = {**document, "$ref": f"#/components/schemas/{name}"}
        base = BASES["chat" if name.startswith("Chat") else "completion"][1]
        fields = document["components"]["schemas"][name]["properties"]
        assert {"response_format", "guided_json", "structured_outputs"} <= set(fields)
        for update, _ in MAPPED:
            jsonschema.validate({**base, **update}, schema)
        outputs = next(s for s in fields["structured_outputs"]["anyOf"] if s != {"type": "null"})
        assert set(outputs["properties"]) == set(STRUCTURED_OUTPUTS)
        for update in ({"structured_outputs": {"nope": 1}}, {"guided_choice": []}):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate({**base, **update}, schema)
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat)


# ----- the grammars, walked ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.from_model_dir(CHECKPOINT, 4096, [1])


def _walk(compiler: GrammarCompiler, kind: str, text: str | None, rng: random.Random) -> list[int]:
    state, out = compiler.start(kind, text), []
    for _ in range(2000):
        allowed = np.flatnonzero(fill_masks([(state, 0, ())], 1, compiler.vocab_size)[0])
        token = int(allowed[rng.randrange(len(allowed))])
        if token == 1:
            return out
        assert state.accept(token), state.error
        out.append(token)
    raise AssertionError("the walk did not end")


def test_outputs_of_the_mapped_grammars_fit_the_request(tok, model, compiler) -> None:
    model_tok, rng = Tokenizer.from_dir(CHECKPOINT), random.Random(2)
    cases = [
        ({"response_format": _format()}, lambda out: jsonschema.validate(json.loads(out), SCHEMA)),
        ({"guided_choice": ["yes", "no"]}, lambda out: out in ("yes", "no")),
        ({"structured_outputs": {"regex": "[a-c]{2,4}"}}, lambda out: 2 <= len(out) <= 4),
    ]
    for update, check in cases:
        kind, text = _grammar("chat", tok, model, **update)
        assert kind is not None
        for _ in range(5):
            out = model_tok.decode(_walk(compiler, kind, text, rng), skip_special_tokens=False)
            assert check(out) is not False, out
            if kind == "json_schema":
                assert out == json.dumps(json.loads(out), separators=(",", ":"), ensure_ascii=False)


# ----- any JSON in the new fields: a request or a 400, never a crash ------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 3) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
NAMES = st.sampled_from(["f", "get_weather", "a b", ""]) | JSON
FUNCTION = st.fixed_dictionaries(
    {},
    optional={
        "name": NAMES,
        "parameters": st.just({"type": "object", "properties": {"x": {"type": "integer"}}}) | JSON,
        "strict": st.booleans() | JSON,
    },
)
TOOL = st.fixed_dictionaries({"type": st.just("function") | JSON, "function": FUNCTION | JSON})
CALL = st.fixed_dictionaries(
    {"id": TEXT | JSON, "type": st.just("function") | JSON},
    optional={"function": st.fixed_dictionaries({"name": NAMES, "arguments": TEXT | JSON})},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"])},
    optional={"content": TEXT | JSON, "tool_calls": st.lists(CALL, max_size=2) | JSON,
              "tool_call_id": TEXT | JSON},
)  # fmt: skip
FIELDS = {
    "tools": st.lists(TOOL, max_size=2) | JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required"])
    | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})}
    )
    | JSON,
    "parallel_tool_calls": st.booleans() | JSON,
    "response_format": st.sampled_from([{"type": "json_object"}, _format()]) | JSON,
    "guided_json": st.just(SCHEMA) | JSON,
    "guided_regex": st.just("a+") | JSON,
    "guided_choice": st.lists(TEXT, max_size=2) | JSON,
    "guided_grammar": JSON,
    "structured_outputs": st.dictionaries(st.sampled_from([*STRUCTURED_OUTPUTS, "x"]), JSON) | JSON,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
}


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.fixed_dictionaries({}, optional=FIELDS))
def test_any_json_in_the_new_fields_is_a_request_or_a_400(tok, body: dict[str, Any]) -> None:
    model = ModelInfo("tiny", "tiny-dir", 4096, tok.vocab_size)
    for parse in (parse_chat, parse_completion):
        try:
            parsed = parse(
                {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], **body},
                tok,
                model,
            )
        except InvalidArgument as e:
            assert e.http_status == 400 and e.param
            continue
        assert parsed.request.prompt_ids
