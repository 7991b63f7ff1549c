"""Schema-constrained requests for the benchmarks: `pdmesh bench engine --constrained-share` (the
step cost of the grammar masks) and `pdmesh bench serve --constrained-share` (TTFT/ITL of
constrained beside unconstrained requests).

A few JSON schemas, each an object holding one array of small objects (bounded integers, enums,
short strings, booleans; closed objects, every property required), sized by the number of items:
`ListSchema.schema(min_items, max_items)`. `minItems` forces an output long enough to keep a
request decoding for the measured steps; `maxItems` and the bounded fields bound it, so a request
always ends (the grammar closes the JSON and the engine stops at EOS). A greedy small model closes
the array as soon as `minItems` allows.

- `items_for(min_tokens, tokens_per_item)`: how many items make an output of at least `min_tokens`
  tokens (the engine benchmark: longer than its measured steps);
- `ListSchema.item_tokens(encode)`: the tokens of its smallest item (and the comma) on a tokenizer;
- `serve_schema(spec, max_tokens)`: a schema whose output fits in `max_tokens` without a tokenizer
  (`ITEM_TOKENS_BUDGET` tokens per item);
- `constrained_params(schema, max_tokens, temperature, seed)`: the engine's `SamplingParams`;
- `response_format(schema, name)`: the OpenAI `response_format` of a request body;
- `choose_constrained(count, share, seed)`: which requests of a run carry a schema, and which;
- `validation_error(text, schema)` / `is_valid`: parse + `jsonschema` (None: valid).

No torch here.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdmesh_engine.sampling import SamplingParams

# a generous bound on one item's tokens, for sizing a schema without the server's tokenizer (the
# embedded coder-v4 writes 21-30 tokens per item of any of SCHEMAS)
ITEM_TOKENS_BUDGET = 40
ENVELOPE_TOKENS = 8  # `{"key":[` and `]}`


def _closed(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class ListSchema:
    """An object with one array (`key`) of `item`s; `smallest` is a shortest instance of `item`."""

    name: str
    key: str
    item: dict[str, Any]
    smallest: dict[str, Any]

    def schema(self, min_items: int, max_items: int) -> dict[str, Any]:
        if not 1 <= min_items <= max_items:
            raise ValueError(f"need 1 <= min_items <= max_items, got {min_items}, {max_items}")
        array = {"type": "array", "items": self.item, "minItems": min_items, "maxItems": max_items}
        return _closed({self.key: array})

    def item_tokens(self, encode: Callable[[str], Sequence[int]]) -> int:
        """Tokens of the smallest item and its comma, as `encode` (the model's tokenizer) splits
        compact JSON (the grammar allows no whitespace)."""
        return len(encode("," + compact(self.smallest)))


SCHEMAS: tuple[ListSchema, ...] = (
    ListSchema(
        "inventory",
        "items",
        _closed(
            {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "kind": {"enum": ["add", "remove", "update"]},
                "name": {"type": "string", "minLength": 1, "maxLength": 8},
                "ok": {"type": "boolean"},
            }
        ),
        {"id": 0, "kind": "add", "name": "a", "ok": True},
    ),
    ListSchema(
        "events",
        "events",
        _closed(
            {
                "t": {"type": "integer", "minimum": 0, "maximum": 9999},
                "level": {"enum": ["debug", "info", "warn", "error"]},
                "tags": {
                    "type": "array",
                    "items": {"enum": ["io", "net", "db", "ui"]},
                    "maxItems": 2,
                },
                "code": {"type": "string", "minLength": 1, "maxLength": 6},
            }
        ),
        {"t": 0, "level": "info", "tags": [], "code": "a"},
    ),
    ListSchema(
        "points",
        "points",
        _closed(
            {
                "x": {"type": "integer", "minimum": -99, "maximum": 99},
                "y": {"type": "integer", "minimum": -99, "maximum": 99},
                "label": {"enum": ["a", "b", "c"]},
                "seen": {"type": "boolean"},
            }
        ),
        {"x": 0, "y": 0, "label": "a", "seen": True},
    ),
)
BY_NAME = {s.name: s for s in SCHEMAS}


def compact(value: Any) -> str:
    """JSON as the grammar generates it: no whitespace."""
    return json.dumps(value, separators=(",", ":"))


def items_for(min_tokens: int, tokens_per_item: int) -> int:
    """Items whose output is at least `min_tokens` tokens long (tokens_per_item: a lower bound of
    one item's tokens)."""
    return max(1, math.ceil(min_tokens / max(1, tokens_per_item)))


def serve_schema(spec: ListSchema, max_tokens: int) -> dict[str, Any]:
    """`spec` with exactly as many items as fit in `max_tokens` at `ITEM_TOKENS_BUDGET` tokens per
    item (at least one: a request of fewer tokens may end cut off, and then does not validate)."""
    n = max(1, (max_tokens - ENVELOPE_TOKENS) // ITEM_TOKENS_BUDGET)
    return spec.schema(n, n)


def constrained_params(
    schema: dict[str, Any], max_tokens: int, temperature: float = 0.0, seed: int | None = None
) -> SamplingParams:
    """A json_schema request (no ignore_eos: the grammar ends the output with EOS)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        grammar_kind="json_schema",
        grammar=json.dumps(schema),
    )


def response_format(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """The OpenAI `response_format` of a request constrained to `schema`."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def choose_constrained(count: int, share: float, seed: int) -> dict[int, str]:
    """Of requests 0..count-1: round(share * count) of them (drawn with a `seed`ed RNG) -> the name
    of the schema each carries (drawn too)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the constrained share must be in [0, 1], got {share}")
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(count), math.floor(share * count + 0.5)))
    return {i: rng.choice(SCHEMAS).name for i in chosen}


def validation_error(text: str, schema: dict[str, Any]) -> str | None:
    """None if `text` is JSON that validates against `schema`, else why not."""
    import jsonschema  # only where outputs are checked

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"does not match the schema: {e.message}"
    return None


def is_valid(text: str, schema: dict[str, Any]) -> bool:
    return validation_error(text, schema) is None
