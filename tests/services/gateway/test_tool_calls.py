"""Tool calls (DeepSeek-V4's DSML): the parser, whole and streamed (the same calls for every way of
cutting the text, as the `openai` SDK accumulates them), the grammar of forced calls (random walks
through it on the trained models' tokenizer parse back into arguments that fit the tool's schema),
the chat template's rendering of tools, calls and results, and chat requests with tools."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdmesh.tools.tokenizer_train import tokenizer_config, train_tokenizer
from pdmesh_engine.grammar import GrammarCompiler, fill_masks
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.core import GenerationEvent, ModelInfo, Usage, fold
from pdmesh_gateway.openai_api import Shaper, parse_chat
from pdmesh_gateway.tool_calls import (
    MARKER,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
    tool_call_grammar,
)
from pdmesh_service.errors import InvalidArgument

CHECKPOINT = Path(__file__).resolve().parents[3] / "engine/pdmesh_engine/checkpoints/coder-v4"
EOS_ID = 1
# the chat template before tools were added: conversations without tools still render like this
PLAIN_TEMPLATE = (
    "{% set ns = namespace(system='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + (message['content'] if ns.system == '' else '\\n\\n' + "
    "message['content']) %}{% endif %}{% endfor %}{{ bos_token }}{{ ns.system }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<｜User｜>' + message['content'] }}{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% elif message['role'] != 'system' %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
D = "｜DSML｜"


def block(*invokes: str, lead: str = "\n\n") -> str:
    return f"{lead}<{D}tool_calls>\n{''.join(invokes)}</{D}tool_calls>"


def invoke(name: str, **params: tuple[str, bool]) -> str:
    lines = "".join(
        f'<{D}parameter name="{k}" string="{"true" if raw else "false"}">{v}</{D}parameter>\n'
        for k, (v, raw) in params.items()
    )
    return f'<{D}invoke name="{name}">\n{lines or chr(10)}</{D}invoke>\n'


WEATHER = invoke("get_weather", city=("Paris, <b>", False), days=("3", False))
WEATHER_RAW = invoke("get_weather", city=("Paris", True), days=("3", False))
NESTED = invoke("search", q=('a "quoted"\nline', True), opts=('{"k": [1, {"x": null}]}', False))
TEXTS = [
    "no calls here, just text < and <｜ and <｜DSML",
    "Let me look.\n\n" + block(WEATHER_RAW),
    block(WEATHER_RAW, NESTED, lead=""),
    "Two:   \n " + block(NESTED, invoke("ping"), WEATHER_RAW) + "trailing text dropped",
    "cut short" + block(WEATHER_RAW)[:-40],  # the second call never closes
    "ends inside the marker <｜DSML｜tool_ca",
]


# ----- the parser --------------------------------------------------------------------------------


def test_parse_reads_content_and_calls() -> None:
    assert parse_tool_calls("plain\n\n") == ("plain\n\n", [])
    content, calls = parse_tool_calls("Let me look.\n\n" + block(WEATHER_RAW, NESTED))
    assert content == "Let me look."
    assert calls == [
        ToolCall("get_weather", json.dumps({"city": "Paris", "days": 3})),
        ToolCall("search", json.dumps({"q": 'a "quoted"\nline', "opts": {"k": [1, {"x": None}]}})),
    ]
    # a non-string value that is not JSON is kept as its text; no arguments is {}
    assert parse_tool_calls(block(WEATHER, invoke("ping"), lead=""))[1] == [
        ToolCall("get_weather", json.dumps({"city": "Paris, <b>", "days": 3})),
        ToolCall("ping", "{}"),
    ]
    assert parse_tool_calls("x" + block(WEATHER_RAW)[:-60]) == ("x", [])  # cut inside the call


def _stream(text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]]]:
    parser, content, deltas = ToolCallStream(), [], []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        delta = parser.feed(text[a:b])
        content.append(delta.content)
        deltas.extend(delta.tool_calls)
    content.append(parser.finish().content)
    assert all(MARKER[:2] not in c for c in content if MARKER in text)
    return "".join(content), deltas


def _cuttings(text: str, rng: random.Random) -> list[list[int]]:
    every = list(range(1, len(text)))
    marker = text.find(MARKER)
    in_marker = [marker + 5, marker + 9] if marker >= 0 else []  # the marker split across deltas
    return [[], every, in_marker] + [
        sorted(rng.sample(every, min(len(every), n))) for n in (2, 5, 20)
    ]


@pytest.mark.parametrize("text", TEXTS)
def test_the_stream_reads_the_same_as_the_whole_text(text: str) -> None:
    content, calls = parse_tool_calls(text)
    for cuts in _cuttings(text, random.Random(7)):
        streamed, deltas = _stream(text, cuts)
        assert streamed == content, cuts
        assert [d["index"] for d in deltas] == list(range(len(calls)))
        assert [ToolCall(**d["function"]) for d in deltas] == calls
        assert all(d["id"].startswith("call_") and d["type"] == "function" for d in deltas)


def test_content_before_a_marker_is_held_back_only_while_it_may_be_one() -> None:
    parser = ToolCallStream()
    assert parser.feed("Hi <").content == "Hi"  # " <" may begin the marker
    assert parser.feed("b> ok").content == " <b> ok"
    assert parser.feed("\n\n<｜DS").content == ""
    delta = parser.feed(f"ML｜tool_calls>\n{WEATHER_RAW}")
    assert delta.content == "" and delta.tool_calls[0]["function"]["name"] == "get_weather"
    assert parser.feed("more").content == "" and parser.finish().content == ""


# ----- through the Shaper, as the openai SDK reads it --------------------------------------------


@pytest.fixture(scope="module")
def big_model(tok: Tokenizer) -> ModelInfo:
    return ModelInfo("tiny", "tiny-dir", 4096, tok.vocab_size, created=1)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "ping"}},
]


def _events(text: str, cuts: list[int], finish: str) -> list[GenerationEvent]:
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    events = [GenerationEvent((5,), piece) for piece in pieces]
    events[-1] = GenerationEvent((5,), pieces[-1], (), finish, None, Usage(3, len(pieces)))
    return events


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_streamed_and_whole_answers_agree_through_the_openai_sdk(
    tok, big_model, text: str, finish: str
) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "stream": True}
    request = parse_chat(body, tok, big_model)
    content, calls = parse_tool_calls(text)
    for cuts in _cuttings(text, random.Random(3)):
        events = _events(text, cuts, finish)
        whole = ChatCompletion.model_validate(Shaper(request, tok).response(fold(events)))
        shaper, state = Shaper(request, tok), ChatCompletionStreamState(input_tools=TOOLS)
        for event in events:
            for chunk in shaper.chunks(event):
                state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
        streamed = state.current_completion_snapshot
        expected_finish = "tool_calls" if calls and finish == "stop" else finish
        for answer in (whole, streamed):
            message = answer.choices[0].message
            assert answer.choices[0].finish_reason == expected_finish
            assert (message.content or "") == content
            got = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
            assert got == [tuple(c) for c in calls]
        if calls:
            assert whole.choices[0].message.content == (content or None)


def test_without_tools_or_with_tool_choice_none_the_text_is_not_read(tok, big_model) -> None:
    text = "Sure." + block(WEATHER_RAW)
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
        request = parse_chat(body, tok, big_model)
        answer = Shaper(request, tok).response(fold(_events(text, [3], "stop")))
        choice = answer["choices"][0]
        assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "stop"


# ----- the grammar of forced calls ---------------------------------------------------------------

GRAMMAR_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "nights": {"type": "integer", "minimum": 1, "maximum": 14},
                    "budget": {"type": "number", "minimum": 0, "exclusiveMaximum": 500},
                    "note": {"type": "string", "minLength": 2, "maxLength": 5},
                    "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "breakfast": {"type": "boolean"},
                },
                "required": ["city", "nights", "budget", "note", "code", "breakfast"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "plan-trip_2",
            "parameters": {
                "type": "object",
                "$defs": {
                    "stop": {
                        "type": "object",
                        "properties": {
                            "place": {"type": "string", "maxLength": 6},
                            "days": {"type": "integer", "minimum": 0, "maximum": 9},
                        },
                        "required": ["place"],
                        "additionalProperties": False,
                    }
                },
                "properties": {
                    "stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}, "maxItems": 3},
                    "mode": {"enum": ["car", "train", None]},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["a", "b"]},
                        "maxItems": 3,
                    },
                    "home": {"const": "Lyon"},
                },
                "required": ["stops", "home"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]
RAW_TOOL = {  # every parameter raw text: a call renders back to exactly what was generated
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 10},
                "kind": {"enum": ["todo", "done"]},
                "body": {"type": "string", "minLength": 0, "maxLength": 8},
            },
            "required": ["title", "kind"],
        },
    },
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.from_model_dir(CHECKPOINT, 4096, [EOS_ID])


@pytest.fixture(scope="module")
def model_tok() -> Tokenizer:
    return Tokenizer.from_dir(CHECKPOINT)


def _walk(compiler: GrammarCompiler, grammar: str, rng: random.Random) -> list[int]:
    """A random path through the grammar: uniformly among the allowed tokens, up to EOS."""
    state, out = compiler.start("lark", grammar), []
    for _ in range(3000):
        allowed = np.flatnonzero(fill_masks([(state, 0, ())], 1, compiler.vocab_size)[0])
        token = int(allowed[rng.randrange(len(allowed))])
        if token == EOS_ID:
            assert state.is_finished or not state.failed
            return out
        assert state.accept(token), state.error
        out.append(token)
    raise AssertionError("the walk did not end")


def _schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "book"}}, True),
        ({"type": "function", "function": {"name": "plan-trip_2"}}, True),
    ],
)
def test_random_paths_through_the_grammar_are_valid_calls(
    compiler, model_tok, choice: Any, parallel: bool
) -> None:
    grammar = tool_call_grammar(GRAMMAR_TOOLS, choice, parallel)
    schemas, rng, names = _schemas(GRAMMAR_TOOLS), random.Random(11), set()
    for _ in range(12):
        text = model_tok.decode(_walk(compiler, grammar, rng), skip_special_tokens=False)
        content, calls = parse_tool_calls(text)
        assert content == "" and text.startswith("\n\n" + MARKER) and calls
        if isinstance(choice, dict) or not parallel:
            assert len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            names.add(call.name)
    if isinstance(choice, dict):
        assert names == {choice["function"]["name"]}
    else:
        assert len(names) >= 2


def test_forced_raw_calls_render_back_to_the_generated_text(compiler, model_tok) -> None:
    """What the grammar generates is what the chat template writes for the parsed calls."""
    grammar = tool_call_grammar([RAW_TOOL, TOOLS[2]], "required")
    rng = random.Random(5)
    for _ in range(8):
        text = model_tok.decode(_walk(compiler, grammar, rng), skip_special_tokens=False)
        _, calls = parse_tool_calls(text)
        history = [
            {
                "id": f"c{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for i, c in enumerate(calls)
        ]
        rendered = model_tok.apply_chat_template(
            [{"role": "assistant", "content": "", "tool_calls": history}],
            add_generation_prompt=False,
        )
        assert rendered == f"{model_tok.bos_token}<｜Assistant｜>{text}{model_tok.eos_token}"


def test_the_grammar_bounds_raw_strings_and_refuses_bad_choices() -> None:
    grammar = tool_call_grammar([TOOLS[0]], "required")
    assert "/[^<]{1,200}/" in grammar and "%json" in grammar and "call+" in grammar
    assert "call+" not in tool_call_grammar([TOOLS[0]], "required", parallel=False)
    with pytest.raises(ValueError):
        tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "missing"}})
    with pytest.raises(ValueError):
        tool_call_grammar(TOOLS, "auto")


# ----- the chat template -------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}},
            },
            {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": {}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "pong"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Thanks"},
]


def test_the_template_renders_tools_calls_and_results(model_tok: Tokenizer) -> None:
    text = model_tok.apply_chat_template(CONVERSATION, tools=TOOLS[:1])
    schema = json.dumps(TOOLS[0]["function"], ensure_ascii=False)
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n\n")
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow" in text
    assert text.endswith(
        "<｜User｜>Weather in Paris?<｜Assistant｜>Checking.\n\n"
        f"<{D}tool_calls>\n"
        f'<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">[1,2]</{D}parameter>\n'
        f"</{D}invoke>\n"
        f'<{D}invoke name="ping">\n\n</{D}invoke>\n'
        f"</{D}tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>pong</tool_result>"
        "<｜Assistant｜>Sunny.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜>"
    )
    assert "## Tools" not in model_tok.apply_chat_template(CONVERSATION)


PLAIN = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "x"},
        {"role": "system", "content": "B"},
        {"role": "assistant", "content": "y"},
        {"role": "user", "content": "z"},
        {"role": "user", "content": "w"},
        {"role": "assistant", "content": ""},
    ],
]


@pytest.mark.parametrize("messages", PLAIN)
def test_plain_conversations_render_as_before_tools(model_tok: Tokenizer, messages) -> None:
    before = Tokenizer.from_dir(CHECKPOINT)
    before.chat_template = PLAIN_TEMPLATE
    for generation in (True, False):
        assert model_tok.apply_chat_template(messages, generation) == before.apply_chat_template(
            messages, generation
        )


def test_every_trained_model_ships_the_template_of_the_source() -> None:
    for name in ("coder", "coder-v4", "coder-draft"):
        path = CHECKPOINT.parent / name / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        expected = tokenizer_config(config["model_max_length"])
        assert config == expected
        assert (
            path.read_text(encoding="utf-8")
            == json.dumps(expected, indent=2, ensure_ascii=False) + "\n"
        )


def test_the_template_renders_as_transformers_does(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    (tmp_path / "tokenizer.json").write_text(train_tokenizer(512), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(4096), ensure_ascii=False), encoding="utf-8"
    )
    ours, theirs = (
        Tokenizer.from_dir(tmp_path),
        transformers.AutoTokenizer.from_pretrained(tmp_path),
    )
    for tools in (TOOLS, None):
        assert ours.apply_chat_template(CONVERSATION, tools=tools) == theirs.apply_chat_template(
            CONVERSATION, tools=tools, tokenize=False, add_generation_prompt=True
        )


def test_the_from_json_filter_reads_arguments_text() -> None:
    template = (
        "{% for k, v in (messages[0]['content'] | from_json).items() %}{{ k }}={{ v }};{% endfor %}"
    )
    tok = Tokenizer.from_dir(CHECKPOINT)
    tok.chat_template = template
    assert (
        tok.apply_chat_template([{"role": "user", "content": '{"a": 1, "b": "x"}'}]) == "a=1;b=x;"
    )
    with pytest.raises(ValueError, match="from_json"):
        tok.apply_chat_template([{"role": "user", "content": "{"}])


# ----- chat requests with tools ------------------------------------------------------------------


def _chat(tok, model, **extra: Any):
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, **extra}
    return parse_chat(body, tok, model)


def test_tool_choice_decides_the_grammar_and_the_reading(tok, big_model) -> None:
    auto = _chat(tok, big_model)
    assert auto.parses_tool_calls and auto.request.params.grammar_kind is None
    assert "### Available Tool Schemas" in tok.decode(list(auto.request.prompt_ids))
    none = _chat(tok, big_model, tool_choice="none")
    assert not none.parses_tool_calls and none.request.prompt_ids == auto.request.prompt_ids
    required = _chat(tok, big_model, tool_choice="required").request.params
    assert required.grammar_kind == "lark" and required.grammar == tool_call_grammar(
        TOOLS, "required"
    )
    named = {"type": "function", "function": {"name": "search"}}
    params = _chat(tok, big_model, tool_choice=named, parallel_tool_calls=False).request.params
    assert params.grammar == tool_call_grammar(TOOLS, named) and "get_weather" not in params.grammar
    single = _chat(tok, big_model, tool_choice="required", parallel_tool_calls=False)
    assert single.request.params.grammar == tool_call_grammar(TOOLS, "required", parallel=False)
    plain = parse_chat(
        {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "auto"}, tok, big_model
    )
    assert not plain.parses_tool_calls and plain.request.params.grammar_kind is None


def test_a_conversation_with_calls_and_results_is_rendered(tok, big_model) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "cold"}]},
    ]
    prompt = tok.decode(list(_chat(tok, big_model, messages=messages).request.prompt_ids), False)
    assert (
        f'<｜Assistant｜>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Oslo</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
        f"</{D}tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>cold</tool_result>"
        "<｜Assistant｜>"
    ) in prompt


BAD_TOOLS = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}
            ]
        },
        "tools[0].function.parameters.properties",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"required": "x"}}}
            ]
        },
        "tools[0].function.parameters.required",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools[0].function.strict",
    ),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
    (
        {
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}},
                    },
                }
            ],
        },
        "tools[0].function.parameters",
    ),
    (
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]},
        "messages[0].tool_call_id",
    ),
    ({"messages": [{"role": "tool"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": {"id": "c"}}]}, "messages[0].tool_calls"),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
        "messages[0].tool_calls[0]",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "[1]"},
                        }
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": {"a": 1}},
                        }
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
    ),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize(("update", "param"), BAD_TOOLS)
def test_bad_tools_are_a_400_naming_the_field(tok, big_model, update: dict, param: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        _chat(tok, big_model, **update)
    assert info.value.http_status == 400 and info.value.param == param, str(info.value)
