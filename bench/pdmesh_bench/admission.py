"""`pdmesh bench admission`: the decode admission cap (`--max-kv-loads-per-step`) under a burst.

For each cap of `--caps` (`off` and N), one `EngineCore` (in-process, one rank) plays a decode
instance that receives a burst: R requests of P random prompt tokens whose KV all arrives at once.

KV arrival without NIXL: before the timed part, the same engine prefills the R prompts (greedy,
max_tokens 1, `hold_blocks`), which gives their real KV and first tokens; each request is then
`reserve`d under a new id, the held blocks are copied into the reserved ones and released. The timed
part starts at t0 with `kv_arrived(id, first_token)` for all R requests (the path a decode instance
takes when prefilled KV lands), then `engine.step()` runs until every request has its M tokens
(greedy, ignore_eos, max_tokens M including the first).

Per request, the decode tokens' times (`perf_counter` after the step that produced them; CPU ops
are synchronous, CUDA ones end with the sampled ids copied to the host):
    wait    = time of the first decode token - t0        (queueing + the first decode step)
    ITL     = gaps between consecutive decode tokens      (M - 2 per request)
    tokens_per_s = R * (M - 1) / (time of the last token - t0)
Reported: steps, tokens_per_s, ITL p50/p99 and wait p50/p99 (ms) over all requests, the largest
decode batch, and whether the tokens equal those of the first cap in the list (the cap changes
timing, never tokens).

JSON: {"results": [{"cap", "steps", "tokens_per_s", "itl_ms_p50", "itl_ms_p99", "wait_ms_p50",
"wait_ms_p99", "max_batch", "same_tokens"}], "config": {...}}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdmesh.tools.model_init import init_model
from pdmesh_bench.allreduce import percentile
from pdmesh_engine.config import EngineConfig
from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.sampling import SamplingParams

DEFAULTS = {"requests": 64, "prompt_len": 64, "max_tokens": 64}
QUICK = {"requests": 6, "prompt_len": 16, "max_tokens": 4}


@dataclass(frozen=True)
class Burst:
    requests: int
    prompt_len: int
    max_tokens: int  # including the first token (from the prefill)
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(4, vocab_size) for _ in range(self.prompt_len)]
            for _ in range(self.requests)
        ]


@dataclass(frozen=True)
class CapResult:
    cap: str  # "off" or N
    steps: int
    tokens_per_s: float
    itl_ms_p50: float
    itl_ms_p99: float
    wait_ms_p50: float
    wait_ms_p99: float
    max_batch: int
    same_tokens: bool  # tokens equal those of the first cap measured


@dataclass
class BurstRun:
    """What one timed burst produced: per request, its decode tokens and their times (s after
    t0), and the decode batch size of every step."""

    tokens: dict[str, list[int]]
    times: dict[str, list[float]]
    batch_sizes: list[int]

    @property
    def digest(self) -> str:
        text = json.dumps(sorted(self.tokens.items()))
        return hashlib.sha256(text.encode()).hexdigest()


def deliver(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, int]:
    """Give each prompt's KV to `engine` as if a prefill instance had pushed it: the requests
    `r<i>` end up WAITING_FOR_KV with their real KV in the reserved blocks. Returns their first
    tokens (what the prefill sampled), for `kv_arrived`."""
    first_params = replace(params, max_tokens=1)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, first_params, f"p{i}", hold_blocks=True)
    first: dict[str, int] = {}
    while engine.has_unfinished:
        for out in engine.step():
            first[out.request_id] = out.new_token_ids[0]
    block_size = engine.kv_layout.block_size
    for i, prompt in enumerate(prompts):
        tables = engine.reserve(prompt, params, f"r{i}")
        if tables is None:
            raise ValueError("the KV pool is too small for the burst: raise --num-blocks")
        num_blocks = -(-len(prompt) // block_size)
        sources = engine.blocks_of(f"p{i}")[:num_blocks]
        engine.kv_caches[:, tables["kv"][:num_blocks]] = engine.kv_caches[:, sources]
        engine.release_held(f"p{i}")
    return {f"r{i}": first[f"p{i}"] for i in range(len(prompts))}


def run_burst(engine: EngineCore, first: dict[str, int]) -> BurstRun:
    """The timed part: every reserved request's KV arrives at once, then steps until all end."""
    run = BurstRun({rid: [] for rid in first}, {rid: [] for rid in first}, [])
    t0 = time.perf_counter()
    for rid, token in first.items():
        if engine.kv_arrived(rid, token) is not None:
            raise ValueError(f"{rid} ended with its first token: use --max-tokens >= 2")
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter() - t0
        run.batch_sizes.append(len(outputs))
        for out in outputs:
            run.tokens[out.request_id].extend(out.new_token_ids)
            run.times[out.request_id].extend([now] * len(out.new_token_ids))
    return run


def summarize(cap: int | None, run: BurstRun, reference: str | None) -> CapResult:
    waits = [times[0] for times in run.times.values()]
    gaps = [b - a for times in run.times.values() for a, b in zip(times, times[1:], strict=False)]
    num_tokens = sum(len(t) for t in run.tokens.values())
    end = max(times[-1] for times in run.times.values())
    return CapResult(
        "off" if cap is None else str(cap),
        len(run.batch_sizes),
        num_tokens / end,
        1e3 * percentile(gaps, 50) if gaps else 0.0,
        1e3 * percentile(gaps, 99) if gaps else 0.0,
        1e3 * percentile(waits, 50),
        1e3 * percentile(waits, 99),
        max(run.batch_sizes),
        reference is None or run.digest == reference,
    )


def measure(
    model_dir: Path, config: EngineConfig, burst: Burst, caps: list[int | None]
) -> list[CapResult]:
    results: list[CapResult] = []
    reference: str | None = None
    params = SamplingParams(max_tokens=burst.max_tokens, temperature=0.0, ignore_eos=True)
    for cap in caps:
        engine = EngineCore(model_dir, replace(config, max_kv_loads_per_step=cap))
        first = deliver(engine, burst.prompts(engine.model_config.vocab_size), params)
        run = run_burst(engine, first)
        engine.check_integrity()
        results.append(summarize(cap, run, reference))
        reference = reference or run.digest
    return results


def parse_caps(text: str) -> list[int | None]:
    caps: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item in ("off", "0"):
            caps.append(None)
        elif item.isdigit():
            caps.append(int(item))
        else:
            raise ValueError(f"--caps: {item!r} is not 'off' or a positive integer")
    return caps


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="model directory (default: --preset)")
    p.add_argument(
        "--preset",
        default="tiny",
        help="without --model: generate this preset (tiny, small, ...) in a temporary directory",
    )
    p.add_argument("--caps", default="off,2,4,8", help="admission caps to compare, 'off' or N")
    p.add_argument(
        "--requests", type=int, default=None, help=f"burst size ({DEFAULTS['requests']})"
    )
    p.add_argument("--prompt-len", type=int, default=None, help=f"({DEFAULTS['prompt_len']})")
    p.add_argument(
        "--max-tokens", type=int, default=None, help=f"per request ({DEFAULTS['max_tokens']})"
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: 256 MiB)")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a few small requests (smoke test)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument(
        "--sim",
        type=Path,
        metavar="COSTS.json",
        help="also run the same burst on `pdmesh sim`'s model of this cost file, and compare "
        "each cap's effect (relative to the first cap) measured vs simulated",
    )


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "admission", help="decode admission cap (--max-kv-loads-per-step) under a KV burst"
    )
    add_arguments(p)
    p.set_defaults(run=run)


def _burst(args: argparse.Namespace) -> Burst:
    sizes = QUICK if args.quick else DEFAULTS
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in sizes.items()}
    if values["requests"] < 1 or values["prompt_len"] < 1 or values["max_tokens"] < 2:
        raise ValueError("--requests and --prompt-len must be >= 1, --max-tokens >= 2")
    return Burst(values["requests"], values["prompt_len"], values["max_tokens"], args.seed)


def _print_table(results: list[CapResult]) -> None:
    header = (
        "cap",
        "steps",
        "tok/s",
        "ITL p50",
        "ITL p99",
        "wait p50",
        "wait p99",
        "batch",
        "same",
    )
    print("{:>5} {:>6} {:>9} {:>8} {:>8} {:>9} {:>9} {:>6} {:>5}".format(*header))
    for r in results:
        print(
            f"{r.cap:>5} {r.steps:>6} {r.tokens_per_s:>9.1f} {r.itl_ms_p50:>8.2f} "
            f"{r.itl_ms_p99:>8.2f} {r.wait_ms_p50:>9.2f} {r.wait_ms_p99:>9.2f} "
            f"{r.max_batch:>6} {'yes' if r.same_tokens else 'NO':>5}"
        )
    print("(ms; wait = burst arrival to a request's first decode token)")


def run(args: argparse.Namespace) -> int:
    try:
        burst, caps = _burst(args), parse_caps(args.caps)
        config = EngineConfig(
            device=args.device,
            num_blocks=args.num_blocks,
            num_threads=args.torch_threads,
            max_num_seqs=max(burst.requests, EngineConfig().max_num_seqs),
            seed=args.seed,
        )
    except ValueError as e:
        print(f"pdmesh bench admission: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = init_model(Path(tmp) / args.preset, preset=args.preset, verbose=False)
        results = measure(model_dir, config, burst, caps)
    _print_table(results)
    simulated = None if args.sim is None else _simulated(args, burst, caps, results)
    if args.json is not None:
        report: dict[str, Any] = {
            "results": [asdict(r) for r in results],
            "simulated": simulated,
            "config": {
                **asdict(burst),
                "model": str(args.model or args.preset),
                "device": args.device,
            },
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r.same_tokens for r in results) else 1


def _simulated(
    args: argparse.Namespace, burst: Burst, caps: list[int | None], measured: list[CapResult]
) -> list[dict[str, Any]]:
    """The burst on the simulator, and each cap's effect against the first cap, both ways."""
    from pdmesh_bench.sim.burst import simulate_burst
    from pdmesh_bench.sim.costs import load_costs

    costs = load_costs(args.sim)
    threads = args.torch_threads or costs.cores
    rows = [
        simulate_burst(costs, burst.requests, burst.prompt_len, burst.max_tokens, cap, threads)
        for cap in caps
    ]
    print(f"simulated ({args.sim}); effect of each cap against cap {measured[0].cap}:")
    head = ("cap", "tok/s", "wait p99", "tok/s x meas/sim", "wait p99 x meas/sim")
    print("{:>5} {:>9} {:>9}   {:>17} {:>20}".format(*head))
    for row, real in zip(rows, measured, strict=True):
        row["tokens_per_s_effect"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["wait_p99_effect"] = row["wait_ms_p99"] / max(rows[0]["wait_ms_p99"], 1e-9)
        row["measured_tokens_per_s_effect"] = real.tokens_per_s / measured[0].tokens_per_s
        row["measured_wait_p99_effect"] = real.wait_ms_p99 / max(measured[0].wait_ms_p99, 1e-9)
        print(
            f"{row['cap']:>5} {row['tokens_per_s']:>9.1f} {row['wait_ms_p99']:>9.1f}   "
            f"{row['measured_tokens_per_s_effect']:>8.3f}/{row['tokens_per_s_effect']:<8.3f} "
            f"{row['measured_wait_p99_effect']:>10.2f}/{row['wait_p99_effect']:<9.2f}"
        )
    return rows
