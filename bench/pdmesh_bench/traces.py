"""Request traces for `pdmesh bench serve` (pure: no network, no torch).

Formats (see the README beside the traces):
- Mooncake JSONL: `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}` a
  line; each hash id names one 512-token block, equal ids = the same prefix content.
- Azure CSV: `TIMESTAMP,ContextTokens,GeneratedTokens` (no prefix hashes).
- Agentic JSON: `{"id", "block_size": 64, "requests": [{"t": s, "in", "out", "hash_ids"}]}`; a
  directory of such files replays every session from t=0, each session's hash ids in its own
  namespace; subagent entries (nested "requests", timed from the subagent's "t") are flattened into
  the session.

Scaling: production lengths are scaled by one factor s (so that the chosen percentile of
input+output fits the model's context), the block behind each hash id by the same s (at least
MIN_BLOCK_TOKENS), and whatever still does not fit is clamped; `Scaling.to_dict()` says exactly what
was done.

Prompts are token-id lists: every hash id maps to a deterministic pseudo-random block of token ids
(seeded by (seed, hash id)), so blocks are shared exactly where hash ids are equal; the tail that
does not fill a whole block (and any full block beyond the trace's hash ids) is unique to the
request.

Also here (pure, shared with the tests): arrival times, synthetic requests and the percentile
helpers.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
MIN_BLOCK_TOKENS = 4
AGENTIC_NAMESPACE = 1 << 40  # hash id offset per session when a directory of agentic traces is read
_SHARED, _UNIQUE = 0, 1  # RNG stream tags: shared blocks by hash id, unique tails by request
P90_USER_DEFINITION = (
    "the per-request output speed (output_tokens / e2e) that 90% of requests reach or "
    "exceed: the 10th percentile of per-request tokens/s"
)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the trace's first request
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    requests: list[TraceRequest]
    block_tokens: int | None  # tokens behind one hash id (None: the format has no prefix hashes)
    format: str


# ----- loading ---------------------------------------------------------------------------------


def load_trace(path: str | Path) -> Trace:
    """Read a trace; the format follows from the suffix (.csv, .jsonl) or the JSON's shape."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise ValueError(f"{path}: no *.json agentic traces in this directory")
        return _merge_sessions([_agentic(json.loads(f.read_text())) for f in files])
    if path.suffix == ".csv":
        return load_azure(path)
    text = path.read_text()
    if path.suffix != ".jsonl" and text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None
        if isinstance(doc, dict) and "requests" in doc:
            return _agentic(doc)
    return parse_mooncake(text.splitlines())


def parse_mooncake(lines: Sequence[str]) -> Trace:
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            requests.append(
                (
                    float(row["timestamp"]) / 1e3,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row.get("hash_ids", ())),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Mooncake trace line {number}: {e!r}") from None
    return Trace(_relative(requests), MOONCAKE_BLOCK_TOKENS, "mooncake")


def load_azure(path: str | Path) -> Trace:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    requests = [
        (_azure_time(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]), ())
        for r in rows
    ]
    return Trace(_relative(requests), None, "azure")


def _azure_time(stamp: str) -> float:
    whole, _, fraction = stamp.strip().partition(".")
    seconds = datetime.fromisoformat(whole).timestamp()
    return seconds + (float("0." + fraction) if fraction else 0.0)


def _agentic(doc: dict[str, Any]) -> Trace:
    return Trace(
        _relative(_agentic_rows(doc["requests"], 0.0)), int(doc.get("block_size", 64)), "agentic"
    )


def _agentic_rows(
    entries: list[dict[str, Any]], offset: float
) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """Requests of a session; a subagent entry nests its own requests, timed from its start."""
    rows = []
    for r in entries:
        if "requests" in r:
            rows += _agentic_rows(r["requests"], offset + float(r.get("t", 0.0)))
        elif "in" in r:
            rows.append(
                (
                    offset + float(r["t"]),
                    int(r["in"]),
                    int(r["out"]),
                    tuple(int(h) for h in r.get("hash_ids", ())),
                )
            )
    return rows


def session_of(request: TraceRequest) -> int:
    """The session a request belongs to: the namespace of its hash ids (`AGENTIC_NAMESPACE`, one
    per file of a directory of agentic traces); 0 without hash ids or namespaces."""
    return request.hash_ids[0] // AGENTIC_NAMESPACE if request.hash_ids else 0


def session_turns(
    requests: Sequence[TraceRequest], max_turns: int | None = None
) -> list[list[int]]:
    """Indexes of `requests` per session, each session's turns in their order, sessions in the
    order of their first turn; at most `max_turns` turns per session."""
    sessions: dict[int, list[int]] = {}
    for index, request in enumerate(requests):
        turns = sessions.setdefault(session_of(request), [])
        if max_turns is None or len(turns) < max_turns:
            turns.append(index)
    return list(sessions.values())


def _merge_sessions(sessions: list[Trace]) -> Trace:
    merged = [
        replace(r, hash_ids=tuple(h + i * AGENTIC_NAMESPACE for h in r.hash_ids))
        for i, s in enumerate(sessions)
        for r in s.requests
    ]
    merged.sort(key=lambda r: r.arrival_s)
    return Trace(merged, sessions[0].block_tokens, "agentic")


def _relative(rows: list[tuple[float, int, int, tuple[int, ...]]]) -> list[TraceRequest]:
    """Sorted by time, times relative to the first request."""
    rows = sorted(rows, key=lambda r: r[0])
    start = rows[0][0] if rows else 0.0
    return [TraceRequest(t - start, i, o, h) for t, i, o, h in rows]


# ----- scaling to the model's context ----------------------------------------------------------


@dataclass
class Scaling:
    enabled: bool  # False: lengths kept, only clamped to the context
    factor: float  # every input/output length and the block size multiplied by this
    percentile: float  # the percentile of input+output that the factor makes fit
    reference_tokens: int  # that percentile of input+output, before scaling
    max_model_len: int
    original_block_tokens: int | None
    block_tokens: int  # round(original * factor * hash_ids_per_block); unscaled: original
    hash_ids_per_block: int  # > 1 only where original * factor < MIN_BLOCK_TOKENS: ids are grouped
    max_output_tokens: int  # outputs are clamped to this (half the context)
    outputs_clamped: int = 0
    inputs_clamped: int = 0  # inputs cut to max_model_len - output
    scale_output: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["rule"] = (
            "input' = max(1, round(input * factor)), output' likewise (if scale_output), "
            "output' <= max_output_tokens, then input' <= max_model_len - output'; prompt block k "
            "(block_tokens) stands for hash ids [k * g, (k + 1) * g), g = hash_ids_per_block"
        )
        return d


def plan_scaling(
    requests: Sequence[TraceRequest],
    max_model_len: int,
    block_tokens: int | None,
    *,
    enabled: bool = True,
    percentile: float = 99.0,
    factor: float | None = None,
    scale_output: bool = True,
    default_block_tokens: int = 64,
) -> Scaling:
    """The factor that makes the `percentile` of input+output fit `max_model_len` (never above
    1)."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    totals = [r.input_len + (r.output_len if scale_output else 0) for r in requests] or [1]
    reference = int(math.ceil(percentile_of(totals, percentile)))
    if factor is None:
        factor = min(1.0, max_model_len / reference) if enabled and reference > 0 else 1.0
    elif not 0 < factor <= 1:
        raise ValueError(f"scale factor must be in (0, 1], got {factor}")
    original = block_tokens
    scaled_block, group = scaled_block_size(original or default_block_tokens, factor)
    if factor == 1.0 and original:
        # unscaled: the trace's own block (synthetic prefixes may be < 4)
        scaled_block, group = (original, 1)
    return Scaling(
        enabled=enabled or factor != 1.0,
        factor=factor,
        percentile=percentile,
        reference_tokens=reference,
        max_model_len=max_model_len,
        original_block_tokens=original,
        block_tokens=scaled_block,
        hash_ids_per_block=group,
        max_output_tokens=max(1, max_model_len // 2),
        scale_output=scale_output,
    )


def scaled_block_size(block_tokens: int, factor: float) -> tuple[int, int]:
    """(tokens per prompt block, hash ids per prompt block): round(block * factor) tokens for one
    id, or, where that is under MIN_BLOCK_TOKENS, g = ceil(MIN / (block * factor)) ids per block of
    round(g * ...)."""
    exact = block_tokens * factor
    if round(exact) >= MIN_BLOCK_TOKENS:
        return round(exact), 1
    group = math.ceil(MIN_BLOCK_TOKENS / exact)
    return max(MIN_BLOCK_TOKENS, round(group * exact)), group


def scale_requests(requests: Sequence[TraceRequest], scaling: Scaling) -> list[TraceRequest]:
    """Scaled and clamped copies (input + output <= max_model_len); counts the clamps in
    `scaling`."""
    out = []
    s, limit = scaling.factor, scaling.max_model_len
    for r in requests:
        output = max(1, round(r.output_len * s)) if scaling.scale_output else max(1, r.output_len)
        if output > scaling.max_output_tokens:
            output, scaling.outputs_clamped = scaling.max_output_tokens, scaling.outputs_clamped + 1
        inp = max(1, round(r.input_len * s))
        if inp > limit - output:
            inp, scaling.inputs_clamped = limit - output, scaling.inputs_clamped + 1
        out.append(TraceRequest(r.arrival_s, inp, output, r.hash_ids))
    return out


# ----- prompts ---------------------------------------------------------------------------------


@dataclass
class PromptBuilder:
    """Token-id prompts whose blocks are shared exactly where the hash ids are equal."""

    block_tokens: int
    seed: int = 0
    token_low: int = 16  # keep clear of special tokens at the bottom of the vocabulary
    token_high: int = 1024  # exclusive: the vocabulary size
    hash_ids_per_block: int = 1  # one prompt block stands for this many consecutive hash ids
    _blocks: dict[tuple[int, ...], list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if (
            self.block_tokens < 1
            or self.hash_ids_per_block < 1
            or not 0 <= self.token_low < self.token_high
        ):
            raise ValueError(
                f"bad prompt builder: block {self.block_tokens}, "
                f"tokens [{self.token_low}, {self.token_high})"
            )

    def block(self, *hash_ids: int) -> list[int]:
        """The block for these hash ids: a function of (seed, ids) only."""
        if hash_ids not in self._blocks:
            rng = np.random.default_rng([self.seed, _SHARED, *hash_ids])
            self._blocks[hash_ids] = rng.integers(
                self.token_low, self.token_high, self.block_tokens
            ).tolist()
        return self._blocks[hash_ids]

    def unique(self, key: int, length: int) -> list[int]:
        rng = np.random.default_rng([self.seed, _UNIQUE, key])
        return rng.integers(self.token_low, self.token_high, length).tolist()

    def build(self, key: int, input_len: int, hash_ids: Sequence[int]) -> list[int]:
        """`input_len` tokens: one shared block per (group of) hash ids while whole blocks fit, then
        a tail unique to `key` (the request)."""
        g = self.hash_ids_per_block
        shared = min(len(hash_ids) // g, input_len // self.block_tokens)
        tokens = [t for k in range(shared) for t in self.block(*hash_ids[k * g : (k + 1) * g])]
        return tokens + self.unique(key, input_len - len(tokens))


@dataclass(frozen=True)
class Job:
    """One request to send: its prompt, max_tokens and arrival offset (None in closed-loop mode)."""

    index: int
    prompt: list[int]
    max_tokens: int
    arrival_s: float | None


def make_jobs(
    requests: Sequence[TraceRequest],
    scaling: Scaling,
    arrivals: Sequence[float] | None,
    seed: int = 0,
    vocab_size: int = 1024,
) -> list[Job]:
    """Prompts for (already scaled) requests; token ids in [min(16, vocab - 1), vocab)."""
    builder = PromptBuilder(
        scaling.block_tokens, seed, min(16, vocab_size - 1), vocab_size, scaling.hash_ids_per_block
    )
    times: Sequence[float | None] = arrivals if arrivals is not None else [None] * len(requests)
    return [
        Job(i, builder.build(i, r.input_len, r.hash_ids), r.output_len, a)
        for i, (r, a) in enumerate(zip(requests, times, strict=True))
    ]


# ----- arrivals, synthetic requests, statistics ------------------------------------------------


def trace_arrivals(requests: Sequence[TraceRequest], time_scale: float = 1.0) -> list[float]:
    """Arrival offsets from the trace's timestamps, multiplied by `time_scale` (0.5 = twice as
    fast)."""
    if time_scale < 0:
        raise ValueError(f"time scale must be >= 0, got {time_scale}")
    start = requests[0].arrival_s if requests else 0.0
    return [(r.arrival_s - start) * time_scale for r in requests]


def choose_arrivals(
    requests: Sequence[TraceRequest],
    rate: float | None,
    concurrency: int | None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> list[float] | None:
    """None for a closed loop (--concurrency), Poisson for --rate, else the trace's timestamps."""
    if concurrency is not None:
        return None
    if rate is not None:
        return poisson_arrivals(len(requests), rate, seed)
    return trace_arrivals(requests, time_scale)


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n arrival offsets of a Poisson process of `rate` requests/s; the first at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng([seed, 2]).exponential(1.0 / rate, max(0, n - 1))
    return [0.0] + np.cumsum(gaps).tolist() if n > 0 else []


def synthetic_requests(
    n: int, input_len: int, output_len: int, prefix_fraction: float = 0.0
) -> tuple[list[TraceRequest], int]:
    """n equal-length requests sharing a prefix of round(fraction * input) tokens; returns
    (requests, block_tokens): the shared prefix is one block (hash id 0), the rest of every prompt
    is unique."""
    if input_len < 1 or output_len < 1 or not 0 <= prefix_fraction <= 1:
        raise ValueError("--input-len and --output-len must be >= 1, the prefix fraction in [0, 1]")
    prefix = round(prefix_fraction * input_len)
    hash_ids = (0,) if prefix > 0 else ()
    return [TraceRequest(0.0, input_len, output_len, hash_ids) for _ in range(n)], max(1, prefix)


def distribution(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (and mean) of a list; None for an empty list."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "p50": percentile_of(values, 50),
        "p90": percentile_of(values, 90),
        "p99": percentile_of(values, 99),
        "mean": sum(values) / len(values),
    }


def p90_user_tokens_per_s(speeds: list[float]) -> float | None:
    """The speed that 90% of users get at least: the 10th percentile of per-request tokens/s."""
    return percentile_of(speeds, 10) if speeds else None


def percentile_of(values: Sequence[float], q: float) -> float:
    """Linearly interpolated percentile (q in [0, 100], numpy's default); NaN for no values."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=float), q))


# ----- length mixes and reusable prefixes ------------------------------------------------------


def mix_long_prompts(
    requests: Sequence[TraceRequest], long_input_len: int, fraction: float, seed: int = 0
) -> list[TraceRequest]:
    """Copies in which each request, with probability `fraction` (seeded), has `long_input_len`
    input tokens instead of its own: a mix of short and long prompts (the rest unchanged)."""
    if long_input_len < 1 or not 0 <= fraction <= 1:
        raise ValueError("--long-input-len must be >= 1 and --long-fraction in [0, 1]")
    draws = np.random.default_rng([seed, 3]).random(len(requests))
    return [
        replace(r, input_len=long_input_len) if draw < fraction else r
        for r, draw in zip(requests, draws, strict=True)
    ]


def reusable_prefix_tokens(requests: Sequence[TraceRequest], scaling: Scaling) -> list[int]:
    """Per (already scaled) request, in order: how many of its prompt tokens are a reusable
    prefix, i.e. its leading prompt blocks (as `PromptBuilder.build` lays them out: groups of
    `hash_ids_per_block` ids, `block_tokens` each) whose chain of ids from the start appeared in an
    earlier request; capped at the input length. An ideal cache would serve exactly these."""
    g, block = scaling.hash_ids_per_block, scaling.block_tokens
    seen: dict[tuple[int, ...], dict[Any, Any]] = {}  # a trie of block chains: ids -> children
    reusable = []
    for r in requests:
        node, matched = seen, 0
        for k in range(min(len(r.hash_ids) // g, r.input_len // block)):
            ids = r.hash_ids[k * g : (k + 1) * g]
            if ids in node:
                matched += 1  # a fresh node has no children, so matches are always leading
            else:
                node[ids] = {}
            node = node[ids]
        reusable.append(min(matched * block, r.input_len))
    return reusable
