"""The gateway's OpenAPI 3.1 document (pure): what `GET /openapi.json` serves.

It describes exactly what `rest` routes and `openai_api` accepts. The numbers and names come from
the code that enforces them, never from a copy: the sampling ranges from `pdmesh_engine.sampling`,
the stop-string limits from `core`, the fields and unsupported features from `openai_api`, the
error statuses from the domain errors, the guarded routes from `auth`; the answers' schemas are in
`openapi_schemas`. The served model (its names, context, vocabulary) and the body limit come from
the running gateway. A test checks that the document's operations and the app's routes are the
same set, and schemathesis that the app keeps to the document.

Bounds the schema cannot state (prompt tokens + max_tokens <= the context, min_tokens <= max_tokens,
the chat template's own rules) are in the descriptions; breaking them is a 400 like any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdmesh_engine import sampling
from pdmesh_gateway.auth import InvalidApiKey, is_protected
from pdmesh_gateway.core import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, ModelInfo
from pdmesh_gateway.openai_api import (
    CHAT_ROLES,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    json_equal,
)
from pdmesh_gateway.openapi_schemas import (
    NUMBER,
    STRING,
    integer,
    mesh_schemas,
    nullable,
    obj,
    ref,
    response_schemas,
    tool_call,
)
from pdmesh_gateway.structured import NAME, TOOL_CHOICES
from pdmesh_service import errors

OPENAPI_VERSION = "3.1.0"
JSON, SSE, TEXT = "application/json", "text/event-stream", "text/plain"
# The statuses a generation request can end with besides 200: those of the errors behind them.
GENERATION_STATUSES = frozenset(
    c.http_status
    for c in (
        errors.InvalidArgument,
        errors.NotFound,
        errors.PayloadTooLarge,
        errors.MeshError,
        errors.Unavailable,
        errors.ResourceExhausted,
        errors.DeadlineExceeded,
    )
)


def _unsupported(allowed: tuple[Any, ...], name: str) -> dict[str, Any]:
    values: list[Any] = []
    for value in (*allowed, None):
        if not any(json_equal(value, v) for v in values):
            values.append(value)
    shown = " or ".join("null" if v is None else repr(v) for v in values)
    return {"enum": values, "description": f"Not supported: {name} may only be {shown}."}


# ----- requests ----------------------------------------------------------------------------------


def _request(properties: dict[str, Any], required: str) -> dict[str, Any]:
    """A request body: `required` must be there; every other field may be null (the default, as
    OpenAI reads it) or left out; unknown fields are allowed (and ignored)."""
    for name, schema in properties.items():
        if name != required and None not in schema.get("enum", ()):
            description = schema.pop("description", None)
            properties[name] = nullable(schema)
            if description is not None:
                properties[name]["description"] = description
    return obj(properties, (required,))


def _token_ids(model: ModelInfo, min_items: int = 0) -> dict[str, Any]:
    return {
        "type": "array",
        "items": integer(0, model.vocab_size - 1),
        "minItems": min_items,
    }


def _sampling_properties(model: ModelInfo) -> dict[str, Any]:
    """The engine's sampling fields as the body names them (`openai_api.SAMPLING_BODY_FIELDS`)."""
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}
    return {
        "temperature": {
            "type": "number",
            "minimum": 0,
            "maximum": sampling.MAX_TEMPERATURE,
            "description": f"0 (or below {sampling.GREEDY_TEMPERATURE_EPS:g}) is greedy.",
        },
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": integer(-1, sampling.INT32_MAX, description="0 or -1 disables it."),
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "seed": integer(sampling._SEED_MIN, sampling._SEED_MAX),
        "stop": {
            "anyOf": [
                stop_string,
                {"type": "array", "items": stop_string, "maxItems": MAX_STOP_STRINGS},
            ],
            "description": "Text that ends the completion (not returned).",
        },
        "stop_token_ids": {
            **_token_ids(model),
            "description": "Token ids that end the completion.",
        },
        "ignore_eos": {"type": "boolean"},
        "min_tokens": integer(0, sampling.UINT32_MAX, description="At most max_tokens."),
        "include_stop_str_in_output": {"type": "boolean"},
        "skip_special_tokens": {"type": "boolean"},
        "cache_salt": {
            "type": "string",
            "description": "Requests share cached prompt blocks only with requests of the same "
            "salt (default: the tenant's).",
        },
    }


def _structured_properties() -> dict[str, Any]:
    """Structured outputs (`structured`): at most one of these per request; a grammar that does not
    compile is a 400 naming its field."""
    schema = {"anyOf": [{"type": "object"}, {"type": "boolean"}], "description": "A JSON schema."}
    schema_or_text = {
        "anyOf": [*schema["anyOf"], STRING],
        "description": "A JSON schema or its text.",
    }
    text = {"type": "string", "minLength": 1}
    choices = {"type": "array", "items": STRING, "minItems": 1}
    json_schema = obj(
        {
            "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
            "schema": nullable(schema),
            "strict": nullable({"type": "boolean"}),
            "description": nullable(STRING),
        },
        ("name",),
    )
    kinds = ("text", "json_object")
    formats = [obj({"type": {"const": k}}, ("type",)) for k in kinds]
    formats.append(
        obj({"type": {"const": "json_schema"}, "json_schema": json_schema}, ("type", "json_schema"))
    )
    outputs: dict[str, dict[str, Any]] = {
        "json": schema_or_text,
        "regex": text,
        "grammar": text,
        "choice": choices,
        "json_object": {"type": "boolean"},
    }
    return {
        "response_format": {
            "anyOf": formats,
            "description": "OpenAI's structured outputs (JSON is generated without whitespace).",
        },
        "guided_json": schema_or_text,
        "guided_regex": {**text, "description": "A regular expression the output matches."},
        "guided_grammar": {**text, "description": "A GBNF (llama.cpp) or Lark grammar."},
        "guided_choice": {**choices, "description": "The output is one of these."},
        "structured_outputs": {
            "type": "object",
            "properties": {k: nullable(v) for k, v in outputs.items()},
            "additionalProperties": False,
            "description": "vLLM's form: one of json, regex, grammar (GBNF or Lark), choice, "
            "json_object.",
        },
    }


def _tool_properties() -> dict[str, Any]:
    """Chat's tools (`structured`): calls are read out of the output (DeepSeek-V4's format)."""
    function = obj(
        {
            "name": {"type": "string", "pattern": f"^{NAME.pattern}$"},
            "description": nullable(STRING),
            "parameters": nullable({"type": "object", "description": "A JSON schema."}),
            "strict": nullable({"type": "boolean"}),
        },
        ("name",),
    )
    named = obj({"type": {"const": "function"}, "function": obj({"name": STRING}, ("name",))})
    named["required"] = ["type", "function"]
    return {
        "tools": {
            "type": "array",
            "items": obj(
                {"type": {"const": "function"}, "function": function}, ("type", "function")
            ),
            "description": "Distinct names. Shown to the model in its chat template.",
        },
        "tool_choice": {
            "anyOf": [{"enum": list(TOOL_CHOICES)}, named],
            "description": "Default: auto with tools, else none. required or a named function "
            "force calls (a grammar; not with a structured output); auto reads calls out of free "
            "text; none shows the tools but reads no calls.",
        },
        "parallel_tool_calls": {
            "type": "boolean",
            "description": "false: a forced choice makes one call.",
        },
    }


def _common_properties(
    model: ModelInfo, unsupported: Mapping[str, tuple[Any, ...]]
) -> dict[str, Any]:
    context = (
        f"Prompt tokens + max_tokens must fit the context ({model.max_model_len} tokens), "
        "else the answer is a 400 naming this field."
    )
    properties: dict[str, Any] = {
        "model": {
            "enum": [model.name, model.root, "", None],
            "description": "The served model (null or empty: that one); another name is a 404.",
        },
        "max_tokens": integer(1, sampling.UINT32_MAX, description=context),
        "stream": {"type": "boolean"},
        "stream_options": {
            **obj({"include_usage": {"type": "boolean"}}),
            "description": "Only with stream: true.",
        },
        "user": {"type": "string", "description": "Accepted and ignored."},
        **_sampling_properties(model),
        **_structured_properties(),
    }
    properties.update({name: _unsupported(v, name) for name, v in unsupported.items()})
    return properties


def completion_request(model: ModelInfo) -> dict[str, Any]:
    text = {"type": "string", "minLength": 1}
    prompt = {
        "anyOf": [
            text,
            _token_ids(model, 1),
            {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": _token_ids(model, 1), "minItems": 1, "maxItems": 1},
        ],
        "description": "One prompt: text or token ids (a list of one of them is also accepted).",
    }
    properties = _common_properties(model, UNSUPPORTED_COMPLETION)
    properties["max_tokens"]["description"] += " Default 16."
    properties.update(
        {
            "prompt": prompt,
            "logprobs": integer(0, sampling.MAX_LOGPROBS, description="Top alternatives returned."),
        }
    )
    return _request(properties, "prompt")


def _message() -> dict[str, Any]:
    part = obj({"type": {"const": "text"}, "text": {"type": "string"}}, ("type", "text"))
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    others = [r for r in CHAT_ROLES if r not in ("assistant", "tool")]
    tool = {"role": {"const": "tool"}, "content": content, "tool_call_id": nullable(STRING)}
    calls = {"type": "array", "items": tool_call()}
    assistant = {"role": {"const": "assistant"}, "content": nullable(content)}
    return {
        "anyOf": [
            obj({"role": {"enum": others}, "content": content}, ("role", "content")),
            obj(tool, ("role", "content")),
            obj({**assistant, "tool_calls": nullable(calls)}, ("role",)),
        ],
        "description": "Rendered with the model's chat template (which may refuse a role).",
    }


def chat_request(model: ModelInfo) -> dict[str, Any]:
    properties = _common_properties(model, UNSUPPORTED_CHAT)
    properties["max_tokens"]["description"] += " Default: the rest of the context."
    properties.update(
        {
            "messages": {"type": "array", "items": _message(), "minItems": 1},
            "max_completion_tokens": {
                **properties["max_tokens"],
                "description": "Takes precedence over max_tokens.",
            },
            "logprobs": {"type": "boolean"},
            "top_logprobs": integer(
                0, sampling.MAX_LOGPROBS, description="Only with logprobs: true."
            ),
            "add_generation_prompt": {"type": "boolean"},
            **_tool_properties(),
        }
    )
    return _request(properties, "messages")


# ----- operations --------------------------------------------------------------------------------


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {JSON: {"schema": schema}}


def _ok(description: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": content}


def _errors(statuses: frozenset[int], max_body_bytes: int) -> dict[str, Any]:
    texts = {
        400: "Invalid request: `error.param` names the field.",
        InvalidApiKey.http_status: "No API key, or a wrong one (`Authorization: Bearer <key>`).",
        404: "Unknown model.",
        413: f"The body is over {max_body_bytes} bytes.",
        500: "Internal error.",
        503: "No rank can take the request now (none ready, or overloaded).",
        504: "The request timed out.",
    }
    return {str(s): _ok(texts[s], _json(ref("Error"))) for s in sorted(statuses)}


def request_examples(model: ModelInfo) -> dict[str, dict[str, Any]]:
    """Example bodies per request schema: a plain request and a streamed one with logprobs."""
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    return {
        "CompletionRequest": {
            "text": {"model": model.name, "prompt": "Hello", "max_tokens": 8},
            "stream": {"prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2, "stop": "\n", **stream},
        },
        "ChatCompletionRequest": {
            "chat": {"model": model.name, "messages": messages, "max_completion_tokens": 8},
            "stream": {"messages": messages, "logprobs": True, "top_logprobs": 2, **stream},
        },
    }


def _generation(
    request: str, response: str, chunk: str, errors_: dict[str, Any], examples: dict[str, Any]
) -> dict[str, Any]:
    stream = {
        "schema": {
            **ref("ServerSentEvent"),
            "description": f"With stream: true: `data:` lines holding a {chunk} (or an Error if "
            "the request fails after its first chunk), ending with `data: [DONE]`.",
        }
    }
    ok = _ok("The result.", {**_json(ref(response)), SSE: stream})
    body = {"schema": ref(request), "examples": {k: {"value": v} for k, v in examples.items()}}
    dp_rank = {
        "name": "X-Data-Parallel-Rank",
        "in": "header",
        "required": False,
        "description": "Compute the prompt on a rank whose DP rank is this (400 if none has it).",
        "schema": integer(0),
    }
    return {
        "post": {
            "operationId": f"create{response}",
            "parameters": [dp_rank],
            "requestBody": {"required": True, "content": {JSON: body}},
            "responses": {"200": ok, **errors_},
        }
    }


def _get(
    operation_id: str,
    description: str,
    schema: dict[str, Any],
    media_type: str = JSON,
    more: dict[str, Any] | None = None,
) -> dict[str, Any]:
    responses = {"200": _ok(description, {media_type: {"schema": schema}}), **(more or {})}
    return {"get": {"operationId": operation_id, "responses": responses}}


# the answer of /health/live and /health/ready (`pdmesh_service.probes.Verdict.body`)
PROBE = {
    "type": "object",
    "properties": {"status": {"enum": ["ok", "unavailable"]}, "reason": {"type": "string"}},
    "required": ["status"],
}


def _paths(model: ModelInfo, max_body_bytes: int) -> dict[str, Any]:
    generation_errors = _errors(GENERATION_STATUSES, max_body_bytes)
    examples = request_examples(model)
    rows = {"type": "array", "items": ref("EplbRow")}
    instances = {"type": "array", "items": ref("Instance")}
    restart = obj(
        {"restarts": integer(0), "last_exit_code": integer(), "at_ms": integer(0)},
        ("restarts", "last_exit_code", "at_ms"),
    )
    restarts = nullable({"type": "object", "additionalProperties": restart})
    routing = obj(
        {
            "prefill": STRING,
            "decode_balance": STRING,
            "local_prefill": STRING,
            "local_prefill_threshold_tokens": integer(0),
            "handoff_overhead_ms": NUMBER,
            "prefill_tokens_per_s": NUMBER,
            "handoffs_measured": integer(0),
            "kv_bytes_per_handoff": nullable(integer(0)),
            "kv_bytes_per_prompt_token": nullable(NUMBER),
            "prefill_paths": {"type": "object", "additionalProperties": integer(0)},
        },
        ("prefill", "local_prefill", "local_prefill_threshold_tokens", "prefill_paths"),
    )
    mesh = obj(
        {"instances": instances, "eplb": rows, "restarts": restarts, "routing": routing},
        ("instances", "eplb", "restarts", "routing"),
    )
    unavailable = {"503": _ok("Unavailable: no decode rank is ready.", _json(ref("Health")))}
    return {
        "/v1/models": _get("listModels", "The served model.", ref("ModelList")),
        "/v1/completions": _generation(
            "CompletionRequest",
            "Completion",
            "CompletionChunk",
            generation_errors,
            examples["CompletionRequest"],
        ),
        "/v1/chat/completions": _generation(
            "ChatCompletionRequest",
            "ChatCompletion",
            "ChatCompletionChunk",
            generation_errors,
            examples["ChatCompletionRequest"],
        ),
        "/health": _get("health", "Ok, or degraded.", ref("Health"), more=unavailable),
        "/health/live": _get(
            "healthLive",
            "Live: the process serves (liveness probe).",
            PROBE,
            more={"503": _ok("Not live: the reason.", _json(PROBE))},
        ),
        "/health/ready": _get(
            "healthReady",
            "Ready: started, not draining, the registry readable, a decode rank ready "
            "(readiness probe).",
            PROBE,
            more={"503": _ok("Not ready: the reason.", _json(PROBE))},
        ),
        "/metrics": _get("metrics", "Prometheus metrics (text format).", STRING, TEXT),
        "/mesh": _get(
            "mesh", "Every registered rank, the EPLB rows and the services' restarts.", mesh
        ),
        "/mesh/eplb": _get("meshEplb", "Expert placements per (instance, model).", rows),
        "/openapi.json": _get("openapi", "This document.", {"type": "object"}),
    }


def _require_api_key(document: dict[str, Any], max_body_bytes: int) -> None:
    """A bearer scheme on the routes `auth.ApiKeyMiddleware` guards, and their 401."""
    document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    refusal = _errors(frozenset({InvalidApiKey.http_status}), max_body_bytes)
    for path, item in document["paths"].items():
        if is_protected(path):
            for operation in item.values():
                operation["security"] = [{"bearer": []}]
                operation["responses"].update(refusal)


def build_openapi(
    model: ModelInfo, *, max_body_bytes: int, requires_api_key: bool = False
) -> dict[str, Any]:
    """The document of a gateway serving `model` that refuses bodies over `max_body_bytes`;
    `requires_api_key`: the app was made with an API key (`rest.create_app(api_key=...)`)."""
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "pdmesh gateway",
            "version": "1",
            "description": "The OpenAI-compatible API of a pdmesh deployment, and its status.",
        },
        "paths": _paths(model, max_body_bytes),
        "components": {
            "schemas": {
                "CompletionRequest": completion_request(model),
                "ChatCompletionRequest": chat_request(model),
                **response_schemas(),
                **mesh_schemas(),
            }
        },
    }
    if requires_api_key:
        _require_api_key(document, max_body_bytes)
    return document
