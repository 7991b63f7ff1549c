"""The OpenAI REST dialect (pure): parse /v1/completions and /v1/chat/completions bodies into a
`GenerationRequest`, and shape events into OpenAI response objects, stream chunks and errors.

Accepted extras (as vLLM): top_k, min_p, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, add_generation_prompt (chat). Structured outputs
(response_format, vLLM's guided_* and structured_outputs) and chat's tools are read by `structured`;
a chat request with tools has its output read for calls (`tool_calls`, DeepSeek-V4's format) and
answered with `message.tool_calls` / `delta.tool_calls` and finish_reason "tool_calls". Features
the mesh does not implement and that would change the output (n > 1, echo, suffix, penalties,
logit_bias, the legacy functions, beam search, ...: `UNSUPPORTED_COMPLETION` /
`UNSUPPORTED_CHAT`) are rejected with a 400 naming the field rather than silently ignored. Other
fields (OpenAI's `user`, `metadata`, `store`, ..., or any unknown name) are accepted and ignored.
These tables are what the OpenAPI document (`openapi`) publishes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_gateway.core import (
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    ModelInfo,
    TokenLogprob,
    Usage,
    build_request,
    invalid,
    new_request_id,
)
from pdmesh_gateway.structured import (
    Constraint,
    message_tool_calls,
    structured_constraint,
    tools_request,
)
from pdmesh_gateway.tool_calls import ToolCallStream, new_call_id, parse_tool_calls
from pdmesh_service.errors import MeshError

# Body fields read as engine sampling settings under the engine's names (the public subset of
# SAMPLING_FIELDS); max_tokens and logprobs have their own rules per endpoint
# (max_completion_tokens, chat's logprobs/top_logprobs).
SAMPLING_BODY_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "cache_salt",  # vLLM's: prefix-cache isolation (the tenant's default when absent)
)
# field -> the only values accepted besides null: features the mesh does not implement (OpenAI's and
# vLLM's) that would change the output. A value passes when it equals one of them as JSON does
# (1 == 1.0, but true is not 1).
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "logit_bias": ({},),
    "use_beam_search": (False,),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
}
UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_COMMON,
    "echo": (False,),
    "suffix": ("",),
}
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_COMMON,
    "echo": (False,),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
    "continue_final_message": (False,),
    "chat_template": (),
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class OpenAIRequest:
    kind: str  # "completion" | "chat"
    request: GenerationRequest
    stream: bool
    include_usage: bool
    logprobs: bool  # return logprobs in the response
    created: int
    parses_tool_calls: bool = False  # the output is read for tool calls (chat with tools)


# ----- parsing ---------------------------------------------------------------------------------


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise invalid(None, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON values compare: numbers by value (1 == 1.0), but a bool only equals a bool
    (Python's True == 1 does not hold in JSON); lists and objects item by item."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (Mapping, list)) or isinstance(b, (Mapping, list)):
        return False
    return bool(a == b)


def _check_unsupported(body: Mapping[str, Any], table: Mapping[str, tuple[Any, ...]]) -> None:
    for name, allowed in table.items():
        value = body.get(name)
        if value is not None and not any(json_equal(value, a) for a in allowed):
            shown = "".join(f"{a!r} or " for a in allowed)
            given = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise invalid(
                name, f"{name}={given} is not supported by this server (only {shown}null)"
            )


def _check_ignored(body: Mapping[str, Any]) -> None:
    """Fields read only to be ignored still have their OpenAI type."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"user must be a string, got {type(user).__name__}")


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, Mapping):
        raise invalid("stream_options", "stream_options must be an object")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise invalid(
            "stream_options.include_usage", f"include_usage must be true or false, got {include!r}"
        )
    return True, bool(include)


def _completion_prompt(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """One prompt: a string, a list of ints, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if prompt is None:
        raise invalid("prompt", "prompt is required")
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "prompt must not be empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", f"only one prompt per request is supported, got {len(prompt)}")
    if isinstance(prompt, list):
        return prompt  # ids: checked by build_request
    raise invalid(
        "prompt", f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
    )


def parse_completion(body: Any, tokenizer: Tokenizer, model: ModelInfo) -> OpenAIRequest:
    """A validated /v1/completions request."""
    body = _object(body)
    model_name = model.resolve(body.get("model"))
    _check_unsupported(body, UNSUPPORTED_COMPLETION)
    _check_ignored(body)
    stream, include_usage = _stream_flags(body)
    ids = _completion_prompt(body.get("prompt"), tokenizer)
    values = {k: body.get(k) for k in SAMPLING_BODY_FIELDS}
    values["max_tokens"], values["logprobs"] = body.get("max_tokens"), body.get("logprobs")
    values.update(_grammar_values(structured_constraint(body)))
    request = build_request(
        new_request_id("cmpl"), ids, values, model, model_name, default_max_tokens=16
    )
    return OpenAIRequest(
        "completion",
        request,
        stream,
        include_usage,
        request.params.logprobs is not None,
        int(time.time()),
    )


def _message_content(content: Any, role: str, index: int) -> str:
    param = f"messages[{index}].content"
    if content is None:
        if role != "assistant":
            raise invalid(param, f"content is required for role {role!r}")
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(
                    param, 'only text content parts ({"type": "text", "text": ...}) are supported'
                )
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(
        param, f"content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _message(m: Mapping[str, Any], role: str, i: int) -> dict[str, Any]:
    """One message as the chat template takes it: role and content, an assistant's tool_calls
    (arguments as objects) and a tool result's tool_call_id."""
    message: dict[str, Any] = {"role": role, "content": _message_content(m.get("content"), role, i)}
    if role == "assistant" and m.get("tool_calls") not in (None, []):
        message["tool_calls"] = message_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
    if role == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise invalid(f"messages[{i}].tool_call_id", "tool_call_id must be a string")
        message["tool_call_id"] = m["tool_call_id"]
    return message


def _messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise invalid("messages", "messages is required")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects")
    result = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise invalid(
                f"messages[{i}]", f"each message must be an object, got {type(m).__name__}"
            )
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role", f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}"
            )
        result.append(_message(m, "system" if role == "developer" else role, i))
    return result


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise invalid("logprobs", f"logprobs must be true or false, got {want!r}")
    if top is not None and not want:
        raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
    return (0 if top is None else top) if want else None


def _grammar_values(constraint: Constraint | None) -> dict[str, str | None]:
    """The sampling fields of a constraint (both None: free text)."""
    if constraint is None:
        return {"grammar_kind": None, "grammar": None}
    return {"grammar_kind": constraint.kind, "grammar": constraint.text}


def parse_chat(body: Any, tokenizer: Tokenizer, model: ModelInfo) -> OpenAIRequest:
    """A validated /v1/chat/completions request (messages, and tools if any, rendered with the
    model's chat template)."""
    body = _object(body)
    model_name = model.resolve(body.get("model"))
    _check_unsupported(body, UNSUPPORTED_CHAT)
    _check_ignored(body)
    stream, include_usage = _stream_flags(body)
    tools = tools_request(body)
    constraint = structured_constraint(body)
    if constraint is not None and tools.is_forced:
        raise invalid(
            constraint.param,
            f"{constraint.param} cannot be combined with a forced tool_choice "
            "(the calls follow their own grammar)",
        )
    constraint = constraint or tools.constraint()
    messages = _messages(body.get("messages"))
    add_prompt = body.get("add_generation_prompt")
    add_prompt = True if add_prompt is None else add_prompt
    if not isinstance(add_prompt, bool):
        raise invalid(
            "add_generation_prompt",
            f"add_generation_prompt must be true or false, got {add_prompt!r}",
        )
    template_tools = {"tools": tools.tools} if tools.tools else {}
    try:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=add_prompt, **template_tools)
    except ValueError as e:
        raise invalid("messages", str(e)) from None
    max_name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    values = {k: body.get(k) for k in SAMPLING_BODY_FIELDS}
    values["max_tokens"], values["logprobs"] = body.get(max_name), _chat_logprobs(body)
    values.update(_grammar_values(constraint))
    request = build_request(
        new_request_id("chatcmpl"),
        ids,
        values,
        model,
        model_name,
        default_max_tokens=None,
        names={"max_tokens": max_name, "logprobs": "top_logprobs"},
        prompt_param="messages",
    )
    return OpenAIRequest(
        "chat",
        request,
        stream,
        include_usage,
        request.params.logprobs is not None,
        int(time.time()),
        tools.parses_calls,
    )


# ----- responses -------------------------------------------------------------------------------


def usage_dict(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage(0, 0)
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": _prompt_details(usage),
    }


def _prompt_details(usage: Usage) -> dict[str, Any]:
    """cached_tokens (OpenAI's), and pdmesh's prefill_path: where the prompt was computed (disagg:
    a prefill rank; local: its decode rank, by conditional disaggregation; agg: its decode rank)."""
    details: dict[str, Any] = {"cached_tokens": usage.cached_tokens}
    if usage.prefill_path:
        details["prefill_path"] = usage.prefill_path
    return details


def error_body(error: MeshError) -> dict[str, Any]:
    """OpenAI's error shape {"error": {message, type, param, code}}."""
    return {
        "error": {
            "message": str(error),
            "type": error.error_type,
            "param": error.param,
            "code": error.code,
        }
    }


def models_response(model: ModelInfo) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model.name,
                "object": "model",
                "created": model.created,
                "owned_by": "pdmesh",
                "root": model.root,
                "parent": None,
                "max_model_len": model.max_model_len,
            }
        ],
    }


def _tool_calls_finish(finish_reason: str | None, has_calls: bool) -> str | None:
    """A choice that ended on its own after calling tools finishes with "tool_calls" (one cut
    short keeps "length" or "abort")."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def _assistant_message(text: str, parses_tool_calls: bool) -> dict[str, Any]:
    """The assistant message of a whole output: with tool calls read out of it, the content is the
    text before them (None if there is none)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if parses_tool_calls:
        content, calls = parse_tool_calls(text)
        message["content"] = (content or None) if calls else content
        if calls:
            message["tool_calls"] = [
                {"id": new_call_id(), "type": "function", "function": call._asdict()}
                for call in calls
            ]
    return message


class Shaper:
    """Shapes one request's events into OpenAI objects; keeps the stream state (text_offset, role
    sent, the tool calls read so far)."""

    def __init__(self, api_request: OpenAIRequest, tokenizer: Tokenizer) -> None:
        self.api_request, self.tokenizer = api_request, tokenizer
        self._offset = 0
        self._role_sent = False
        self._calls = ToolCallStream() if api_request.parses_tool_calls else None
        self._object = (
            "text_completion" if api_request.kind == "completion" else "chat.completion.chunk"
        )

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(
        self, lps: list[TokenLogprob] | tuple[TokenLogprob, ...]
    ) -> dict[str, Any]:
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        top = [{self._token(t): v for t, v in lp.top} for lp in lps]
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def _chat_logprobs(self, lps: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
        content = [
            {
                **self._chat_entry(lp.token_id, lp.logprob),
                "top_logprobs": [self._chat_entry(t, v) for t, v in lp.top],
            }
            for lp in lps
        ]
        return {"content": content, "refusal": None}

    def _logprobs(self, lps: Any) -> dict[str, Any] | None:
        if not self.api_request.logprobs:
            return None
        return (
            self._completion_logprobs(lps)
            if self.api_request.kind == "completion"
            else self._chat_logprobs(lps)
        )

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.api_request.request.request_id,
            "object": obj,
            "created": self.api_request.created,
            "model": self.api_request.request.model,
            "choices": choices,
        }

    def response(self, result: GenerationResult) -> dict[str, Any]:
        """The non-streaming response object."""
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": self._logprobs(result.logprobs),
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        }
        if self.api_request.kind == "completion":
            choice["text"] = result.text
            obj = "text_completion"
        else:
            choice["message"] = _assistant_message(result.text, self.api_request.parses_tool_calls)
            choice["finish_reason"] = _tool_calls_finish(
                result.finish_reason, "tool_calls" in choice["message"]
            )
            obj = "chat.completion"
        return {**self._envelope(obj, [choice]), "usage": usage_dict(result.usage)}

    def chunks(self, event: GenerationEvent) -> list[dict[str, Any]]:
        """Stream chunks for one event (possibly none: no text, no logprobs, not the end)."""
        out = []
        if self.api_request.kind == "chat" and not self._role_sent:
            self._role_sent = True
            out.append(
                self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None})
            )
        has_logprobs = self.api_request.logprobs and event.logprobs
        text, calls, finish = self._read_calls(event)
        if text or calls or has_logprobs or finish is not None:
            if self.api_request.kind == "completion":
                body: dict[str, Any] = {"text": text}
            else:
                delta: dict[str, Any] = {"content": text} if text or not (finish or calls) else {}
                body = {"delta": {**delta, "tool_calls": calls} if calls else delta}
            body["logprobs"] = self._logprobs(event.logprobs) if has_logprobs else None
            body["finish_reason"], body["stop_reason"] = finish, event.stop_reason
            out.append(self._chunk(body))
        return out

    def _read_calls(self, event: GenerationEvent) -> tuple[str, list[dict[str, Any]], str | None]:
        """(content, tool call deltas, finish_reason) of an event, its text read for calls when
        the request has tools."""
        if self._calls is None:
            return event.text, [], event.finish_reason
        delta = self._calls.feed(event.text)
        if event.finish_reason is not None:
            delta.content += self._calls.finish().content
        finish = _tool_calls_finish(event.finish_reason, self._calls.num_calls > 0)
        return delta.content, delta.tool_calls, finish

    def _chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "finish_reason": None, **body}
        chunk = self._envelope(self._object, [choice])
        if self.api_request.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: empty choices, the request's usage."""
        return {**self._envelope(self._object, []), "usage": usage_dict(usage)}
