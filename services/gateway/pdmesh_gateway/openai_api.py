"""The OpenAI REST dialect (pure): parse /v1/completions and /v1/chat/completions bodies into a
`GenerationRequest`, and shape events into OpenAI response objects, stream chunks and errors.

Accepted extras (as vLLM): top_k, min_p, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, add_generation_prompt (chat). Features the mesh
does not implement and that would change the output (n > 1, echo, suffix, penalties, logit_bias,
tools, structured output, beam search, ...: `UNSUPPORTED_COMPLETION` / `UNSUPPORTED_CHAT`) are
rejected with a 400 naming the field rather than silently ignored. Other fields (OpenAI's `user`,
`metadata`, `store`, ..., or any unknown name) are accepted and ignored. These tables are what the
OpenAPI document (`openapi`) publishes.
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
    "response_format": ({"type": "text"},),
    "use_beam_search": (False,),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}
UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_COMMON,
    "echo": (False,),
    "suffix": ("",),
}
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_COMMON,
    "echo": (False,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # with no tools both mean plain text
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


def _messages(messages: Any) -> list[dict[str, str]]:
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
        role = "system" if role == "developer" else role
        result.append({"role": role, "content": _message_content(m.get("content"), role, i)})
    return result


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise invalid("logprobs", f"logprobs must be true or false, got {want!r}")
    if top is not None and not want:
        raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
    return (0 if top is None else top) if want else None


def parse_chat(body: Any, tokenizer: Tokenizer, model: ModelInfo) -> OpenAIRequest:
    """A validated /v1/chat/completions request (messages rendered with the model's chat
    template)."""
    body = _object(body)
    model_name = model.resolve(body.get("model"))
    _check_unsupported(body, UNSUPPORTED_CHAT)
    _check_ignored(body)
    stream, include_usage = _stream_flags(body)
    messages = _messages(body.get("messages"))
    add_prompt = body.get("add_generation_prompt")
    add_prompt = True if add_prompt is None else add_prompt
    if not isinstance(add_prompt, bool):
        raise invalid(
            "add_generation_prompt",
            f"add_generation_prompt must be true or false, got {add_prompt!r}",
        )
    try:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=add_prompt)
    except ValueError as e:
        raise invalid("messages", str(e)) from None
    max_name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    values = {k: body.get(k) for k in SAMPLING_BODY_FIELDS}
    values["max_tokens"], values["logprobs"] = body.get(max_name), _chat_logprobs(body)
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


class Shaper:
    """Shapes one request's events into OpenAI objects; keeps the stream state (text_offset, role
    sent)."""

    def __init__(self, api_request: OpenAIRequest, tokenizer: Tokenizer) -> None:
        self.api_request, self.tokenizer = api_request, tokenizer
        self._offset = 0
        self._role_sent = False
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
            choice["message"] = {"role": "assistant", "content": result.text, "refusal": None}
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
        if event.text or has_logprobs or event.finish_reason is not None:
            if self.api_request.kind == "completion":
                body = {"text": event.text}
            else:
                body = {
                    "delta": {"content": event.text}
                    if event.text or not event.finish_reason
                    else {}
                }
            body["logprobs"] = self._logprobs(event.logprobs) if has_logprobs else None
            body["finish_reason"], body["stop_reason"] = event.finish_reason, event.stop_reason
            out.append(self._chunk(body))
        return out

    def _chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "finish_reason": None, **body}
        chunk = self._envelope(self._object, [choice])
        if self.api_request.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage | None) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage: empty choices, the request's usage."""
        return {**self._envelope(self._object, []), "usage": usage_dict(usage)}
