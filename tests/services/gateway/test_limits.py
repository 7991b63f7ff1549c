"""What the OpenAI endpoints accept: unsupported features that would change the output are a 400
naming the field, the features' neutral values and OpenAI's informational fields pass, unknown
fields are ignored, logprobs and the context have their limits, and no engine-internal sampling
field can be set from a body."""

from __future__ import annotations

from typing import Any

import pytest

from pdmesh_gateway.core import SAMPLING_FIELDS
from pdmesh_gateway.openai_api import (
    SAMPLING_BODY_FIELDS,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    json_equal,
    parse_chat,
    parse_completion,
)
from pdmesh_service.errors import InvalidArgument

MISSING = object()
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
ENDPOINTS = {"completion": (parse_completion, COMPLETION), "chat": (parse_chat, CHAT)}
TABLES = {"completion": UNSUPPORTED_COMPLETION, "chat": UNSUPPORTED_CHAT}
# realistic values of the unsupported features (any other non-null value is refused the same way)
FEATURES: dict[str, Any] = {
    "n": 2,
    "best_of": 3,
    "echo": True,
    "suffix": " the end",
    "frequency_penalty": 0.5,
    "presence_penalty": -1,
    "repetition_penalty": 1.2,
    "length_penalty": 0.8,
    "logit_bias": {"17": 100},
    "use_beam_search": True,
    "prompt_logprobs": 1,
    "allowed_token_ids": [1, 2],
    "bad_words": ["no"],
    "truncate_prompt_tokens": 8,
    "functions": [{"name": "f"}],
    "function_call": {"name": "f"},
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "web_search_options": {},
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
}


@pytest.fixture
def parse(tok, model):
    """parse(kind, **update): the base request of `kind` with `update` (MISSING: without that
    field), parsed."""

    def run(kind: str, **update: Any) -> Any:
        fn, base = ENDPOINTS[kind]
        body = {k: v for k, v in {**base, **update}.items() if v is not MISSING}
        return fn(body, tok, model)

    return run


@pytest.fixture
def refuse(parse):
    """refuse(kind, **update): the 400 that request gets."""

    def run(kind: str, **update: Any) -> InvalidArgument:
        with pytest.raises(InvalidArgument) as info:
            parse(kind, **update)
        assert info.value.http_status == 400
        return info.value

    return run


UNSUPPORTED_CASES = [(kind, name) for kind, table in TABLES.items() for name in table]


def test_every_unsupported_feature_has_a_realistic_value() -> None:
    assert {name for _, name in UNSUPPORTED_CASES} == set(FEATURES)


@pytest.mark.parametrize(("kind", "name"), UNSUPPORTED_CASES)
def test_an_unsupported_feature_is_a_400_naming_it(kind: str, name: str, refuse) -> None:
    for value in (FEATURES[name], "something else"):
        error = refuse(kind, **{name: value})
        assert error.param == name and f"{name}=" in str(error) and "not supported" in str(error)


@pytest.mark.parametrize(("kind", "name"), UNSUPPORTED_CASES)
def test_the_neutral_values_of_an_unsupported_feature_pass(kind: str, name: str, parse) -> None:
    plain = parse(kind).request.params
    for value in (*TABLES[kind][name], None):
        assert parse(kind, **{name: value}).request.params == plain


def test_neutral_values_compare_as_json_numbers_but_bools_are_not_numbers(parse, refuse) -> None:
    assert parse("completion", n=1.0, frequency_penalty=0.0, presence_penalty=0)
    for update in ({"n": True}, {"echo": 0}, {"best_of": True}, {"logit_bias": []}):
        assert refuse("completion", **update).param == next(iter(update))
    assert json_equal({"type": "text"}, {"type": "text"})
    assert not json_equal([1], [True]) and not json_equal({"a": 1}, {"a": 1, "b": 2})


def test_features_of_the_other_endpoint_are_ignored(parse) -> None:
    assert parse("completion", tools=[{"type": "function"}], modalities=["audio"])
    assert parse("chat", suffix="!")


@pytest.mark.parametrize("kind", ENDPOINTS)
def test_informational_and_unknown_fields_are_accepted_and_ignored(
    kind: str, parse, refuse
) -> None:
    plain = parse(kind).request.params
    extra = {
        "user": "user-17",
        "metadata": {"k": "v"},
        "store": True,
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": "low",
        "x_vendor_field": [1, {"a": None}],
    }
    assert parse(kind, **extra).request.params == plain
    error = refuse(kind, user=17)
    assert error.param == "user" and "string" in str(error)


@pytest.mark.parametrize("kind", ENDPOINTS)
def test_engine_fields_outside_the_api_cannot_be_set_from_a_body(kind: str, parse) -> None:
    assert set(SAMPLING_BODY_FIELDS) <= set(SAMPLING_FIELDS)
    hidden = [
        f for f in SAMPLING_FIELDS if f not in (*SAMPLING_BODY_FIELDS, "max_tokens", "logprobs")
    ]
    plain = parse(kind).request.params
    for name in hidden:
        assert parse(kind, **{name: 1}).request.params == plain, name


def test_completion_logprobs_is_an_int_from_0_to_20(parse, refuse) -> None:
    assert parse("completion", logprobs=0).request.params.logprobs == 0
    assert parse("completion", logprobs=20).request.params.logprobs == 20
    for bad in (21, -1, True, 1.5, "2"):
        error = refuse("completion", logprobs=bad)
        assert error.param == "logprobs" and "[0, 20]" in str(error), bad


def test_chat_logprobs_is_a_bool_with_top_logprobs_from_0_to_20(parse, refuse) -> None:
    assert parse("chat", logprobs=False).request.params.logprobs is None
    assert parse("chat", logprobs=True).request.params.logprobs == 0
    assert parse("chat", logprobs=True, top_logprobs=20).request.params.logprobs == 20
    assert refuse("chat", logprobs=1).param == "logprobs"
    assert refuse("chat", top_logprobs=2).param == "top_logprobs"
    assert refuse("chat", logprobs=False, top_logprobs=0).param == "top_logprobs"
    for bad in (21, -1, 2.5):
        error = refuse("chat", logprobs=True, top_logprobs=bad)
        assert error.param == "top_logprobs" and str(error).startswith("top_logprobs"), bad


def test_the_prompt_and_max_tokens_must_fit_the_context_as_vllm_says(model, parse, refuse) -> None:
    context = model.max_model_len
    ids = list(range(1, context - 3))  # context - 4 tokens
    assert parse("completion", prompt=ids, max_tokens=4).request.params.max_tokens == 4
    error = refuse("completion", prompt=ids, max_tokens=5)
    assert error.param == "max_tokens"
    assert f"maximum context length is {context} tokens" in str(error)
    assert f"you requested {context + 1} tokens" in str(error)
    assert refuse("completion", prompt=list(range(1, context + 1))).param == "prompt"
    long_chat = [{"role": "user", "content": "word " * context}]
    assert refuse("chat", messages=long_chat, max_tokens=None).param == "messages"
    assert refuse("chat", max_tokens=context).param == "max_tokens"
    assert refuse("chat", max_completion_tokens=context).param == "max_completion_tokens"
    # chat without a limit gets the rest of the context
    chat = parse("chat", max_tokens=None).request
    assert len(chat.prompt_ids) + chat.params.max_tokens == context


def test_stream_options_need_stream(parse, refuse) -> None:
    assert refuse("completion", stream_options={"include_usage": True}).param == "stream_options"
    assert parse("completion", stream=True, stream_options={"include_usage": True}).include_usage


READ_FIELDS = {
    "completion": ("model", "max_tokens", "logprobs", "stream", "stream_options", "user"),
    "chat": (
        "model",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
        "stream",
        "stream_options",
        "user",
    ),
}


@pytest.mark.parametrize("kind", ENDPOINTS)
def test_null_is_the_default_of_every_optional_field(kind: str, parse) -> None:
    plain = parse(kind)
    for name in (*READ_FIELDS[kind], *SAMPLING_BODY_FIELDS, *TABLES[kind]):
        parsed = parse(kind, **{name: None})
        # max_tokens: the endpoint's default (16, or the rest of the context)
        expected = parse(kind, max_tokens=MISSING) if name == "max_tokens" else plain
        assert parsed.request.prompt_ids == expected.request.prompt_ids, name
        assert parsed.request.params == expected.request.params, name
        assert (parsed.stream, parsed.include_usage, parsed.logprobs) == (False, False, False)


def test_a_refused_value_is_shown_cut_short(refuse) -> None:
    error = refuse("completion", logit_bias={str(i): 1 for i in range(1000)})
    assert len(str(error)) < 200 and "..." in str(error)
