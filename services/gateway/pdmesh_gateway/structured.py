"""What a request asks of its output's form (pure): structured outputs and tools, read from the body
into the grammar the engine follows (`SamplingParams.grammar_kind` / `grammar`).

- `structured_constraint`: OpenAI's `response_format` and vLLM's extras (`guided_json`,
  `guided_regex`, `guided_grammar`, `guided_choice`, and `structured_outputs` of vLLM >= 0.10): at
  most one per request; each grammar is compiled once here (a 400 naming the field if it does not).
- `tools_request`: chat's `tools`, `tool_choice` and `parallel_tool_calls`. A forced choice
  ("required", or a named function) is a Lark grammar of the calls block (`tool_calls`); "auto"
  leaves the output free and has it read for calls; "none" neither (the tools are still shown to the
  model, as vLLM does).
- `message_tool_calls`: an assistant message's `tool_calls`, as the chat template takes them.

Every rejection is an `invalid(param, message)` whose param is the offending field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdmesh_engine.grammar import check_grammar
from pdmesh_gateway.core import invalid
from pdmesh_gateway.tool_calls import tool_call_grammar

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function and schema names (whole)
TOOL_CHOICES = ("none", "auto", "required")
# structured_outputs' constraints (vLLM >= 0.10) -> the engine's grammar kind
STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "grammar": "ebnf",
    "choice": "choice",
    "json_object": "json_object",
}
# the older top-level names
GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "choice",
}


@dataclass(frozen=True)
class Constraint:
    """A grammar the output follows, and the body field that asked for it."""

    param: str
    kind: str
    text: str | None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _text(param: str, value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise invalid(
            param, f"{param} must be a non-empty string ({what}), got {_type_name(value)}"
        )
    return value


def _constraint(param: str, kind: str, value: Any) -> Constraint | None:
    """The constraint of one field's value in `kind` (None: a null value, or json_object false)."""
    if value is None:
        return None
    if kind == "json_schema":
        if isinstance(value, (Mapping, bool)):
            return Constraint(param, kind, json.dumps(value))
        return Constraint(param, kind, _text(param, value, "a JSON schema, or its text"))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(param, f"{param} must be a non-empty list of strings")
        return Constraint(param, kind, json.dumps(value))
    if kind == "json_object":
        if not isinstance(value, bool):
            raise invalid(param, f"{param} must be true or false, got {value!r}")
        return Constraint(param, kind, None) if value else None
    return Constraint(param, kind, _text(param, value, f"a {kind} grammar"))


def _json_schema_format(value: Any) -> Constraint:
    """response_format {"type": "json_schema", "json_schema": {name, schema?, strict?,
    description?}}; no schema: any JSON."""
    param = "response_format.json_schema"
    if not isinstance(value, Mapping):
        raise invalid(param, f"{param} is required with type json_schema and must be an object")
    name = value.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(
            f"{param}.name",
            f"{param}.name is required: a string of letters, digits, _ and - (at most 64)",
        )
    for key, kind in (("strict", bool), ("description", str)):
        if value.get(key) is not None and not isinstance(value[key], kind):
            raise invalid(f"{param}.{key}", f"{param}.{key} must be a {kind.__name__}")
    schema = value.get("schema")
    if schema is not None and not isinstance(schema, (Mapping, bool)):
        raise invalid(f"{param}.schema", f"{param}.schema must be a JSON schema (an object)")
    return Constraint(
        "response_format", "json_schema", json.dumps({} if schema is None else schema)
    )


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("response_format", "json_object", None)
    if kind == "json_schema":
        return _json_schema_format(value.get("json_schema"))
    raise invalid(
        "response_format",
        'response_format must be {"type": "text"}, {"type": "json_object"} or '
        f'{{"type": "json_schema", "json_schema": {{...}}}}, got {value!r:.80}',
    )


def _structured_outputs(value: Any) -> list[Constraint]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise invalid("structured_outputs", "structured_outputs must be an object")
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS))
    if unknown:
        raise invalid(
            f"structured_outputs.{unknown[0]}",
            f"structured_outputs.{unknown[0]} is not supported by this server "
            f"(only {', '.join(STRUCTURED_OUTPUTS)})",
        )
    found = (_constraint(f"structured_outputs.{k}", STRUCTURED_OUTPUTS[k], value[k]) for k in value)
    return [c for c in found if c is not None]


def structured_constraint(body: Mapping[str, Any]) -> Constraint | None:
    """The body's structured-output constraint, compiled once (None: free text)."""
    found = [
        _response_format(body.get("response_format")),
        *(_constraint(name, kind, body.get(name)) for name, kind in GUIDED.items()),
        *_structured_outputs(body.get("structured_outputs")),
    ]
    constraints = [c for c in found if c is not None]
    if len(constraints) > 1:
        first, second = constraints[:2]
        raise invalid(
            second.param,
            f"{first.param} and {second.param} both constrain the output; give at most one",
        )
    if constraints:
        check(constraints[0])
    return constraints[0] if constraints else None


def check(constraint: Constraint, param: str | None = None) -> None:
    """A 400 naming `param` (default: the constraint's field) unless its grammar compiles."""
    try:
        check_grammar(constraint.kind, constraint.text)
    except ValueError as e:
        name = param or constraint.param
        raise invalid(name, f"{name}: {e}") from None


# ----- tools -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolsRequest:
    """A chat request's tools (OpenAI tool objects, checked), its choice ("none", "auto",
    "required" or {"type": "function", "function": {"name": ...}}) and parallel_tool_calls."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str | dict[str, Any] = "none"
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """The output is read for tool calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def is_forced(self) -> bool:
        return bool(self.tools) and self.choice not in ("none", "auto")

    def constraint(self) -> Constraint | None:
        """The grammar of a forced choice (compiled once; None: not forced)."""
        if not self.is_forced:
            return None
        named = self.choice["function"]["name"] if isinstance(self.choice, dict) else None
        for i, tool in enumerate(self.tools):
            parameters = tool["function"].get("parameters")
            if parameters is not None and named in (None, tool["function"]["name"]):
                schema = Constraint("", "json_schema", json.dumps(parameters))
                check(schema, f"tools[{i}].function.parameters")
        try:
            grammar = tool_call_grammar(self.tools, self.choice, self.parallel)
        except ValueError as e:
            raise invalid("tools", str(e)) from None
        constraint = Constraint("tool_choice", "lark", grammar)
        check(constraint, "tools")
        return constraint


def _parameters(value: Any, param: str) -> dict[str, Any] | None:
    """A function's parameters: a JSON schema object whose properties are schemas and whose
    required names are strings (what the calls grammar reads)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid(param, f"{param} must be a JSON schema object, got {_type_name(value)}")
    properties, required = value.get("properties"), value.get("required")
    if properties is not None and (
        not isinstance(properties, Mapping)
        or not all(isinstance(s, (Mapping, bool)) for s in properties.values())
    ):
        raise invalid(f"{param}.properties", f"{param}.properties must map names to schemas")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        raise invalid(f"{param}.required", f"{param}.required must be a list of names")
    return dict(value)


def _tool(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise invalid(param, f'{param} must be {{"type": "function", "function": {{...}}}}')
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise invalid(f"{param}.function", f"{param}.function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(
            f"{param}.function.name",
            f"{param}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r:.80}",
        )
    for key, kind in (("description", str), ("strict", bool)):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise invalid(
                f"{param}.function.{key}", f"{param}.function.{key} must be a {kind.__name__}"
            )
    checked = {k: v for k, v in function.items() if v is not None}
    parameters = _parameters(function.get("parameters"), f"{param}.function.parameters")
    if parameters is not None:
        checked["parameters"] = parameters
    return {"type": "function", "function": checked}


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools", f"tools must be a list of tool objects, got {_type_name(value)}")
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(value)]
    names = [t["function"]["name"] for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise invalid("tools", f"tools must have distinct names; {duplicates[0]!r} repeats")
    return tools


def _tool_choice(value: Any, names: list[str]) -> str | dict[str, Any]:
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, str) and value in TOOL_CHOICES:
        choice: str | dict[str, Any] = value
    elif (
        isinstance(value, Mapping)
        and value.get("type") == "function"
        and isinstance(value.get("function"), Mapping)
        and isinstance(value["function"].get("name"), str)
    ):
        if value["function"]["name"] not in names:
            raise invalid(
                "tool_choice",
                f"tool_choice names the function {value['function']['name']!r:.80}, "
                "which is not in tools",
            )
        choice = {"type": "function", "function": {"name": value["function"]["name"]}}
    else:
        raise invalid(
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r:.80}',
        )
    if choice not in ("none", "auto") and not names:
        raise invalid("tool_choice", "tool_choice forces a call and needs tools")
    return choice


def tools_request(body: Mapping[str, Any]) -> ToolsRequest:
    """A chat body's tools, tool_choice and parallel_tool_calls, checked."""
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), [t["function"]["name"] for t in tools])
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(
            "parallel_tool_calls", f"parallel_tool_calls must be true or false, got {parallel!r}"
        )
    return ToolsRequest(tools, choice, parallel is not False)


def message_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as the chat template takes them: the arguments as an
    object (the body has them as a JSON object's text)."""
    if not isinstance(value, list):
        raise invalid(param, f"{param} must be a list of tool calls")
    calls = []
    for i, call in enumerate(value):
        here = f"{param}[{i}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if (
            not isinstance(call, Mapping)
            or call.get("type") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
        ):
            raise invalid(
                here,
                f'{here} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                '"arguments": ...}}',
            )
        text = function.get("arguments")
        try:
            arguments = json.loads(text) if isinstance(text, str) else None
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid(
                f"{here}.function.arguments",
                f"{here}.function.arguments must be the text of a JSON object",
            )
        calls.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls
