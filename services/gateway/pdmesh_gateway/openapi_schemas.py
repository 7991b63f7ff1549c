"""JSON schemas of the gateway's answers (pure), for its OpenAPI document (`openapi`).

The OpenAI bodies mirror what `openai_api` shapes (responses, stream chunks, the error object); the
finish reasons come from the protos (`pdmesh_service.convert`); the /mesh rows are derived from the
dataclasses they are written from (`dataclass_schema`), so a field added there is documented too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any

from pdmesh_gateway.orchestrator import Mode
from pdmesh_gateway.start import Path
from pdmesh_service.convert import FINISH_REASON_OF
from pdmesh_service.eplb_protocol import RebalanceRecord
from pdmesh_service.instance import InstanceInfo, Role

HEALTH_ROLES = (Role.DECODE, Role.PREFILL, Role.KVSTORE)  # /health counts their ready ranks
_PY_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
STRING, INTEGER, NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def integer(lo: int | None = None, hi: int | None = None, **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer", **extra}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return schema


def obj(properties: Mapping[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": dict(properties), "required": list(required)}


def _type_schema(hint: Any) -> dict[str, Any]:
    """The JSON schema of a dataclass field's type hint (as `dataclasses.asdict` writes it)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        schema = (
            _type_schema(inner[0]) if len(inner) == 1 else {"anyOf": [*map(_type_schema, inner)]}
        )
        return nullable(schema) if type(None) in args else schema
    if typing.get_origin(hint) is typing.Literal:
        return {"type": "string", "enum": list(args)}
    if isinstance(hint, type) and issubclass(hint, Enum):
        return {"type": "string", "enum": [m.value for m in hint]}
    if dataclasses.is_dataclass(hint):
        return dataclass_schema(hint)
    if hint in _PY_TYPES:
        return {"type": _PY_TYPES[hint]}
    raise TypeError(f"no JSON schema for {hint!r}")


def dataclass_schema(cls: Any) -> dict[str, Any]:
    """The schema of `dataclasses.asdict(cls(...))`: every field, all present."""
    hints = typing.get_type_hints(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    return obj({n: _type_schema(hints[n]) for n in names}, names)


def _finish_reason() -> dict[str, Any]:
    # None (not finished) included; tool_calls: a chat choice that ended after calling tools
    return {"enum": [*FINISH_REASON_OF.values(), "tool_calls"]}


def tool_call(index: bool = False) -> dict[str, Any]:
    """A tool call of a message (id, type, function: name and arguments, a JSON object's text); in
    a stream chunk (`index`) everything but the index may be left out."""
    function = obj({"name": STRING, "arguments": STRING}, ("name", "arguments"))
    call = obj({"id": STRING, "type": {"const": "function"}, "function": function})
    if index:
        call["properties"]["index"] = integer(0)
        call["required"] = ["index"]
    else:
        call["required"] = ["id", "type", "function"]
    return call


def _choice_end() -> dict[str, Any]:
    return {
        "finish_reason": _finish_reason(),
        "stop_reason": {
            "anyOf": [STRING, INTEGER, {"type": "null"}],
            "description": "The stop string or stop token id that ended the choice.",
        },
    }


def _envelope(kind: str, choice: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    properties = {
        "id": STRING,
        "object": {"const": kind},
        "created": INTEGER,
        "model": STRING,
        "choices": {"type": "array", "items": choice},
        "usage": usage,
    }
    return obj(properties, ("id", "object", "created", "model", "choices"))


def _logprob_entry() -> dict[str, Any]:
    return obj(
        {"token": STRING, "logprob": NUMBER, "bytes": {"type": "array", "items": INTEGER}},
        ("token", "logprob", "bytes"),
    )


def response_schemas() -> dict[str, Any]:
    """Components: the 200 bodies, stream chunks and the error object."""
    completion_lp = obj(
        {
            "tokens": {"type": "array", "items": STRING},
            "token_logprobs": {"type": "array", "items": NUMBER},
            "top_logprobs": {
                "type": "array",
                "items": {"type": "object", "additionalProperties": NUMBER},
            },
            "text_offset": {"type": "array", "items": INTEGER},
        },
        ("tokens", "token_logprobs", "top_logprobs", "text_offset"),
    )
    chat_entry = _logprob_entry()
    chat_entry["properties"]["top_logprobs"] = {"type": "array", "items": _logprob_entry()}
    chat_lp = obj({"content": {"type": "array", "items": chat_entry}, "refusal": {}})
    completion_choice = obj(
        {"index": INTEGER, "text": STRING, "logprobs": nullable(completion_lp), **_choice_end()},
        ("index", "text", "logprobs", "finish_reason"),
    )
    message = obj(
        {
            "role": {"const": "assistant"},
            "content": nullable(STRING),
            "refusal": {"type": "null"},
            "tool_calls": {"type": "array", "items": tool_call()},
        },
        ("role", "content"),
    )
    chat_choice = obj(
        {"index": INTEGER, "message": message, "logprobs": nullable(chat_lp), **_choice_end()},
        ("index", "message", "logprobs", "finish_reason"),
    )
    delta = obj(
        {
            "role": {"const": "assistant"},
            "content": STRING,
            "tool_calls": {"type": "array", "items": tool_call(index=True)},
        }
    )
    chunk_choice = obj(
        {"index": INTEGER, "delta": delta, "logprobs": nullable(chat_lp), **_choice_end()},
        ("index", "delta", "finish_reason"),
    )
    usage = obj(
        {
            "prompt_tokens": integer(0),
            "completion_tokens": integer(0),
            "total_tokens": integer(0),
            "prompt_tokens_details": obj(
                {
                    "cached_tokens": integer(0),
                    "prefill_path": {"type": "string", "enum": [str(p) for p in Path]},
                },
                ("cached_tokens",),
            ),
        },
        ("prompt_tokens", "completion_tokens", "total_tokens"),
    )
    error = obj(
        {
            "message": STRING,
            "type": STRING,
            "param": nullable(STRING),
            "code": nullable(STRING),
        },
        ("message", "type", "param", "code"),
    )
    return {
        "Usage": usage,
        "Completion": _envelope("text_completion", completion_choice, ref("Usage")),
        "ChatCompletion": _envelope("chat.completion", chat_choice, ref("Usage")),
        "CompletionChunk": _envelope("text_completion", completion_choice, nullable(ref("Usage"))),
        "ChatCompletionChunk": _envelope(
            "chat.completion.chunk", chunk_choice, nullable(ref("Usage"))
        ),
        "Error": obj({"error": error}, ("error",)),
        "ServerSentEvent": obj({"data": STRING, "event": STRING}, ("data",)),
    }


def mesh_schemas() -> dict[str, Any]:
    instance = dataclass_schema(InstanceInfo)
    instance["properties"]["age_ms"] = integer(0)
    instance["properties"]["metrics_url"] = nullable(STRING)  # its Prometheus endpoint
    instance["required"] += ["age_ms", "metrics_url"]
    eplb_row = obj(
        {
            "instance": STRING,
            "model": STRING,
            "version": integer(0),
            "enabled": nullable({"type": "boolean"}),
            "balancedness": nullable(NUMBER),
            "running_versions": {"type": "object", "additionalProperties": INTEGER},
            "last_rebalance": nullable(dataclass_schema(RebalanceRecord)),
        },
        ("instance", "model", "version", "enabled", "balancedness", "running_versions"),
    )
    health = obj(
        {
            "status": {
                "enum": ["ok", "degraded", "unavailable"],
                "description": "unavailable (503): no decode rank; degraded: see problems.",
            },
            "mode": {"enum": [m.value for m in Mode]},
            **{str(role): integer(0) for role in HEALTH_ROLES},
            "problems": {"type": "array", "items": STRING},
        },
        ("status", "mode", *map(str, HEALTH_ROLES), "problems"),
    )
    model = obj(
        {
            "id": STRING,
            "object": {"const": "model"},
            "created": INTEGER,
            "owned_by": STRING,
            "root": STRING,
            "parent": {"type": "null"},
            "max_model_len": integer(1),
        },
        ("id", "object", "created", "owned_by", "root", "max_model_len"),
    )
    return {
        "Instance": instance,
        "EplbRow": eplb_row,
        "Health": health,
        "ModelList": obj(
            {"object": {"const": "list"}, "data": {"type": "array", "items": model}},
            ("object", "data"),
        ),
    }
