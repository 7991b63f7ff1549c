"""`pdmesh bench engine --num-speculative-tokens 0,1,2,3`: speculative decoding off and on, side by
side in one run.

One `EngineCore` per K (0 = off; the same model and settings, drafts from `--speculative-method`,
mtp by default), loaded once. For each concurrency c and round: c prompts of `--input-len` tokens
cut at seeded offsets from the held-out standard-library sources (real Python, the text the default
model was not trained on, so drafts can be accepted; fresh per c and per round), greedy,
`--output-len` tokens each with EOS ignored, every K on the same prompts, the order of the K
rotating from round to round. Per (c, K), medians over the rounds:

- output tokens/s = c * output_len / wall time from submission to the last token, and the speed-up
  over K = 0 of the same c;
- engine steps and the median step time;
- acceptance: accepted / verified drafts, overall and per draft position, and the mean accepted
  length (tokens a verifying step emits, 1 + accepted drafts), from the engine's counters;
- outputs_match_k0: sequences identical to K = 0's, token for token (greedy: expect all).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch

from pdmesh_engine.config import EngineConfig
from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.spec_decode import SpecDecodeStats
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_service.worker.engine_options import speculative_fields


def parse_k_list(text: str | None) -> list[int]:
    """'0,1,2,3' -> [0, 1, 2, 3] (None: that default)."""
    try:
        ks = [int(k) for k in (text or "0,1,2,3").split(",") if k.strip()]
    except ValueError as e:
        raise ValueError(f"--num-speculative-tokens must be comma-separated integers: {e}") from e
    if not ks or min(ks) < 0 or len(set(ks)) != len(ks) or 0 not in ks:
        raise ValueError(
            "--num-speculative-tokens needs distinct values >= 0 including 0 (off, the "
            "baseline), e.g. 0,1,2,3"
        )
    return ks


def held_out_stream(model_dir: Path) -> torch.Tensor:
    """The held-out standard-library sources as one token stream, in the model's tokenizer."""
    from pdmesh.train.data import split, stdlib_sources

    tokenizer = Tokenizer.from_dir(model_dir)
    ids: list[int] = []
    for f in split(stdlib_sources())[1]:
        ids += tokenizer.encode(f.text)
    return torch.tensor(ids)


def cut_prompts(stream: torch.Tensor, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` tokens at seeded offsets."""
    if len(stream) <= length:
        raise ValueError(f"the held-out text has {len(stream)} tokens, fewer than {length}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length, (count,), generator=gen).tolist()
    return [stream[s : s + length].tolist() for s in starts]


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _spec_delta(engine: EngineCore, before: SpecDecodeStats | None) -> dict[str, Any]:
    """Acceptance over one run: the engine's counters now minus `before` (None: off)."""
    after = engine.spec_decode_stats()
    if after is None or before is None:
        return {"acceptance_rate": None, "acceptance_per_position": [], "mean_accepted_length": 1.0}
    drafts = [
        a - b
        for a, b in zip(after.num_drafts_per_position, before.num_drafts_per_position, strict=True)
    ]
    accepted = [
        a - b
        for a, b in zip(
            after.num_accepted_per_position, before.num_accepted_per_position, strict=True
        )
    ]
    return {
        "acceptance_rate": _ratio(
            after.num_accepted_tokens - before.num_accepted_tokens,
            after.num_draft_tokens - before.num_draft_tokens,
        ),
        "acceptance_per_position": [_ratio(a, n) for a, n in zip(accepted, drafts, strict=True)],
        "mean_accepted_length": _ratio(
            after.num_emitted_tokens - before.num_emitted_tokens,
            after.num_verify_steps - before.num_verify_steps,
        ),
    }


def run_spec_bench(
    args: argparse.Namespace,
    model_dir: Path,
    config: EngineConfig,
    levels: list[int],
    run_engine: Any,
    log: Any,
) -> tuple[list[dict[str, Any]], str]:
    """(the result rows, one per concurrency and K; the engines' dtype).
    `run_engine(engine, prompts, output_len)` is bench engine's timed run."""
    ks = parse_k_list(args.num_speculative_tokens)
    method = args.speculative_method or "mtp"
    engines: dict[int, EngineCore] = {}
    for k in ks:
        log(f"loading the engine with K={k} ({method if k else 'off'})")
        fields = speculative_fields(method, k, args.draft_model)
        engines[k] = EngineCore(model_dir, dataclasses.replace(config, **fields))
    stream = held_out_stream(model_dir)
    for engine in engines.values():  # warm-up
        run_engine(engine, cut_prompts(stream, 2, min(args.input_len, 32), args.seed - 1), 4)
    rows = []
    for c in levels:
        runs: dict[int, list[dict[str, Any]]] = {k: [] for k in ks}
        for r in range(args.rounds):
            prompts = cut_prompts(stream, c, args.input_len, (args.seed * 1000 + c) * 100 + r)
            order = ks[r % len(ks) :] + ks[: r % len(ks)]
            for k in order:
                engine = engines[k]
                before = engine.spec_decode_stats()
                run = run_engine(engine, prompts, args.output_len)
                run.update(_spec_delta(engine, before))
                runs[k].append(run)
                log(f"concurrency {c}, round {r + 1}/{args.rounds}, K={k}: {run['seconds']:.2f} s")
        base_tps = c * args.output_len / statistics.median(x["seconds"] for x in runs[0])
        reference = runs[0][0]["tokens"]
        for k in ks:
            tps = c * args.output_len / statistics.median(x["seconds"] for x in runs[k])
            first = runs[k][0]
            rows.append(
                {
                    "concurrency": c,
                    "num_speculative_tokens": k,
                    "speculative_method": method if k else None,
                    "engine_tokens_per_s": tps,
                    "speedup_vs_k0": tps / base_tps,
                    "acceptance_rate": first["acceptance_rate"],
                    "acceptance_per_position": first["acceptance_per_position"],
                    "mean_accepted_length": first["mean_accepted_length"],
                    "steps": first["steps"],
                    "step_ms_median": statistics.median(x["step_ms"] for x in runs[k]),
                    "engine_seconds": [x["seconds"] for x in runs[k]],
                    "outputs_match_k0": sum(
                        a == b for a, b in zip(first["tokens"], reference, strict=True)
                    ),
                }
            )
    return rows, str(engines[0].runner.dtype).removeprefix("torch.")


def print_spec_table(report: dict[str, Any]) -> None:
    print(
        f"speculative decoding ({report['speculative_method']}) against K=0: input "
        f"{report['input_len']}, output {report['output_len']}, {report['dtype']}, "
        f"{report['threads']} threads, {report['rounds']} round(s)"
    )
    print(
        f"{'conc':>5} {'K':>3} {'tok/s':>9} {'speedup':>8} {'step ms':>8} {'steps':>6} "
        f"{'accept':>7} {'mean len':>9} {'per position':>22} {'match':>6}"
    )
    for r in report["results"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        per = " ".join(f"{x:.2f}" for x in r["acceptance_per_position"]) or "-"
        match = f"{r['outputs_match_k0']}/{r['concurrency']}"
        print(
            f"{r['concurrency']:>5} {r['num_speculative_tokens']:>3} "
            f"{r['engine_tokens_per_s']:>9.1f} {r['speedup_vs_k0']:>7.2f}x "
            f"{r['step_ms_median']:>8.1f} {r['steps']:>6} {rate:>7} "
            f"{r['mean_accepted_length']:>9.2f} {per:>22} {match:>6}"
        )


def run_spec(
    args: argparse.Namespace,
    model_dir: Path,
    config: EngineConfig,
    levels: list[int],
    load_avg: list[float],
    run_engine: Any,
    log: Any,
) -> int:
    """`bench engine --num-speculative-tokens`: the table, and the JSON report with `--json`."""
    rows, dtype = run_spec_bench(args, model_dir, config, levels, run_engine, log)
    load_avg.append(os.getloadavg()[0])
    report = {
        "results": rows,
        "model": str(model_dir),
        "speculative_method": args.speculative_method or "mtp",
        "draft_model": str(args.draft_model) if args.draft_model else None,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "rounds": args.rounds,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "load_average_1min": load_avg,
    }
    print_spec_table(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
