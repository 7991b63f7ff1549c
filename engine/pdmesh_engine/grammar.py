"""Structured outputs: a request's grammar, the tokens it allows next, and its state along the
output.

The grammar engine is llguidance (PyPI; no grammar engine of our own), measured beside xgrammar on
this project's CPUs (`pdmesh bench grammar`, coder-v4's 4K vocabulary): llguidance imports in 34 ms
against 1.4 s and without `transformers` (xgrammar imports it, which the engine never does), and
compiles a schema 3-6x faster; xgrammar's masks are about 3x cheaper (32 rows: 0.14 against
0.50 ms a step), but the mask is computed beside the forward, whose step costs tens of
milliseconds, and xgrammar 0.2.9 lets raw control characters into `maxLength` strings (invalid
JSON).

- `grammar_source(kind, text)`: a request's grammar (`SamplingParams.grammar_kind`/`grammar`) in
  llguidance's form; `check_grammar` says, without a tokenizer, whether it compiles (a front end
  answers 400 with the message).
- `GrammarCompiler`: one per engine, on the model's own tokenizer (`tokenizer.json`): compiles each
  grammar once (an LRU keyed by kind and text) and starts a `GrammarState` per request from a copy.
- `GrammarState`: where one request stands in its grammar; it consumes every output token (the
  request's `append_output`), so the state follows the tokens wherever they were sampled: the
  prefill rank's first token arrives with the KV, a migrated request replays its earlier tokens.
- `fill_masks`: the [R, V] allowed-token masks of a batch's rows, for several requests at once on
  llguidance's threads (the GIL is released, so it runs beside the forward), with draft tokens for
  speculative decoding (row i + 1 of a request: after its first i + 1 drafts).

No torch here: the gateway checks grammars with this module.

JSON grammars are compact (no whitespace between tokens is allowed): a small model can't wander into
endless whitespace, and the output is what `json.dumps(..., separators=(",", ":"))` writes.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from pdmesh_engine.sampling import GRAMMAR_KINDS

# JSON is generated without optional whitespace (see the module docstring)
_JSON_OPTIONS: Any = {"whitespace_flexible": False}
_CACHE_SIZE = 256  # compiled grammars kept per engine


def grammar_source(kind: str, text: str | None) -> str:
    """The llguidance grammar of `text` in `kind` (`GRAMMAR_KINDS`); ValueError for a text that is
    not of its kind (a JSON schema that is not JSON, ...). Whether it compiles: `check_grammar`."""
    if kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS))
    if text is None:
        raise ValueError(f"grammar_kind {kind!r} needs the grammar's text")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                f"a JSON schema is an object or a boolean, got {type(schema).__name__}"
            )
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, _JSON_OPTIONS))
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(text))
    if kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(text))
    if kind == "ebnf":
        try:
            return str(llguidance.LLMatcher.grammar_from_lark(any_to_lark(text)))
        except GbnfToLarkError as e:
            raise ValueError(f"the grammar is neither GBNF nor Lark: {e}") from None
    if kind == "choice":
        try:
            choices = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"choice must be a JSON list of strings: {e}") from None
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) for c in choices)
        ):
            raise ValueError("choice must be a non-empty JSON list of strings")
        return str(
            llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        )
    raise ValueError(f"grammar_kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}")


def check_grammar(kind: str, text: str | None) -> None:
    """Raise ValueError (the compiler's message) unless the grammar compiles."""
    error = llguidance.LLMatcher.validate_grammar(grammar_source(kind, text))
    if error:
        raise ValueError(f"the {kind} grammar does not compile: {error}")


class GrammarState:
    """One request's position in its grammar (an llguidance matcher)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance over a token of the output; False (and `failed` from then on) if the grammar
        forbids it."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def failed(self) -> bool:
        return bool(self.matcher.is_error())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error()) if self.failed else ""

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and only an end-of-sequence token may follow."""
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Compiles grammars on one tokenizer and starts requests' states (module docstring)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._compiled: OrderedDict[tuple[str, str | None], llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarCompiler:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"structured outputs need the model's tokenizer, and {path} does not exist"
            )
        return cls(path.read_text(), vocab_size, eos_token_ids)

    def _compile(self, kind: str, text: str | None) -> llguidance.LLMatcher:
        key = (kind, text)
        matcher = self._compiled.get(key)
        if matcher is not None:
            self._compiled.move_to_end(key)
            return matcher
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_source(kind, text), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {kind} grammar does not compile: {matcher.get_error()}")
        self._compiled[key] = matcher
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return matcher

    def start(self, kind: str, text: str | None, replay: Sequence[int] = ()) -> GrammarState:
        """A new request's state, advanced over `replay` (tokens of its output generated
        elsewhere: a migrated request's); ValueError if they break the grammar."""
        state = GrammarState(self._compile(kind, text).deep_copy())
        for i, token in enumerate(replay):
            if not state.accept(int(token)):
                raise ValueError(
                    f"output token {i} ({token}) generated before does not fit the {kind} grammar: "
                    f"{state.error}"
                )
        return state


@lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for batch masks: a quarter of the CPUs (the forward runs beside
    it)."""
    return llguidance.LLExecutor(num_threads=max(1, (os.cpu_count() or 1) // 4))


def fill_masks(
    rows: Sequence[tuple[GrammarState, int, Sequence[int]]], num_rows: int, vocab_size: int
) -> np.ndarray:
    """[num_rows, vocab_size] bool, True where a token is allowed: for each (state, row, drafts),
    row `row` is what the state allows next and row `row + i + 1` what it allows after the first
    i + 1 drafts (up to the first draft it forbids: rows past it stay all True, as do rows no state
    names). The states are left where they were."""
    words = (vocab_size + 31) // 32
    bitmask = np.full((num_rows, words), -1, dtype=np.int32)
    plain = [(s.matcher, row) for s, row, drafts in rows if not drafts]
    drafted = [(s.matcher, row, list(drafts)) for s, row, drafts in rows if drafts]
    if plain:
        _executor().unsafe_compute_mask_ptr(plain, bitmask.ctypes.data, words * 4, num_rows)
    if drafted:
        _executor().unsafe_compute_mask_ptr_with_draft_token(
            drafted, bitmask.ctypes.data, words * 4, num_rows
        )
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return bits.astype(bool)


_BESIDE = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")


def masks_beside(
    rows: Sequence[tuple[GrammarState | None, int, Sequence[int]]], num_rows: int, vocab_size: int
) -> Future[np.ndarray] | None:
    """`fill_masks` of the rows whose state is not None, started on a background thread so that
    it runs while the caller computes the step's forward; None when no row has a grammar (a batch
    without structured outputs pays nothing)."""
    constrained = [(state, row, drafts) for state, row, drafts in rows if state is not None]
    if not constrained:
        return None
    return _BESIDE.submit(fill_masks, constrained, num_rows, vocab_size)
