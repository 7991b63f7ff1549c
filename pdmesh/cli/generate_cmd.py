"""`pdmesh generate`: offline batched generation with the engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from pdmesh.cli.options import resolve_model
from pdmesh_service.worker.engine_options import (
    add_engine_options,
    add_speculative_options,
    engine_config,
    speculative_fields,
)

_SAMPLING_FLAGS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "logprobs",
    "ignore_eos",
    "min_tokens",
)


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate completions offline (all prompts batched)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one text prompt")
    source.add_argument("--prompt-ids", help="one prompt as comma-separated token ids, e.g. 1,2,3")
    source.add_argument(
        "--prompts-file",
        type=Path,
        help='JSONL: {"prompt": ...} or {"prompt_ids": [...]} plus optional sampling fields',
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument(
        "--logprobs", type=int, default=None, help="return this many top alternatives per token"
    )
    p.add_argument("--ignore-eos", action="store_true", default=False)
    p.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt, in input order"
    )
    add_engine_options(p)
    add_speculative_options(p)
    p.set_defaults(run=run)


def read_prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.prompt is not None:
        return [{"prompt": args.prompt}]
    if args.prompt_ids is not None:
        try:
            return [{"prompt_ids": [int(t) for t in args.prompt_ids.split(",") if t.strip()]}]
        except ValueError as e:
            raise ValueError(f"--prompt-ids must be comma-separated integers ({e})") from e
    lines: list[dict[str, Any]] = []
    for number, line in enumerate(args.prompts_file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.prompts_file}:{number}: not valid JSON ({e})") from e
        if not isinstance(item, dict) or ("prompt" in item) == ("prompt_ids" in item):
            raise ValueError(
                f"{args.prompts_file}:{number}: needs exactly one of 'prompt' or 'prompt_ids'"
            )
        lines.append(item)
    if not lines:
        raise ValueError(f"{args.prompts_file}: no prompts")
    return lines


def run(args: argparse.Namespace) -> int:
    from pdmesh_engine import LLM, SamplingParams

    items = read_prompts(args)
    defaults = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    params = []
    for number, item in enumerate(items, start=1):
        fields = {k: v for k, v in item.items() if k not in ("prompt", "prompt_ids")}
        merged = {k: v for k, v in {**defaults, **fields}.items() if v is not None}
        try:
            params.append(SamplingParams.from_dict(merged))
        except ValueError as e:
            raise ValueError(f"prompt {number}: {e}") from e
    spec = speculative_fields(
        args.speculative_method, args.num_speculative_tokens, args.draft_model
    )
    config = dataclasses.replace(engine_config(args), **spec)
    llm = LLM(resolve_model(args.model), config)
    outputs = llm.generate(items, params)
    for out in outputs:
        if args.json:
            record = {
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "prompt_tokens": len(out.prompt_token_ids),
                "cached_tokens": out.num_cached_tokens,
            }
            if out.logprobs:
                record["logprobs"] = out.logprobs
                record["top_logprobs"] = out.top_logprobs
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(out.text)
    return 0
