"""Per-request sampling parameters, the prompt admission checks and the stop-string search.

`SamplingParams` is validated once, at construction (from Python or from a JSON/API dict via
`from_dict`); the sampler and the engine trust it afterwards. Every rejection is a `ValueError`
whose message names the field and the allowed range, so an API layer can return it as a 400.

`check_prompt` is THE prompt admission rule (non-empty, ids in the vocabulary, room for one output
token); the engine, the scheduler and every service that checks a prompt before a side effect call
it, and convert its `PromptError` to their own error type.

`find_stop_string` is the pure helper the detokenizer calls after each chunk of new text.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

MAX_LOGPROBS = 20  # most top alternatives a request may ask for (OpenAI's limit)
MAX_TEMPERATURE = 100.0
# Temperatures below this are treated as greedy (as vLLM does): dividing logits by them is
# numerically meaningless and the result equals argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1  # the wire types of top_k / stop ids and max_tokens
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# structured outputs (`pdmesh_engine.grammar`): a JSON schema, any JSON object, a regular
# expression, a Lark grammar (llguidance's dialect), an EBNF grammar (GBNF, as llama.cpp and
# vLLM's guided_grammar take it, or Lark), a JSON list of strings to choose from
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark", "ebnf", "choice")


def _is_int(value: Any) -> bool:
    """True for ints (and numpy ints), False for bools, floats and strings."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: Any, lo: int | None, hi: int | None, allowed: str) -> int:
    """Return `value` as an int if it is an integer in [lo, hi]; else raise naming the field."""
    if not _is_int(value):
        raise ValueError(
            f"{name} must be an integer {allowed}, got {value!r} ({type(value).__name__})"
        )
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    """Return `value` as a finite float; ints are accepted, bools and strings are not."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:  # an int past the float range
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def _as_tuple(name: str, value: Any, *, allow_str: bool) -> tuple[Any, ...]:
    """Normalise a list/tuple (or, for `stop`, a single string) to a tuple."""
    if allow_str and isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    kind = "a string or a list of strings" if allow_str else "a list of integers"
    raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick one request's tokens, and when to stop.

    `stop` and `stop_token_ids` accept a list (and `stop` a single string) and are stored as
    tuples. `top_k == -1` is accepted as "disabled" and stored as 0. `logprobs=None` returns no
    logprobs; `logprobs=n` returns the chosen token's logprob plus the n most likely alternatives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # tokens of this request generated elsewhere before (a migrated request's prompt ends with
    # them): a seeded generator starts past their draws, so the continuation is the same
    prior_output_tokens: int = 0
    # structured outputs: the output follows this grammar (`pdmesh_engine.grammar`); None: free
    grammar_kind: str | None = None
    grammar: str | None = None
    # not sampling, but what travels with the request to every engine: the prefix-cache salt
    # (requests share cached blocks only with the same salt) and the scheduling priority (vLLM's
    # meaning: lower runs first)
    cache_salt: str | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        self._validate_numbers()
        self._validate_stops()
        self._validate_grammar()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalise in place during __post_init__

    def _validate_numbers(self) -> None:
        self._set(
            "max_tokens",
            _check_int("max_tokens", self.max_tokens, 1, UINT32_MAX, "in [1, 2**32 - 1]"),
        )
        temperature = _check_float("temperature", self.temperature)
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature!r}"
            )
        self._set("temperature", temperature)
        top_k = _check_int(
            "top_k", self.top_k, -1, INT32_MAX, "in [1, 2**31 - 1], or 0 / -1 to disable"
        )
        self._set("top_k", max(top_k, 0))
        top_p = _check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        self._set("top_p", top_p)
        min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
        self._set("min_p", min_p)
        if self.seed is not None:
            self._set(
                "seed",
                _check_int("seed", self.seed, _SEED_MIN, _SEED_MAX, "in [-2**63, 2**64 - 1]"),
            )
        self._set(
            "min_tokens",
            _check_int(
                "min_tokens",
                self.min_tokens,
                0,
                self.max_tokens,
                f"in [0, max_tokens={self.max_tokens}]",
            ),
        )
        self._set(
            "prior_output_tokens",
            _check_int(
                "prior_output_tokens", self.prior_output_tokens, 0, UINT32_MAX, "in [0, 2**32 - 1]"
            ),
        )
        self._set(
            "priority",
            _check_int("priority", self.priority, -INT32_MAX - 1, INT32_MAX, "in int32's range"),
        )
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")
        if self.logprobs is not None:
            self._set(
                "logprobs",
                _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
            )

    def _validate_stops(self) -> None:
        stop = _as_tuple("stop", self.stop, allow_str=True)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        self._set("stop", stop)
        ids = _as_tuple("stop_token_ids", self.stop_token_ids, allow_str=False)
        self._set(
            "stop_token_ids",
            tuple(
                _check_int("stop_token_ids", t, 0, INT32_MAX, "list with entries in [0, 2**31 - 1]")
                for t in ids
            ),
        )

    def _validate_grammar(self) -> None:
        """The kind is known and the text present where the kind needs one; whether the text
        compiles is `pdmesh_engine.grammar.check_grammar`'s question (it needs the grammar
        library)."""
        kind, text = self.grammar_kind, self.grammar
        if kind is None:
            if text:
                raise ValueError("grammar needs a grammar_kind")
            return
        if kind not in GRAMMAR_KINDS:
            raise ValueError(
                f"grammar_kind must be one of {', '.join(GRAMMAR_KINDS)}, got {kind!r}"
            )
        if text is not None and not isinstance(text, str):
            raise ValueError(f"grammar must be a string, got {type(text).__name__}")
        if kind != "json_object" and not text:
            raise ValueError(f"grammar_kind {kind!r} needs the grammar's text in grammar")
        # the grammar decides where the output ends: EOS is its last token
        if self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a grammar (structured outputs)")
        if self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a grammar (structured outputs)")

    @property
    def is_greedy(self) -> bool:
        """Whether the sampler takes the argmax (temperature 0, or below GREEDY_TEMPERATURE_EPS)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON object / API request body; unknown keys are rejected.

        A JSON `null` for a field means "use the default" (as the OpenAI API reads it).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling parameters must be a JSON object, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"allowed: {', '.join(known)}"
            )
        return cls(**{k: v for k, v in d.items() if v is not None})

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise if a stop token id is outside the model's vocabulary [0, vocab_size)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids must be in [0, {vocab_size}) for this model, got {bad}"
            )


class PromptError(ValueError):
    """A prompt (or a token id) this engine cannot take; the message says why."""


def check_token_ids(
    token_ids: Sequence[Any], vocab_size: int, what: str = "prompt token ids"
) -> None:
    """Raise PromptError unless every entry is an int (not a bool) in [0, vocab_size); `what` names
    them."""
    not_ints = [t for t in token_ids if not _is_int(t)]
    if not_ints:
        raise PromptError(f"{what} must be integers, got {not_ints[:5]!r}")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_prompt(
    prompt_ids: Sequence[Any], *, vocab_size: int | None = None, max_model_len: int | None = None
) -> None:
    """The prompt admission checks, in this order: non-empty; with `vocab_size`, every id an int in
    [0, vocab_size); with `max_model_len`, fewer tokens than the context (one output token must
    fit). Raises PromptError (a ValueError)."""
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    if vocab_size is not None:
        check_token_ids(prompt_ids, vocab_size)
    if max_model_len is not None and len(prompt_ids) >= max_model_len:
        raise PromptError(
            f"the prompt has {len(prompt_ids)} tokens; this engine's context is {max_model_len} "
            "tokens (prompt plus at least one output token)"
        )


def find_stop_string(
    text: str, stops: tuple[str, ...], new_text_len: int
) -> tuple[int, str] | None:
    """Find a stop string that overlaps the last `new_text_len` characters of `text`.

    Returns (index where it starts in `text`, the stop string) for the earliest-starting match
    (among matches starting at the same index, the shortest, i.e. the one a character-by-character
    stream would have completed first), or None. Only the tail `new_text_len + len(stop) - 1`
    characters are searched for each stop: matches lying wholly in older text were found (or
    ruled out) on earlier calls.
    """
    if new_text_len < 0:
        raise ValueError(f"new_text_len must be >= 0, got {new_text_len}")
    new_start = len(text) - min(new_text_len, len(text))  # first index of the new text
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, max(0, new_start - len(stop) + 1))
        if idx < 0:
            continue
        if best is None or (idx, len(stop)) < (best[0], len(best[1])):
            best = (idx, stop)
    return best
