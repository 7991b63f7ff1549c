"""DeepSeek-V4's tool-call format (DSML) (pure): read calls out of a model's output, whole or as a
stream, and the grammar that forces calls (`tool_choice` "required" or a named function).

An assistant turn that calls tools ends with one block (what the chat template renders for an
assistant message with `tool_calls`, and what the model writes):

    <text>\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">RAW STRING</｜DSML｜parameter>
    <｜DSML｜parameter name="K2" string="false">JSON VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Several invokes are parallel calls. `parse_tool_calls` and `ToolCallStream` agree on every text and
every way of cutting it into deltas: the content is the text before the block (whitespace before
the marker dropped), the calls are the block's complete invokes (a call cut short by max_tokens is
dropped), text after the block is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

DSML = "｜DSML｜"
MARKER = f"<{DSML}tool_calls>"  # where the calls begin
END_MARKER = f"</{DSML}tool_calls>"
_INVOKE = re.compile(f'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.S)
_PARAMETER = re.compile(
    f'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.S
)
# a raw string parameter without a maxLength is bounded, so that a small model's call ends
MAX_RAW_STRING_CHARS = 200


class ToolCall(NamedTuple):
    """One call: the function's name and its arguments as a JSON object's text."""

    name: str
    arguments: str


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(body: str) -> str:
    """The arguments of one invoke's body: string="true" values as they are, the others as JSON
    (a value that is not JSON is kept as its text)."""
    arguments: dict[str, Any] = {}
    for name, is_string, value in _PARAMETER.findall(body):
        if is_string == "true":
            arguments[name] = value
            continue
        try:
            arguments[name] = json.loads(value)
        except json.JSONDecodeError:
            arguments[name] = value
    return json.dumps(arguments, ensure_ascii=False)


def _calls(block: str) -> list[ToolCall]:
    """The complete invokes of the text after the marker (up to the end marker, if any)."""
    end = block.find(END_MARKER)
    block = block if end < 0 else block[:end]
    return [ToolCall(name, _arguments(body)) for name, body in _INVOKE.findall(block)]


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the content before the calls, the calls) of a whole output; (text, []) without a block."""
    start = text.find(MARKER)
    if start < 0:
        return text, []
    return text[:start].rstrip(), _calls(text[start + len(MARKER) :])


def _held_back(text: str) -> int:
    """Where the part of `text` that may still turn out to precede the marker begins: a suffix
    that is a beginning of the marker, and the whitespace before it."""
    keep = next(
        (n for n in range(min(len(MARKER) - 1, len(text)), 0, -1) if MARKER.startswith(text[-n:])),
        0,
    )
    return len(text[: len(text) - keep].rstrip())


@dataclass
class StreamDelta:
    """What a stream shows next: content, and tool calls in the OpenAI chunk shape
    (`delta.tool_calls` entries: index, id, type and the whole function)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream:
    """`parse_tool_calls` over text deltas: content flows until the marker may begin (a partial
    marker and the whitespace before it are held back), then each call is shown when its invoke
    closes."""

    def __init__(self) -> None:
        self._pending = ""  # content not shown yet
        self._block: str | None = None  # the text after the marker, once it was seen
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        if self._block is not None:
            self._block += text
            return StreamDelta(tool_calls=self._new_calls(self._block))
        self._pending += text
        start = self._pending.find(MARKER)
        if start >= 0:
            content = self._pending[:start].rstrip()
            self._block, self._pending = self._pending[start + len(MARKER) :], ""
            return StreamDelta(content, self._new_calls(self._block))
        shown = _held_back(self._pending)
        content, self._pending = self._pending[:shown], self._pending[shown:]
        return StreamDelta(content)

    def finish(self) -> StreamDelta:
        """The end of the output: what was held back is content after all."""
        content, self._pending = self._pending, ""
        return StreamDelta(content)

    def _new_calls(self, block: str) -> list[dict[str, Any]]:
        """The calls of `block` (the text after the marker) not shown yet, as chunk entries."""
        calls = _calls(block)[self.num_calls :]
        entries = [
            {
                "index": self.num_calls + i,
                "id": new_call_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for i, call in enumerate(calls)
        ]
        self.num_calls += len(calls)
        return entries


# ----- the grammar of forced calls ---------------------------------------------------------------


def _literal(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _compact(schema: Any, defs: Mapping[str, Any]) -> dict[str, Any]:
    """A property's schema for `%json`: compact JSON (as the json_schema kind), with the root's
    definitions so that its `$ref`s resolve."""
    result = dict(schema) if isinstance(schema, Mapping) else {}
    if "$ref" in json.dumps(result):
        result.update(defs)
    result["x-guidance"] = {"whitespace_flexible": False}
    return result


def _is_raw_string(schema: Any) -> bool:
    """Written as raw text (string="true"): a plain string, or an enum / const of strings."""
    if not isinstance(schema, Mapping):
        return False
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:
        return bool(choices) and all(isinstance(c, str) for c in choices)
    return schema.get("type") == "string" and not {"pattern", "format"} & set(schema)


def _raw_value(schema: Mapping[str, Any]) -> str:
    """The Lark body of a raw string value: the literal choices, or text without `<`."""
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:
        return " | ".join(_literal(c) for c in choices)
    low = schema.get("minLength", 0)
    high = schema.get("maxLength", max(MAX_RAW_STRING_CHARS, low if isinstance(low, int) else 0))
    if not isinstance(low, int) or not isinstance(high, int) or not 0 <= low <= high:
        raise ValueError(f"minLength / maxLength must be integers, 0 <= min <= max: {schema}")
    if high == 0:
        return '""'
    text = f"/[^<]{{{max(low, 1)},{high}}}/"
    return text if low > 0 else f"({text})?"


def _invoke_rules(index: int, function: Mapping[str, Any]) -> list[str]:
    """The rules of one function's invoke: `invoke_<index>`, its parameters in schema order
    (required ones always, the others optional)."""
    parameters = function.get("parameters") or {}
    properties = dict(parameters.get("properties") or {})
    required = list(parameters.get("required") or [])
    properties.update({name: {} for name in required if name not in properties})
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    head = f'<{DSML}invoke name="{function["name"]}">\n'
    items, rules = [_literal(head)], []
    for i, (name, schema) in enumerate(properties.items()):
        raw = _is_raw_string(schema)
        rule = f"p_{index}_{i}"
        open_tag = f'<{DSML}parameter name="{name}" string="{"true" if raw else "false"}">'
        value = _raw_value(schema) if raw else "%json " + json.dumps(_compact(schema, defs))
        rules.append(f"{rule}_value: {value}")
        close = _literal(f"</{DSML}parameter>\n")
        rules.append(f"{rule}: {_literal(open_tag)} {rule}_value {close}")
        items.append(rule if name in required else f"{rule}?")
    if not properties:  # as the chat template renders a call without arguments
        items.append(_literal("\n"))
    items.append(_literal(f"</{DSML}invoke>\n"))
    return [f"invoke_{index}: {' '.join(items)}", *rules]


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any], parallel: bool = True
) -> str:
    """The Lark grammar (llguidance's dialect) of a forced calls block: `choice` "required" is one
    or more invokes of any of `tools` (one when not `parallel`), a named function
    ({"type": "function", "function": {"name": ...}}) exactly one invoke of it. `tools` are
    OpenAI tool objects, checked before. The output starts with the blank line and the marker the
    chat template writes before calls, and ends after the end marker."""
    functions = [tool["function"] for tool in tools]
    if choice == "required":
        chosen = list(range(len(functions)))
        repeat = "+" if parallel else ""
    elif isinstance(choice, Mapping):
        name = choice["function"]["name"]
        chosen = [i for i, f in enumerate(functions) if f["name"] == name]
        repeat = ""
    else:
        raise ValueError(
            f"tool_call_grammar: choice must be 'required' or a function, not {choice}"
        )
    if not chosen:
        raise ValueError("tool_call_grammar: no function to call")
    rules = [
        f"start: {_literal(chr(10) * 2 + MARKER + chr(10))} call{repeat} {_literal(END_MARKER)}",
        "call: " + " | ".join(f"invoke_{i}" for i in chosen),
    ]
    for i in chosen:
        rules.extend(_invoke_rules(i, functions[i]))
    return "\n".join(rules) + "\n"
