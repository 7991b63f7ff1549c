"""Property tests of the OpenAI request parsers: on any JSON body (what `rest` hands them: anything
`json.loads` returns, strings without lone surrogates), `parse_completion` / `parse_chat` either
return a request that fits the model, or raise a domain error (InvalidArgument 400, NotFound 404
for another model); never TypeError, KeyError, AttributeError, ..."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh_engine import sampling
from pdmesh_gateway.openai_api import (
    CHAT_ROLES,
    SAMPLING_BODY_FIELDS,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    OpenAIRequest,
    parse_chat,
    parse_completion,
)
from pdmesh_service.errors import InvalidArgument, NotFound

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
INTS = st.integers(-3, 600) | st.sampled_from([sampling.INT32_MAX + 1, sampling.UINT32_MAX + 1])
NUMBERS = INTS | st.floats() | st.integers(-(10**30), 10**30)
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | JSON, "text": JSON})
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from([*CHAT_ROLES, "robot"]) | JSON,
        "content": TEXT | st.lists(PART, max_size=2) | JSON,
        "name": JSON,
    },
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", "tiny-dir", "", "gpt-4"]) | JSON,
    "prompt": TEXT | st.lists(INTS, max_size=70) | st.lists(TEXT | st.lists(INTS), max_size=2),
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_tokens": INTS | JSON,
    "max_completion_tokens": INTS | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "logprobs": st.booleans() | INTS | JSON,
    "top_logprobs": INTS | JSON,
    "add_generation_prompt": st.booleans() | JSON,
    "user": TEXT | JSON,
    "stop": TEXT | st.lists(TEXT) | JSON,
    "stop_token_ids": st.lists(INTS, max_size=3) | JSON,
    **{
        name: NUMBERS | JSON
        for name in SAMPLING_BODY_FIELDS
        if name not in ("stop", "stop_token_ids")
    },
}
UNSUPPORTED = sorted({**UNSUPPORTED_COMPLETION, **UNSUPPORTED_CHAT})
BASES = [
    {"model": "tiny", "prompt": "Hello", "max_tokens": 4},
    {"messages": [{"role": "user", "content": "Hi"}]},
]


@st.composite
def bodies(draw: st.DrawFn) -> Any:
    """Anything JSON; mostly an object with some of the fields the parsers read (often on top of a
    valid request, so that later checks are reached), now and then an unsupported feature, and
    unknown keys."""
    if draw(st.integers(0, 9)) == 0:
        return draw(JSON)
    body = dict(draw(st.sampled_from(BASES))) if draw(st.integers(0, 3)) else {}
    for name in draw(st.sets(st.sampled_from(sorted(FIELDS)), max_size=4)):
        body[name] = draw(FIELDS[name])
    if draw(st.integers(0, 7)) == 0:  # refused first, whatever else the body holds
        body[draw(st.sampled_from(UNSUPPORTED))] = draw(JSON)
    body.update(draw(st.dictionaries(TEXT, JSON, max_size=2)))
    return body


def _check(parse: Any, body: Any, tok, model) -> OpenAIRequest | None:
    try:
        parsed = parse(body, tok, model)
    except (InvalidArgument, NotFound) as e:
        assert e.http_status in (400, 404) and str(e)
        return None
    request = parsed.request
    assert request.prompt_ids and all(0 <= t < model.vocab_size for t in request.prompt_ids)
    assert len(request.prompt_ids) + request.params.max_tokens <= model.max_model_len
    assert request.model == model.name and isinstance(parsed.stream, bool)
    assert parsed.logprobs == (request.params.logprobs is not None)
    return parsed


@PROPERTY
@given(bodies())
def test_parse_completion_returns_a_fitting_request_or_a_domain_error(tok, model, body) -> None:
    parsed = _check(parse_completion, body, tok, model)
    if parsed is not None:
        assert parsed.kind == "completion"


@PROPERTY
@given(bodies())
def test_parse_chat_returns_a_fitting_request_or_a_domain_error(tok, model, body) -> None:
    parsed = _check(parse_chat, body, tok, model)
    if parsed is not None:
        assert parsed.kind == "chat"
