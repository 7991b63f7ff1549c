"""Tokenizer of a Hugging Face model directory, on the `tokenizers` library (no `transformers`).

`Tokenizer` reads `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json` when
present) and renders chat templates with a sandboxed jinja2 environment like Hugging Face's.
`IncrementalDetokenizer` turns a stream of generated ids into text deltas that never split a
multi-byte character (the prefix/read-offset technique of vLLM).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from pdmesh_engine.config import CheckpointError, read_json

# Used when the tokenizer ships no chat template.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_REPLACEMENT_CHAR = "\ufffd"
# Tokens of the prompt decoded together with the first new tokens (as vLLM does), so that
# decoders that depend on the left context (leading spaces, byte fragments) diff correctly.
_INITIAL_CONTEXT_TOKENS = 5


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} (use "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


class _GenerationTag(jinja2.ext.Extension):
    """Accept Hugging Face's `{% generation %}...{% endgeneration %}` blocks (rendered as-is)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _from_json(text: str) -> Any:
    """JSON text to its value: chat templates that render tool calls (DeepSeek-V4's) read an
    assistant's `arguments` text with it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise jinja2.exceptions.TemplateError(f"from_json: not JSON: {e}") from None


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = _from_json
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse: {e}") from e


class Tokenizer:
    """Encode/decode/chat-template for one model; build it with `Tokenizer.from_dir`."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        eos = ([eos_id] if eos_id is not None else []) + [
            i for i in extra_eos_token_ids if i != eos_id
        ]
        self._eos_ids = tuple(dict.fromkeys(eos))
        # Prepend BOS ourselves only if asked to and tokenizer.json's post-processor does not.
        processor_adds_bos = self._bos_id is not None and self._bos_id in tokenizer.encode("").ids
        self._prepend_bos = (
            bool(add_bos_token) and self._bos_id is not None and not processor_adds_bos
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        path = Path(model_dir)
        tok_path = path / "tokenizer.json"
        if not tok_path.is_file():
            raise CheckpointError(
                f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)"
            )
        try:
            tokenizer = _HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise CheckpointError(f"{tok_path}: cannot load ({e})") from e
        cfg = (
            read_json(path / "tokenizer_config.json")
            if (path / "tokenizer_config.json").is_file()
            else {}
        )
        template = _pick_chat_template(cfg.get("chat_template"))
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        gen = (
            read_json(path / "generation_config.json")
            if (path / "generation_config.json").is_file()
            else {}
        )
        gen_eos = gen.get("eos_token_id")
        extra_eos = (
            gen_eos
            if isinstance(gen_eos, list)
            else ([gen_eos] if isinstance(gen_eos, int) else [])
        )
        return cls(
            tokenizer,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            add_bos_token=cfg.get("add_bos_token"),
            chat_template=template,
            extra_eos_token_ids=extra_eos,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self._bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to the prompt text (special tokens included, BOS too if the
        template adds it). Messages may carry more than role and content (an assistant's
        `tool_calls`, a tool result's `tool_call_id`), and `kwargs` reach the template (`tools`:
        OpenAI tool objects).

        Encode the result with `add_special_tokens=False` (or use `encode_chat`) to avoid a second
        BOS.
        """
        template = _compile_template(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from e

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered conversation (the template's own special tokens only)."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Text deltas of a generated id stream; the deltas concatenate to `decode(output_ids)`.

    Keeps two offsets into the ids: text up to `read_offset` has been emitted; the tokens from
    `prefix_offset` to `read_offset` are decoded again as left context. A delta is emitted only
    when the decoded window grows and does not end in U+FFFD (an incomplete UTF-8 character).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._num_prompt = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _INITIAL_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        context = tokenizer.decode(
            self._ids[self._prefix_offset :], skip_special_tokens=skip_special_tokens
        )
        if context.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: that fragment is not part of the output's text.
            self._prefix_offset = self._read_offset
        self._text: list[str] = []

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_prompt :]

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._text)

    def _window_delta(self, allow_incomplete: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip
        )
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(_REPLACEMENT_CHAR) and not allow_incomplete
        ):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        delta = new_text[len(prefix_text) :]
        self._text.append(delta)
        return delta

    def push(self, new_ids: Sequence[int] | int) -> str:
        """Add generated ids; return the newly completed text (possibly empty)."""
        self._ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        return self._window_delta(allow_incomplete=False)

    def flush(self) -> str:
        """At the end of the stream: emit what is held back, even an incomplete character (as
        U+FFFD)."""
        return self._window_delta(allow_incomplete=True)
