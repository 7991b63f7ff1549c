"""`pdmesh bench grammar`: the two grammar libraries for structured outputs side by side, llguidance
(what `pdmesh_engine.grammar` uses) and xgrammar, on one tokenizer and a set of JSON schemas.

Measured in one run, per library:

- import: `import <library>` in a fresh interpreter (median of `--import-repeats`), and which heavy
  modules it pulls in (xgrammar imports transformers and torch);
- compile, cold: each schema compiled from scratch (`--compile-repeats`, no cache: llguidance a new
  `LLMatcher` on the engine's tokenizer, xgrammar a `GrammarCompiler` with its cache off), and the
  first mask of a fresh matcher (llguidance builds its lexer lazily, so part of its compile work
  lands there);
- mask per decode step at each `--batch-sizes` B: B requests walk random paths through their
  grammars (seeded; each step one token drawn uniformly from the tokens every library allows), and
  only the batch's mask computation is timed: llguidance `pdmesh_engine.grammar.fill_masks` over
  the batch (its thread pool; unpacked to a bool [B, V] array), xgrammar
  `GrammarMatcher.fill_next_token_bitmask` per matcher into one bitmask plus the same unpack
  ("xgrammar"), and xgrammar's `BatchGrammarMatcher` with as many threads as llguidance's pool
  ("xgrammar-batch", the same matchers; an extra row). Token acceptance (advancing every matcher of
  the batch over its token) is timed per step on its own.

The libraries walk in lockstep on the same paths, so every step costs each the same grammar states;
where their masks differ, the walk keeps to the tokens all allow, and "agreement" counts the rows
whose masks were identical and lists the tokens only one library allowed. Seen with xgrammar 0.2.9
and llguidance 1.9.1: in a string with maxLength xgrammar allows raw control characters (invalid
JSON) and no escapes (`\\`), and it allows special tokens as text; llguidance forbids some
non-canonical splits of a forced key (a lone `"` where `":` is a token).

A request that ends (EOS drawn) is replaced by a fresh one on the same schema; after the timed steps
each open request is finished, untimed, by preferring closing tokens (EOS, then `"`/`]`/`}`, then
`,`), and every walked path's text is kept (its JSON validity is counted; the tests validate it
against its schema).

Rows take the schemas in turn; with B below the number of schemas the walk repeats in rounds until
every schema has had its rows (batch 1: one round per schema, steps pooled).

Ratios are xgrammar / llguidance: above 1, llguidance is the faster.

JSON: {"config", "imports": [{"library", "import_ms", "heavy_modules"}], "compile": [{"schema",
"library", "compile_ms", "compile_ms_all", "first_mask_ms"}], "steps": [{"library", "batch",
"steps", "mask_ms": {"p50", "p90", "mean"}, "accept_ms": {...} or null}], "ratios": {...},
"agreement": [{"batch", "rows", "identical", "mean_differing_tokens"}], "paths": [{"schema",
"batch", "text", "tokens", "finished", "valid_json"}], "notes": [...]}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

from pdmesh_engine.grammar import GrammarCompiler, GrammarState, fill_masks, grammar_source

DEFAULT_TOKENIZER = (
    Path(__file__).resolve().parents[2] / "engine" / "pdmesh_engine" / "checkpoints" / "coder-v4"
)
LIBRARIES = ("llguidance", "xgrammar")
XGR_BATCH = "xgrammar-batch"  # xgrammar's BatchGrammarMatcher: masks only, the same matchers
HEAVY_MODULES = ("numpy", "torch", "transformers")
TOP_DIFFERING = 8  # tokens listed per library in the agreement report

_STR = {"type": "string"}


def _obj(properties: dict[str, Any], required: Sequence[str]) -> dict[str, Any]:
    """A closed object (no other properties: both libraries then build the same grammar)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


# Realistic structured-output schemas: nested objects, arrays, enums, bounded numbers, strings with
# maxLength (every string is bounded, so a random walk can't stay in one for ever).
SCHEMAS: dict[str, dict[str, Any]] = {
    "tool_call": _obj(
        {
            "name": {"enum": ["search", "read_file", "write_file", "run_tests"]},
            "arguments": _obj(
                {
                    "path": {**_STR, "maxLength": 64},
                    "query": {**_STR, "maxLength": 48},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                    "recursive": {"type": "boolean"},
                },
                ["path"],
            ),
        },
        ["name", "arguments"],
    ),
    "user_profile": _obj(
        {
            "id": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
            "name": {**_STR, "maxLength": 32},
            "email": {**_STR, "maxLength": 48},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": _obj(
                {
                    "street": {**_STR, "maxLength": 40},
                    "city": {**_STR, "maxLength": 24},
                    "country": {"enum": ["US", "DE", "FR", "JP", "BR", "IN"]},
                    "zip": {**_STR, "maxLength": 10},
                },
                ["city", "country"],
            ),
            "tags": {"type": "array", "items": {**_STR, "maxLength": 12}, "maxItems": 4},
        },
        ["id", "name", "address"],
    ),
    "order": _obj(
        {
            "order_id": {**_STR, "maxLength": 16},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "items": _obj(
                    {
                        "sku": {**_STR, "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "unit_price": {"type": "number", "minimum": 0, "maximum": 10_000},
                    },
                    ["sku", "qty", "unit_price"],
                ),
            },
            "currency": {"enum": ["USD", "EUR", "JPY", "GBP"]},
            "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
            "note": {"type": ["string", "null"], "maxLength": 60},
        },
        ["order_id", "items", "currency", "status"],
    ),
    "classification": _obj(
        {
            "label": {"enum": ["positive", "negative", "neutral", "mixed"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "rationale": {**_STR, "maxLength": 80},
            "spans": {
                "type": "array",
                "maxItems": 3,
                "items": _obj(
                    {
                        "start": {"type": "integer", "minimum": 0, "maximum": 4096},
                        "end": {"type": "integer", "minimum": 0, "maximum": 4096},
                        "text": {**_STR, "maxLength": 24},
                    },
                    ["start", "end"],
                ),
            },
        },
        ["label", "confidence"],
    ),
    "log_event": _obj(
        {
            "timestamp": {"type": "integer", "minimum": 0, "maximum": 4_102_444_800},
            "level": {"enum": ["debug", "info", "warning", "error", "critical"]},
            "service": {**_STR, "maxLength": 24},
            "message": {**_STR, "maxLength": 120},
            "attrs": _obj(
                {
                    "latency_ms": {"type": "number", "minimum": 0, "maximum": 60_000},
                    "status_code": {"type": "integer", "minimum": 100, "maximum": 599},
                    "retry": {"type": "boolean"},
                },
                ["status_code"],
            ),
            "trace_id": {"type": ["string", "null"], "maxLength": 32},
        },
        ["timestamp", "level", "service", "message"],
    ),
}


# --- the tokenizer --------------------------------------------------------------------------------


class Vocab:
    """A model directory's tokenizer.json: vocab size, EOS ids, and each token's string."""

    def __init__(self, model_dir: Path, vocab_size: int | None = None) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist (--tokenizer takes a model directory)")
        self.dir = Path(model_dir)
        self.text = path.read_text()
        spec = json.loads(self.text)
        ids = dict(spec["model"]["vocab"])
        ids.update({t["content"]: t["id"] for t in spec.get("added_tokens", [])})
        config = _read_json(self.dir / "config.json")
        self.size = int(
            vocab_size or config.get("vocab_size") or max(max(ids.values()) + 1, len(ids))
        )
        self.tokens = [""] * self.size  # the tokenizer's encoded form ("Ġthe" for " the")
        for token, i in ids.items():
            if i < self.size:
                self.tokens[i] = token
        self.eos = self._eos_ids(config, ids)
        self.spec = spec

    def _eos_ids(self, config: dict[str, Any], ids: dict[str, int]) -> list[int]:
        for source in (config, _read_json(self.dir / "generation_config.json")):
            eos = source.get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        token = _read_json(self.dir / "tokenizer_config.json").get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token in ids:
            return [ids[token]]
        raise ValueError(f"no EOS token id in {self.dir} (config.json eos_token_id)")


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


# --- the libraries --------------------------------------------------------------------------------


class Llguidance:
    """The engine's path: `GrammarCompiler` states, masks from `fill_masks`."""

    name = "llguidance"

    def __init__(self, vocab: Vocab) -> None:
        self.vocab_size = vocab.size
        self.compiler = GrammarCompiler(vocab.text, vocab.size, vocab.eos)

    def compile(self, schema_text: str) -> Any:
        """Cold: what `GrammarCompiler` does on a cache miss."""
        matcher = llguidance.LLMatcher(
            self.compiler.tokenizer, grammar_source("json_schema", schema_text), log_level=0
        )
        if matcher.is_error():
            raise ValueError(f"llguidance: {matcher.get_error()}")
        return matcher

    def start(self, schema_text: str) -> GrammarState:
        return self.compiler.start("json_schema", schema_text)

    def fresh(self, compiled: Any) -> GrammarState:
        return GrammarState(compiled)

    def masks(self, states: Sequence[Any]) -> np.ndarray:
        return fill_masks([(s, i, ()) for i, s in enumerate(states)], len(states), self.vocab_size)

    def accept(self, state: Any, token: int) -> bool:
        return bool(state.accept(token))

    def decode(self, tokens: Sequence[int]) -> bytes:
        return bytes(self.compiler.tokenizer.decode_bytes(list(tokens)))


class Xgrammar:
    """xgrammar on the same vocabulary: compact JSON (no whitespace, `,`/`:` separators, closed
    objects), one matcher per request."""

    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab.size
        self.words = (vocab.size + 31) // 32
        self.info = xgr.TokenizerInfo(
            vocab.tokens,
            vocab_type=_xgr_vocab_type(xgr, vocab),
            vocab_size=vocab.size,
            stop_token_ids=vocab.eos,
            add_prefix_space=_xgr_add_prefix_space(xgr, vocab),
        )
        self.cold = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.cached = xgr.GrammarCompiler(self.info)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=threads)

    def _compile(self, compiler: Any, schema_text: str) -> Any:
        return compiler.compile_json_schema(
            schema_text, any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def compile(self, schema_text: str) -> Any:
        return self._compile(self.cold, schema_text)

    def start(self, schema_text: str) -> Any:
        return self.xgr.GrammarMatcher(self._compile(self.cached, schema_text))

    def fresh(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def _unpack(self, bitmask: np.ndarray) -> np.ndarray:
        """The same unpack to a bool [B, V] array as `fill_masks`."""
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return bits[:, : self.vocab_size].astype(bool)

    def masks(self, states: Sequence[Any]) -> np.ndarray:
        bitmask = np.full((len(states), self.words), -1, dtype=np.int32)
        for i, matcher in enumerate(states):
            matcher.fill_next_token_bitmask(bitmask, i)
        return self._unpack(bitmask)

    def masks_batch(self, states: Sequence[Any]) -> np.ndarray:
        bitmask = np.full((len(states), self.words), -1, dtype=np.int32)
        self.batcher.batch_fill_next_token_bitmask(list(states), bitmask)
        return self._unpack(bitmask)

    def accept(self, state: Any, token: int) -> bool:
        return bool(state.accept_token(token))


def _xgr_vocab_type(xgr: Any, vocab: Vocab) -> Any:
    """What `TokenizerInfo.from_huggingface` detects, from tokenizer.json without transformers."""
    detect = getattr(xgr.TokenizerInfo, "_detect_metadata_from_hf", None)
    if detect is not None:
        try:
            return detect(vocab.text)["vocab_type"]
        except Exception:  # noqa: BLE001 - a private helper: fall back to reading the decoder
            pass
    decoders = [vocab.spec.get("decoder") or {}]
    decoders += decoders[0].get("decoders", [])
    kinds = {d.get("type") for d in decoders}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _xgr_add_prefix_space(xgr: Any, vocab: Vocab) -> bool:
    detect = getattr(xgr.TokenizerInfo, "_detect_metadata_from_hf", None)
    if detect is not None:
        try:
            return bool(detect(vocab.text)["add_prefix_space"])
        except Exception:  # noqa: BLE001 - as in _xgr_vocab_type
            pass
    return "Metaspace" in json.dumps(vocab.spec.get("pre_tokenizer"))


def xgrammar_available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


# --- measurements ---------------------------------------------------------------------------------


def _ms(start_ns: int) -> float:
    return (time.perf_counter_ns() - start_ns) / 1e6


def _summary(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "mean": float(a.mean()),
    }


def measure_imports(libraries: Sequence[str], repeats: int) -> list[dict[str, Any]]:
    """`import <library>` in a fresh interpreter (its startup not counted): median ms."""
    code = (
        "import json, sys, time\n"
        "t = time.perf_counter()\n"
        "import {lib}\n"
        "ms = (time.perf_counter() - t) * 1e3\n"
        f"heavy = [m for m in {list(HEAVY_MODULES)!r} if m in sys.modules]\n"
        "print(json.dumps({{'ms': ms, 'heavy': heavy}}))\n"
    )
    results = []
    for lib in libraries:
        runs = []
        for _ in range(repeats):
            out = subprocess.run(
                [sys.executable, "-c", code.format(lib=lib)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if runs:
            results.append(
                {
                    "library": lib,
                    "import_ms": statistics.median(r["ms"] for r in runs),
                    "import_ms_all": [r["ms"] for r in runs],
                    "heavy_modules": runs[-1]["heavy"],
                }
            )
    return results


def measure_compile(
    libs: Sequence[Any], schemas: dict[str, dict[str, Any]], repeats: int
) -> list[dict[str, Any]]:
    """Per schema and library: cold compile ms (median of `repeats`), and the first mask of a fresh
    matcher on each compiled grammar (median)."""
    rows = []
    for name, schema in schemas.items():
        text = json.dumps(schema)
        for lib in libs:
            compile_ms, first_ms = [], []
            for _ in range(repeats):
                t = time.perf_counter_ns()
                compiled = lib.compile(text)
                compile_ms.append(_ms(t))
                state = lib.fresh(compiled)
                t = time.perf_counter_ns()
                lib.masks([state])
                first_ms.append(_ms(t))
            rows.append(
                {
                    "schema": name,
                    "library": lib.name,
                    "compile_ms": statistics.median(compile_ms),
                    "compile_ms_all": compile_ms,
                    "first_mask_ms": statistics.median(first_ms),
                }
            )
    return rows


class _Request:
    __slots__ = ("schema", "states", "tokens")

    def __init__(self, schema: str, states: dict[str, Any]) -> None:
        self.schema = schema
        self.states = states
        self.tokens: list[int] = []


def _closing_ranks(llg: Llguidance, eos: Sequence[int], vocab_size: int) -> np.ndarray:
    """Per token, how it finishes a path (lower first): EOS 0, only `"`/`]`/`}` 1, only `,` 2, any
    other 3."""
    ranks = np.full(vocab_size, 3, dtype=np.int8)
    for i in range(vocab_size):
        text = llg.decode([i])
        if text and not text.strip(b'"]}'):
            ranks[i] = 1
        elif text and not text.strip(b","):
            ranks[i] = 2
    ranks[list(eos)] = 0
    return ranks


def walk(
    libs: Sequence[Any],
    schemas: dict[str, dict[str, Any]],
    batch: int,
    steps: int,
    rng: np.random.Generator,
    eos: Sequence[int],
    ranks: np.ndarray,
    finish_limit: int,
) -> dict[str, Any]:
    """B requests walk `steps` timed steps in lockstep in every library (module docstring), then
    are finished untimed. Returns per library the mask and accept ms of each step, the agreement
    counts, and the walked paths."""
    names = list(schemas)
    texts = {n: json.dumps(s) for n, s in schemas.items()}
    eos_set = set(eos)
    variants: list[tuple[str, Any, Callable[[Sequence[Any]], np.ndarray]]] = [
        (lib.name, lib, lib.masks) for lib in libs
    ]
    variants += [(XGR_BATCH, lib, lib.masks_batch) for lib in libs if isinstance(lib, Xgrammar)]
    mask_ms: dict[str, list[float]] = {v[0]: [] for v in variants}
    accept_ms: dict[str, list[float]] = {lib.name: [] for lib in libs}
    agreement: dict[str, Any] = {"rows": 0, "identical": 0, "differing_tokens": 0}
    only: dict[str, Counter[int]] = {lib.name: Counter() for lib in libs}
    paths: list[dict[str, Any]] = []

    def new(schema: str) -> _Request:
        return _Request(schema, {lib.name: lib.start(texts[schema]) for lib in libs})

    def done(request: _Request, finished: bool) -> None:
        body = [t for t in request.tokens if t not in eos_set]
        text = libs[0].decode(body).decode("utf-8", errors="replace")
        try:
            json.loads(text)
            valid = True
        except ValueError:
            valid = False
        paths.append(
            {
                "schema": request.schema,
                "batch": batch,
                "text": text,
                "tokens": len(request.tokens),
                "finished": finished,
                "valid_json": valid,
            }
        )

    def advance(request: _Request, token: int) -> None:
        for lib in libs:
            if not lib.accept(request.states[lib.name], token):
                raise RuntimeError(
                    f"{lib.name} refused token {token} that its mask allowed "
                    f"({request.schema}, after {len(request.tokens)} tokens)"
                )
        request.tokens.append(token)

    for first in range(0, max(len(names), batch), batch):
        rows = [new(names[(first + i) % len(names)]) for i in range(batch)]
        for _ in range(steps):
            masks: dict[str, np.ndarray] = {}
            for name, lib, fill in variants:
                states = [r.states[lib.name] for r in rows]
                t = time.perf_counter_ns()
                masks[name] = fill(states)
                mask_ms[name].append(_ms(t))
            allowed = np.logical_and.reduce([masks[lib.name] for lib in libs])
            if len(libs) > 1:
                differing = np.logical_xor(masks[libs[0].name], masks[libs[1].name]).sum(axis=1)
                agreement["rows"] += batch
                agreement["identical"] += int((differing == 0).sum())
                agreement["differing_tokens"] += int(differing.sum())
                for lib in libs:
                    alone = masks[lib.name] & ~allowed  # rows x tokens only this library allows
                    only[lib.name].update(np.flatnonzero(alone.any(axis=0)).tolist())
            tokens = []
            for i in range(batch):
                choices = np.flatnonzero(allowed[i])
                if not len(choices):
                    raise RuntimeError(f"no token allowed by every library ({rows[i].schema})")
                tokens.append(int(rng.choice(choices)))
            for lib in libs:
                t = time.perf_counter_ns()
                for r, token in zip(rows, tokens, strict=True):
                    if not lib.accept(r.states[lib.name], token):
                        raise RuntimeError(f"{lib.name} refused token {token} its mask allowed")
                accept_ms[lib.name].append(_ms(t))
            for i, (r, token) in enumerate(zip(rows, tokens, strict=True)):
                r.tokens.append(token)
                if token in eos_set:
                    done(r, True)
                    rows[i] = new(r.schema)
        for r in rows:  # finish each open request, untimed, along closing tokens
            finished = False
            for _ in range(finish_limit):
                allowed = np.logical_and.reduce(
                    [lib.masks([r.states[lib.name]])[0] for lib in libs]
                )
                choices = np.flatnonzero(allowed)
                if not len(choices):
                    break
                best = choices[ranks[choices] == ranks[choices].min()]
                token = int(rng.choice(best))
                advance(r, token)
                if token in eos_set:
                    finished = True
                    break
            done(r, finished)
    return {
        "mask_ms": mask_ms,
        "accept_ms": accept_ms,
        "agreement": agreement,
        "only": only,
        "paths": paths,
    }


def _version(package: str) -> str | None:
    try:
        return package_version(package)
    except PackageNotFoundError:
        return None


def run_bench(
    tokenizer_dir: Path = DEFAULT_TOKENIZER,
    schemas: dict[str, dict[str, Any]] | None = None,
    batch_sizes: Sequence[int] = (1, 32),
    steps: int = 256,
    seed: int = 0,
    compile_repeats: int = 5,
    import_repeats: int = 3,
    libraries: Sequence[str] = LIBRARIES,
    vocab_size: int | None = None,
    finish_limit: int = 4096,
) -> dict[str, Any]:
    """The whole benchmark in-process; returns the JSON report (module docstring)."""
    schemas = dict(SCHEMAS if schemas is None else schemas)
    if not schemas or steps < 1 or min(batch_sizes, default=0) < 1 or compile_repeats < 1:
        raise ValueError("need schemas, steps >= 1, batch sizes >= 1 and compile repeats >= 1")
    notes: list[str] = []
    libraries = list(libraries)
    if "xgrammar" in libraries and not xgrammar_available():
        libraries.remove("xgrammar")
        notes.append("xgrammar is not installed: llguidance measured alone")
    vocab = Vocab(Path(tokenizer_dir), vocab_size)
    threads = max(1, (os.cpu_count() or 1) // 4)  # llguidance's pool in fill_masks
    libs: list[Any] = [Llguidance(vocab)]
    if "xgrammar" in libraries:
        libs.append(Xgrammar(vocab, threads))
    imports = measure_imports([lib.name for lib in libs], import_repeats)
    compiles = measure_compile(libs, schemas, compile_repeats)
    ranks = _closing_ranks(libs[0], vocab.eos, vocab.size)
    steps_rows, agreement, paths = [], [], []
    for batch in batch_sizes:
        rng = np.random.default_rng([seed, batch])
        result = walk(libs, schemas, batch, steps, rng, vocab.eos, ranks, finish_limit)
        for name, times in result["mask_ms"].items():
            steps_rows.append(
                {
                    "library": name,
                    "batch": batch,
                    "steps": len(times),
                    "mask_ms": _summary(times),
                    "accept_ms": _summary(result["accept_ms"].get(name, [])),
                }
            )
        a = result["agreement"]
        if a["rows"]:
            agreement.append(
                {
                    "batch": batch,
                    "rows": a["rows"],
                    "identical": a["identical"] / a["rows"],
                    "mean_differing_tokens": a["differing_tokens"] / a["rows"],
                    "allowed_by_one_only": {
                        name: [
                            {
                                "token": t,
                                "text": libs[0].decode([t]).decode("utf-8", "replace"),
                                "steps": n,
                            }
                            for t, n in counts.most_common(TOP_DIFFERING)
                        ]
                        for name, counts in result["only"].items()
                    },
                }
            )
        paths += result["paths"]
    report = {
        "config": {
            "tokenizer": str(tokenizer_dir),
            "vocab_size": vocab.size,
            "eos_token_ids": vocab.eos,
            "libraries": [lib.name for lib in libs],
            "versions": {lib: _version(lib) for lib in LIBRARIES},
            "schemas": list(schemas),
            "batch_sizes": list(batch_sizes),
            "steps": steps,
            "seed": seed,
            "compile_repeats": compile_repeats,
            "import_repeats": import_repeats,
            "cpu_count": os.cpu_count(),
            "mask_threads": threads,
        },
        "imports": imports,
        "compile": compiles,
        "steps": steps_rows,
        "ratios": _ratios(imports, compiles, steps_rows),
        "agreement": agreement,
        "paths": paths,
        "notes": notes,
    }
    return report


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _ratios(
    imports: list[dict[str, Any]], compiles: list[dict[str, Any]], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    """xgrammar / llguidance (above 1: llguidance the faster)."""
    imp = {r["library"]: r["import_ms"] for r in imports}
    comp: dict[str, dict[str, float]] = {}
    for r in compiles:
        comp.setdefault(r["schema"], {})[r["library"]] = r["compile_ms"] + r["first_mask_ms"]
    step: dict[tuple[str, int], dict[str, float]] = {
        (r["library"], r["batch"]): r["mask_ms"] for r in steps
    }
    batches = sorted({r["batch"] for r in steps})
    llg = "llguidance"
    return {
        "import": _ratio(imp.get("xgrammar"), imp.get(llg)),
        "compile_and_first_mask": {
            s: _ratio(v.get("xgrammar"), v.get(llg)) for s, v in comp.items()
        },
        "mask_p50": {
            f"{name}@{b}": _ratio(
                (step.get((name, b)) or {}).get("p50"), (step.get((llg, b)) or {}).get("p50")
            )
            for name in ("xgrammar", XGR_BATCH)
            for b in batches
            if (name, b) in step
        },
    }


# --- the table and the command --------------------------------------------------------------------


def _f(value: float | None, fmt: str = "{:.3f}", width: int = 0) -> str:
    text = "-" if value is None or not math.isfinite(value) else fmt.format(value)
    return text.rjust(width)


def format_report(report: dict[str, Any]) -> str:
    config = report["config"]
    libs = config["libraries"]
    versions = ", ".join(f"{lib} {config['versions'].get(lib)}" for lib in libs)
    lines = [
        f"grammar libraries on {config['tokenizer']} (V={config['vocab_size']}, "
        f"EOS {config['eos_token_ids']}); {config['cpu_count']} CPUs, "
        f"{config['mask_threads']} mask thread(s); {versions}",
        "ratio = xgrammar / llguidance (above 1: llguidance faster)",
        "",
    ]
    if report["imports"]:
        imp = {r["library"]: r for r in report["imports"]}
        lines.append(f"import, fresh interpreter (median of {config['import_repeats']})")
        for lib in libs:
            r = imp[lib]
            heavy = ", ".join(r["heavy_modules"]) or "-"
            lines.append(f"  {lib:<14} {r['import_ms']:>9.1f} ms   pulls in: {heavy}")
        if len(libs) > 1:
            lines.append(f"  {'ratio':<14} {_f(report['ratios']['import'], '{:.1f}', 9)}")
        lines.append("")
    comp = {(r["schema"], r["library"]): r for r in report["compile"]}
    lines.append(f"compile, cold, ms (median of {config['compile_repeats']}): compile + first mask")
    head = f"  {'schema':<16}" + "".join(f" {lib:>24}" for lib in libs)
    lines.append(head + (f" {'ratio':>7}" if len(libs) > 1 else ""))
    for schema in config["schemas"]:
        row = [comp[schema, lib] for lib in libs]
        cells = "".join(f" {r['compile_ms']:>11.2f} + {r['first_mask_ms']:>10.3f}" for r in row)
        ratio = report["ratios"]["compile_and_first_mask"].get(schema)
        lines.append(
            f"  {schema:<16}{cells}" + (f" {_f(ratio, '{:.2f}', 7)}" if len(libs) > 1 else "")
        )
    lines.append("")
    lines.append(f"per decode step, ms (p50 / p90 over steps; {config['steps']} steps per round)")
    lines.append(
        f"  {'library':<16} {'batch':>5} {'steps':>6} {'mask p50':>9} {'mask p90':>9} "
        f"{'ratio p50':>9} {'accept p50':>10} {'accept p90':>10}"
    )
    by = {(r["library"], r["batch"]): r for r in report["steps"]}
    names = [lib for lib in libs] + ([XGR_BATCH] if "xgrammar" in libs else [])
    for batch in config["batch_sizes"]:
        for name in names:
            r = by.get((name, batch))
            if r is None:
                continue
            mask, accept = r["mask_ms"], r["accept_ms"] or {}
            ratio = report["ratios"]["mask_p50"].get(f"{name}@{batch}")
            lines.append(
                f"  {name:<16} {batch:>5} {r['steps']:>6} {mask['p50']:>9.3f} {mask['p90']:>9.3f} "
                f"{_f(ratio, '{:.2f}', 9)} {_f(accept.get('p50'), '{:.3f}', 10)} "
                f"{_f(accept.get('p90'), '{:.3f}', 10)}"
            )
    if report["agreement"]:
        lines.append("")
        lines.append("mask agreement (rows whose two masks were identical; mean differing tokens)")
        for a in report["agreement"]:
            lines.append(
                f"  batch {a['batch']:>3}: {a['identical']:.1%} of {a['rows']} rows, "
                f"{a['mean_differing_tokens']:.2f} tokens"
            )
            for name, top in a["allowed_by_one_only"].items():
                shown = " ".join(repr(t["text"]) for t in top) or "-"
                lines.append(f"    only {name} allows (most steps first): {shown}")
    paths = report["paths"]
    finished = sum(p["finished"] for p in paths)
    valid = sum(p["valid_json"] for p in paths)
    lines.append("")
    lines.append(
        f"paths walked: {len(paths)}, finished {finished}, valid JSON {valid}; mean length "
        f"{_f(statistics.fmean(p['tokens'] for p in paths) if paths else None, '{:.1f}')} tokens"
    )
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "grammar", help="structured outputs: llguidance vs xgrammar, compile and mask cost"
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=DEFAULT_TOKENIZER,
        help="model directory with tokenizer.json (default: the embedded coder-v4)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=None, help="mask width (default: config.json's)"
    )
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    p.add_argument("--steps", type=int, default=256, help="timed decode steps per round")
    p.add_argument(
        "--schemas", nargs="+", choices=sorted(SCHEMAS), default=None, help="default: all"
    )
    p.add_argument("--compile-repeats", type=int, default=5)
    p.add_argument("--import-repeats", type=int, default=3, help="0: skip the import timing")
    p.add_argument("--no-xgrammar", action="store_true", help="measure llguidance alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    schemas = SCHEMAS if args.schemas is None else {n: SCHEMAS[n] for n in args.schemas}
    report = run_bench(
        tokenizer_dir=args.tokenizer,
        schemas=schemas,
        batch_sizes=args.batch_sizes,
        steps=args.steps,
        seed=args.seed,
        compile_repeats=args.compile_repeats,
        import_repeats=args.import_repeats,
        libraries=("llguidance",) if args.no_xgrammar else LIBRARIES,
        vocab_size=args.vocab_size,
    )
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0
