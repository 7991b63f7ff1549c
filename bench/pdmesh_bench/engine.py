"""`pdmesh bench engine`: offline throughput of the engine against transformers `generate`, side by
side.

For each concurrency c, in one process and one run: c random-token prompts of `--input-len` tokens
(seeded, fresh per c and per round, so no prefix-cache hits), greedy, `--output-len` tokens each
with EOS ignored. With `--rounds N` both sides run N times, alternating which goes first (a shared,
noisy machine drifts), and the medians are reported.

- engine: `EngineCore`, all c requests added at once, stepped until done.
- transformers: `DeepseekV3ForCausalLM.from_pretrained(model)` `generate` on the same prompts as one
  batch (equal lengths, no padding), `max_new_tokens = min_new_tokens = output_len`, no sampling,
  under `torch.inference_mode`. Same dtype and thread count as the engine.

Both are warmed up first with a short run. Output tokens/s = c * output_len / wall time from
submission to the last token; ratio = engine / transformers. Also per concurrency:

- prefill time: engine, from submission until every request has its first token; transformers,
  the first forward call of `generate` (the batched prompt).
- decode step time: engine, median of `EngineCore.step` over steps that ran only decodes;
  transformers, median interval between consecutive forward calls (a whole generate step).
- decode roofline: achieved FLOP/s and bytes/s of the engine's decode-only steps under the cost
  model of `pdmesh_bench.machine`, as a fraction of this machine's matmul and memory peaks,
  measured at the start of the same run; the bandwidth fraction also against the memory peak
  measured just before and just after each engine run (`%BW beside`: a shared machine's bandwidth
  drifts within a run).
- outputs_match: sequences whose tokens are identical between the two (greedy fp32: expect all).

With `--against llama.cpp --llama-batched-bench BIN --gguf FILE` (a GGUF of the same checkpoint),
llama.cpp's `llama-batched-bench` runs the same workload (`--input-len`, `--output-len`, the
concurrencies as its batch sizes, the same thread count, its default settings) `--rounds` times
after the engine, and each row also carries its decode tokens/s (S_TG) and step, beside the
engine's decode-only figures (c / decode step): `pdmesh_bench.llamacpp`.

Memory: peak RSS (`ru_maxrss`) for the whole process, which holds both models; RSS after loading
each model is reported as well. `kv_bytes_per_token` is the engine's paged latent cache per token.

With `--constrained-share 0,0.5,1` it measures instead what structured outputs cost a decode step
(no transformers): for each concurrency c (default 1,32; quick 1,2) and share s, c requests on one
`EngineCore`, all added at once, round(s * c) of them constrained to a JSON schema
(`pdmesh_bench.constrained.SCHEMAS` in turn, sized so that their output outlasts the measured
steps; greedy or `--temperature`, seeded), the rest unconstrained with EOS ignored. Timed:
`EngineCore.step` over the steps that decode all c requests and nothing else (no prefill), up to
`--output-len` of them; then the unconstrained requests are aborted and the constrained ones run,
untimed, to their end, and their outputs are validated against their schemas (`valid`). The same
prompts serve every share of a round; `--rounds` alternate the order of the shares (a shared machine
drifts); medians are reported. Per (c, s): the median decode step, the masking overhead
step(s) / step(0) - 1 (also paired within each round), and the masks' own time from wrapping
`pdmesh_engine.grammar.fill_masks` (`mask_ms`: computed on llguidance's threads beside the forward),
the step's wait for them after its forward (`mask_wait_ms`: the part not hidden), and `fill_masks`
timed alone, once, on the batch's constrained states as they stand after the window
(`mask_alone_ms`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from pdmesh.cli.options import resolve_model
from pdmesh_bench.constrained import SCHEMAS, constrained_params, items_for, validation_error
from pdmesh_bench.llamacpp import BatchedBenchRow, run_batched_bench
from pdmesh_bench.machine import (
    DecodeCostModel,
    MachinePeaks,
    measure_peaks,
    memory_beside,
    roofline,
    rss_snapshot,
    set_threads,
)
from pdmesh_bench.spec import run_spec
from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.grammar import fill_masks
from pdmesh_engine.model.deepseek_v3.runtime import V3Family
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import SchedulerOutput
from pdmesh_engine.tokenizer import Tokenizer
from pdmesh_service.worker.engine_options import (
    add_engine_options,
    add_speculative_options,
    engine_config,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "engine", help="engine vs transformers generate: output tokens/s per concurrency"
    )
    p.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated request counts (default 1,8,32; quick: 1,2)",
    )
    p.add_argument(
        "--input-len", type=int, default=None, help="prompt tokens (default 256; quick: 16)"
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens per request (default 128; quick: 4)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of both sides per concurrency, alternating which goes first; medians are "
        "reported",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    p.add_argument(
        "--against",
        choices=["transformers", "llama.cpp"],
        default="transformers",
        help="llama.cpp: also run llama-batched-bench on --gguf and put its decode figures beside "
        "ours (transformers always runs: it checks the tokens)",
    )
    p.add_argument("--llama-batched-bench", type=Path, help="llama.cpp's llama-batched-bench")
    p.add_argument("--gguf", type=Path, help="a GGUF of the same checkpoint, for llama.cpp")
    p.add_argument(
        "--constrained-share",
        default=None,
        metavar="S,S,...",
        help="measure instead the decode step with these shares (0..1) of JSON-schema-constrained "
        "requests, side by side (e.g. 0,0.5,1; concurrency default 1,32)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="--constrained-share: sampling temperature of every request (default greedy)",
    )
    add_engine_options(p)
    add_speculative_options(p, k_list=True)
    p.set_defaults(run=run)


def _defaults(args: argparse.Namespace) -> list[int]:
    constrained = getattr(args, "constrained_share", None) is not None
    for name, normal, small in (
        ("concurrency", "1,32" if constrained else "1,8,32", "1,2"),
        ("input_len", 256, 16),
        ("output_len", 128, 4),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if args.quick else normal)
    try:
        levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError as e:
        raise ValueError(
            f"--concurrency must be comma-separated integers, got {args.concurrency!r}"
        ) from e
    if not levels or min(levels) < 1 or min(args.input_len, args.output_len, args.rounds) < 1:
        raise ValueError("--concurrency, --input-len, --output-len and --rounds must be >= 1")
    if args.against == "llama.cpp" and not (args.llama_batched_bench and args.gguf):
        raise ValueError("--against llama.cpp needs --llama-batched-bench BIN and --gguf FILE")
    set_threads(args.torch_threads)  # before the machine peaks are measured
    return levels


def _log(msg: str) -> None:
    print(f"bench engine: {msg}", file=sys.stderr, flush=True)


# ----- the engine -----
class StepRecorder:
    """Times `EngineCore.step` and keeps what each step scheduled (the scheduler's output)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.steps: list[tuple[float, SchedulerOutput]] = []
        self._last: SchedulerOutput | None = None
        self._schedule = engine.scheduler.schedule

    def _recording_schedule(self) -> SchedulerOutput:
        self._last = self._schedule()
        return self._last

    def step(self) -> list:
        # instance attribute shadows the method
        self.engine.scheduler.schedule = self._recording_schedule
        try:
            start = time.perf_counter()
            outputs = self.engine.step()
            elapsed = time.perf_counter() - start
        finally:
            del self.engine.scheduler.schedule
        if self._last is not None:
            self.steps.append((elapsed, self._last))
        return outputs

    def decode_steps(self) -> list[tuple[float, list[int]]]:
        """(seconds, context of each sequence) of the steps that ran only single-token decodes."""
        return [
            (sec, [s.start_position + 1 for s in out.scheduled])
            for sec, out in self.steps
            if out.scheduled and all(len(s.token_ids) == 1 for s in out.scheduled)
        ]


def run_engine(engine: EngineCore, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    recorder = StepRecorder(engine)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first_token_at: dict[str, float] = {}
    while engine.has_unfinished:
        for out in recorder.step():
            tokens[out.request_id].extend(out.new_token_ids)
            first_token_at.setdefault(out.request_id, time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    decodes = recorder.decode_steps()
    return {
        "seconds": elapsed,
        "tokens": [tokens[rid] for rid in ids],
        "prefill_s": max(first_token_at.values(), default=0.0),
        "steps": len(recorder.steps),
        "decode_steps": decodes,
        "decode_step_ms": statistics.median(s for s, _ in decodes) * 1e3 if decodes else None,
        "step_ms": statistics.median(s for s, _ in recorder.steps) * 1e3,
    }


# ----- transformers -----
def load_hf(model_dir: Path, dtype: torch.dtype) -> Any:
    """transformers' model class of the checkpoint's architecture (DeepseekV3ForCausalLM,
    DeepseekV4ForCausalLM)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    (architecture,) = json.loads((model_dir / "config.json").read_text())["architectures"]
    return getattr(transformers, architecture).from_pretrained(model_dir, dtype=dtype).eval()


def run_hf(model: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """One batched `generate`; forward hooks time the prefill and the interval between decode
    steps."""
    starts: list[float] = []
    ends: list[float] = []
    pre = model.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
    post = model.register_forward_hook(lambda *_: ends.append(time.perf_counter()))
    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    eos = model.generation_config.eos_token_id
    pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                pad_token_id=pad,
            )
            elapsed = time.perf_counter() - start
    finally:
        pre.remove()
        post.remove()
    intervals = [b - a for a, b in pairwise(starts[1:])]
    return {
        "seconds": elapsed,
        "tokens": out[:, ids.shape[1] :].tolist(),
        "prefill_s": (ends[0] - start) if ends else None,
        "decode_step_ms": statistics.median(intervals) * 1e3 if intervals else None,
    }


# ----- the run -----
def make_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def _rounds(
    c: int, args: argparse.Namespace, engine: EngineCore, hf: Any, peaks: MachinePeaks
) -> tuple[list[dict], list[dict]]:
    """Both sides `args.rounds` times on fresh prompts each round (no prefix hits), alternating who
    goes first; the memory peak measured again just before and just after each engine run."""
    ours: list[dict] = []
    theirs: list[dict] = []
    for r in range(args.rounds):
        prompts = make_prompts(
            engine.model_config.vocab_size, c, args.input_len, (args.seed * 1000 + c) * 100 + r
        )
        for side in ("engine", "hf") if r % 2 == 0 else ("hf", "engine"):
            _log(f"concurrency {c}, round {r + 1}/{args.rounds}: {side} ...")
            if side == "engine":
                before = peaks.measure_memory_again()
                ours.append(run_engine(engine, prompts, args.output_len))
                ours[-1]["memory_bytes_per_s_beside"] = (before, peaks.measure_memory_again())
            else:
                theirs.append(run_hf(hf, prompts, args.output_len))
            seconds = (ours if side == "engine" else theirs)[-1]["seconds"]
            _log(f"concurrency {c}, round {r + 1}/{args.rounds}: {side} {seconds:.2f} s")
    return ours, theirs


def _median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if run[key] is not None]
    return statistics.median(values) if values else None


def compare(
    c: int,
    args: argparse.Namespace,
    engine: EngineCore,
    hf: Any,
    cost: DecodeCostModel | None,
    peaks: MachinePeaks,
) -> dict[str, Any]:
    """One row of the results: medians over the rounds (ratio = engine tokens/s / transformers
    tokens/s)."""
    ours, theirs = _rounds(c, args, engine, hf, peaks)
    out_tokens = c * args.output_len
    engine_tps, hf_tps = (
        out_tokens / _median(ours, "seconds"),
        out_tokens / _median(theirs, "seconds"),
    )
    match = sum(a == b for a, b in zip(ours[0]["tokens"], theirs[0]["tokens"], strict=True))
    decode_steps = [step for run in ours for step in run["decode_steps"]]
    return {
        "concurrency": c,
        "engine_tokens_per_s": engine_tps,
        "hf_tokens_per_s": hf_tps,
        "ratio": engine_tps / hf_tps,
        "output_tokens": out_tokens,
        "rounds": args.rounds,
        "engine_seconds": [run["seconds"] for run in ours],
        "hf_seconds": [run["seconds"] for run in theirs],
        "engine_prefill_s": _median(ours, "prefill_s"),
        "hf_prefill_s": _median(theirs, "prefill_s"),
        "engine_decode_step_ms_median": _median(ours, "decode_step_ms"),
        "hf_decode_step_ms_median": _median(theirs, "decode_step_ms"),
        "engine_steps": ours[0]["steps"],
        "engine_decode_only_steps": len(ours[0]["decode_steps"]),
        "outputs_match": match,
        "memory_bytes_per_s_beside": [run["memory_bytes_per_s_beside"] for run in ours],
        "roofline": None
        if cost is None
        else roofline(
            cost,
            decode_steps,
            peaks,
            memory_beside(
                [
                    (sum(s for s, _ in run["decode_steps"]), *run["memory_bytes_per_s_beside"])
                    for run in ours
                ]
            ),
        ),
    }


def warm_up(engine: EngineCore, hf: Any, args: argparse.Namespace) -> None:
    prompts = make_prompts(
        engine.model_config.vocab_size, 2, min(args.input_len, 32), args.seed + 999_983
    )
    run_engine(engine, prompts, 4)
    if hf is not None:
        run_hf(hf, prompts, 4)


def run(args: argparse.Namespace) -> int:
    levels = _defaults(args)
    model_dir = resolve_model(args.model)
    if args.constrained_share is not None:
        return run_constrained(args, model_dir, levels)
    load_avg = [os.getloadavg()[0]]
    _log(f"measuring machine peaks (threads={torch.get_num_threads()})")
    peaks = measure_peaks(args.quick)
    config = engine_config(args)
    config = dataclasses.replace(
        config, max_num_seqs=max(config.max_num_seqs, max(levels)), seed=args.seed
    )
    if args.num_speculative_tokens is not None:
        return run_spec(args, model_dir, config, levels, load_avg, run_engine, _log)
    _log(f"loading the engine from {model_dir}")
    engine = EngineCore(model_dir, config)
    memory = {"after_engine_load": rss_snapshot()}
    _log("loading transformers' model")
    hf = load_hf(model_dir, engine.runner.dtype)
    memory["after_hf_load"] = rss_snapshot()
    _log("warming up")
    warm_up(engine, hf, args)
    cost = (  # the decode cost model is MLA's (V3)
        DecodeCostModel.from_model(engine.runner.model, engine.runner.kv_layout.bytes_per_token)
        if isinstance(engine.runner.family, V3Family)
        else None
    )
    results = [compare(c, args, engine, hf, cost, peaks) for c in levels]
    if args.against == "llama.cpp":
        add_llamacpp(results, llamacpp_rounds(args, levels))
    load_avg.append(os.getloadavg()[0])
    memory["peak_rss_bytes"] = rss_snapshot()["peak_rss_bytes"]
    report = {
        "results": results,
        "model": str(model_dir),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "rounds": args.rounds,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": str(engine.runner.device),
        "threads": torch.get_num_threads(),
        "load_average_1min": load_avg,
        "machine": peaks.to_dict(),
        "memory": memory,
        "kv_bytes_per_token": engine.runner.kv_layout.bytes_per_token,
        "cost_model": cost.to_dict() if cost is not None else None,
        "hf": _hf_info(hf),
    }
    print_table(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def llamacpp_rounds(
    args: argparse.Namespace, levels: list[int]
) -> list[dict[int, BatchedBenchRow]]:
    rounds = []
    for r in range(args.rounds):
        _log(f"llama.cpp round {r + 1}/{args.rounds}: {args.llama_batched_bench.name} ...")
        rounds.append(
            run_batched_bench(
                args.llama_batched_bench,
                args.gguf,
                args.input_len,
                args.output_len,
                levels,
                torch.get_num_threads(),
            )
        )
    return rounds


def add_llamacpp(results: list[dict[str, Any]], rounds: list[dict[int, BatchedBenchRow]]) -> None:
    """Each row gains llama.cpp's decode tokens/s and step (medians over its rounds), our decode
    tokens/s from the median decode-only step, and their ratio (ours / llama.cpp)."""
    for row in results:
        c = row["concurrency"]
        theirs = statistics.median(r[c].decode_tokens_per_s for r in rounds)
        step = row["engine_decode_step_ms_median"]
        ours = c * 1e3 / step if step else None
        row["llamacpp_decode_tokens_per_s"] = theirs
        row["llamacpp_decode_step_ms"] = statistics.median(r[c].step_ms for r in rounds)
        row["engine_decode_tokens_per_s"] = ours
        row["decode_ratio_vs_llamacpp"] = ours / theirs if ours and theirs else None


def _hf_info(hf: Any) -> dict[str, Any]:
    import transformers

    return {
        "class": type(hf).__name__,
        "transformers_version": transformers.__version__,
        "experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(report: dict[str, Any]) -> None:
    m, mem = report["machine"], report["memory"]
    print(
        f"engine vs transformers: input {report['input_len']}, output {report['output_len']}, "
        f"{report['dtype']} on {report['device']}, {report['threads']} threads, "
        f"load average {report['load_average_1min'][0]:.1f} -> {report['load_average_1min'][1]:.1f}"
    )
    print(
        f"machine: {m['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s fp32 matmul, "
        f"{m['memory_bytes_per_s'] / 1e9:.1f} GB/s memory; KV {report['kv_bytes_per_token']} "
        "bytes/token"
    )
    print(
        f"RSS after engine load {mem['after_engine_load']['rss_bytes'] / 2**20:.0f} MiB, after "
        "transformers "
        f"load {mem['after_hf_load']['rss_bytes'] / 2**20:.0f} MiB, peak "
        f"{mem['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
    head = (
        f"{'conc':>5} {'engine tok/s':>13} {'hf tok/s':>10} {'ratio':>7} {'eng prefill s':>14} "
        f"{'hf prefill s':>13} {'eng step ms':>12} {'hf step ms':>11} {'%FLOP':>7} {'%BW':>6} "
        f"{'%BW beside':>11} {'match':>6}"
    )
    print(head)
    for r in report["results"]:
        roof = r["roofline"]
        flop = f"{100 * roof['flops_fraction_of_peak']:.2f}" if roof else "-"
        bw = f"{100 * roof['bandwidth_fraction_of_peak']:.1f}" if roof else "-"
        beside = roof.get("bandwidth_fraction_beside") if roof else None
        bw_beside = f"{100 * beside:.1f}" if beside else "-"
        print(
            f"{r['concurrency']:>5} {r['engine_tokens_per_s']:>13.1f} "
            f"{r['hf_tokens_per_s']:>10.1f} "
            f"{r['ratio']:>6.2f}x {r['engine_prefill_s']:>14.2f} {r['hf_prefill_s'] or 0:>13.2f} "
            f"{_ms(r['engine_decode_step_ms_median']):>12} "
            f"{_ms(r['hf_decode_step_ms_median']):>11} "
            f"{flop:>7} {bw:>6} {bw_beside:>11} {r['outputs_match']:>3}/{r['concurrency']}"
        )
    for r in report["results"]:
        measured = ", ".join(
            f"{a / 1e9:.1f}/{b / 1e9:.1f}" for a, b in r["memory_bytes_per_s_beside"]
        )
        print(f"conc {r['concurrency']}: memory GB/s before/after each engine run: {measured}")
    if "llamacpp_decode_tokens_per_s" in report["results"][0]:
        print(f"{'conc':>5} {'engine decode tok/s':>20} {'llama.cpp tok/s':>16} {'ratio':>7}")
        for r in report["results"]:
            ours, ratio = r["engine_decode_tokens_per_s"], r["decode_ratio_vs_llamacpp"]
            print(
                f"{r['concurrency']:>5} {ours or 0:>20.1f} "
                f"{r['llamacpp_decode_tokens_per_s']:>16.1f} {ratio or 0:>6.2f}x"
            )


# ----- schema-constrained requests (--constrained-share) -----
class _TimedFuture:
    """The masks' future of a step; `result()` records how long the step waited for it."""

    def __init__(self, future: Any, waits: list[float]) -> None:
        self.future, self.waits = future, waits

    def result(self) -> Any:
        start = time.perf_counter()
        try:
            return self.future.result()
        finally:
            self.waits.append(time.perf_counter() - start)


class MaskTimer:
    """While entered, times the grammar masks of every step: `fill_masks` where it runs (beside the
    forward, on the masks' thread) and the step's wait for its result after the forward."""

    def __init__(self) -> None:
        self.fills: list[float] = []
        self.waits: list[float] = []

    def __enter__(self) -> MaskTimer:
        from pdmesh_engine import grammar, model_runner

        self._fill, self._beside = grammar.fill_masks, model_runner.masks_beside
        fill, beside = self._fill, self._beside

        def timed_fill(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fill(*args, **kwargs)
            finally:
                self.fills.append(time.perf_counter() - start)

        def timed_beside(*args: Any, **kwargs: Any) -> Any:
            future = beside(*args, **kwargs)
            return None if future is None else _TimedFuture(future, self.waits)

        grammar.fill_masks = timed_fill  # masks_beside looks it up when it submits
        model_runner.masks_beside = timed_beside
        return self

    def __exit__(self, *exc: object) -> None:
        from pdmesh_engine import grammar, model_runner

        grammar.fill_masks, model_runner.masks_beside = self._fill, self._beside

    def take(self) -> tuple[float, float]:
        """(fill seconds, wait seconds) since the last take."""
        out = (sum(self.fills), sum(self.waits))
        self.fills.clear()
        self.waits.clear()
        return out


def parse_shares(text: str) -> list[float]:
    try:
        shares = [float(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise ValueError(
            f"--constrained-share must be comma-separated numbers, got {text!r}"
        ) from e
    if not shares or not all(0.0 <= s <= 1.0 for s in shares) or len(set(shares)) < len(shares):
        raise ValueError(f"--constrained-share must be distinct shares in [0, 1], got {text!r}")
    return shares


def constrained_count(share: float, c: int) -> int:
    """round(share * c), halves up (share 0.5 of one request: one)."""
    return int(share * c + 0.5)


@dataclasses.dataclass
class ConstrainedSetup:
    """What the requests of a batch look like: the constrained ones' schemas are sized so that
    their output outlasts the measured steps (the same schemas at every concurrency: their grammars
    are compiled once, in the warm-up)."""

    tokens_per_item: dict[str, int]  # the smallest item's tokens, per schema
    output_len: int
    input_len: int
    max_model_len: int
    prefill_steps: int  # steps the largest batch's prompts take (decodes run beside them)
    temperature: float
    seed: int

    def _seed(self, i: int) -> int | None:
        return None if self.temperature == 0 else self.seed * 1000 + i

    def schema(self, i: int) -> tuple[dict[str, Any], str, int]:
        """Request i's schema, its name and a max_tokens that its longest output fits in."""
        spec = SCHEMAS[i % len(SCHEMAS)]
        per_item = self.tokens_per_item[spec.name]
        n = items_for(self.output_len + self.prefill_steps + 2, per_item)
        room = self.max_model_len - self.input_len
        return spec.schema(n, n + 1), spec.name, min(room, 4 * (n + 2) * per_item + 64)

    def request(self, i: int) -> tuple[dict[str, Any], SamplingParams, str]:
        """Constrained request i of a batch: its schema, params and the schema's name."""
        schema, name, max_tokens = self.schema(i)
        return schema, constrained_params(schema, max_tokens, self.temperature, self._seed(i)), name

    def plain(self, i: int) -> SamplingParams:
        """An unconstrained request, long enough to outlast the window (it is aborted after it)."""
        return SamplingParams(
            max_tokens=min(
                self.max_model_len - self.input_len, self.output_len + self.prefill_steps + 2
            ),
            temperature=self.temperature,
            seed=self._seed(i),
            ignore_eos=True,
        )


def mask_alone(engine: EngineCore, request_ids: list[str]) -> float | None:
    """Ms of one `fill_masks` over these requests' grammar states as they stand (each advanced over
    its last token, its next mask not computed yet), with nothing running beside it. Once only:
    llguidance keeps a state's mask, so a second call costs next to nothing."""
    rows = [
        (request.grammar, row, ())
        for row, request in enumerate(engine.scheduler.requests[rid] for rid in request_ids)
        if request.grammar is not None
    ]
    if not rows:
        return None
    start = time.perf_counter()
    fill_masks(rows, len(rows), engine.model_config.vocab_size)
    return (time.perf_counter() - start) * 1e3


def run_shares_batch(
    engine: EngineCore,
    prompts: list[list[int]],
    share: float,
    setup: ConstrainedSetup,
    tokenizer: Tokenizer,
    timer: MaskTimer,
) -> dict[str, Any]:
    """One batch: c requests at once, round(share * c) constrained; times the full-batch decode
    steps (at most output_len of them), then finishes the constrained requests and checks them."""
    c = len(prompts)
    k = constrained_count(share, c)
    schemas: dict[str, tuple[dict[str, Any], str]] = {}
    ids = []
    for i, prompt in enumerate(prompts):
        if i < k:
            schema, params, name = setup.request(i)
            rid = engine.add_request(prompt, params)
            schemas[rid] = (schema, name)
        else:
            rid = engine.add_request(prompt, setup.plain(i))
        ids.append(rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    finished: dict[str, str | None] = {}
    recorder = StepRecorder(engine)
    steps: list[float] = []
    fills: list[float] = []
    waits: list[float] = []
    cpu: list[float] = []  # this process's CPU seconds per wall second, of each measured step
    timer.take()
    while engine.has_unfinished and len(steps) < setup.output_len:
        cpu_start = time.process_time()
        outputs = recorder.step()
        cpu_used = time.process_time() - cpu_start
        fill, wait = timer.take()
        elapsed, scheduled = recorder.steps[-1]
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
        full = len(scheduled.scheduled) == c and all(
            len(s.token_ids) == 1 for s in scheduled.scheduled
        )
        if full:
            steps.append(elapsed)
            fills.append(fill)
            waits.append(wait)
            cpu.append(cpu_used / elapsed)
        elif steps:  # a request ended (or was preempted): the batch is no longer whole
            break
    alone = mask_alone(engine, [rid for rid in schemas if rid not in finished])
    for rid in ids:
        if rid not in schemas and rid not in finished:
            engine.abort(rid)
    while engine.has_unfinished:  # the constrained requests, untimed, to the end of their JSON
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    errors = []
    for rid, (schema, name) in schemas.items():
        text = tokenizer.decode(tokens[rid])
        error = validation_error(text, schema)
        if error is not None:
            errors.append(f"{name} ({finished.get(rid)}, {len(tokens[rid])} tokens): {error}")
    lengths = [len(tokens[rid]) for rid in schemas]
    return {
        "share": share,
        "constrained": k,
        "steps": len(steps),
        "decode_step_ms": statistics.median(steps) * 1e3 if steps else None,
        "mask_ms": statistics.median(fills) * 1e3 if steps and k else None,
        "mask_wait_ms": statistics.median(waits) * 1e3 if steps and k else None,
        "mask_alone_ms": alone,
        "cpu_per_wall": statistics.median(cpu) if cpu else None,
        "load_1min": os.getloadavg()[0],
        "valid": k - len(errors),
        "errors": errors[:3],
        "constrained_tokens": (min(lengths), max(lengths)) if lengths else None,
    }


def share_rounds(
    c: int,
    shares: list[float],
    args: argparse.Namespace,
    engine: EngineCore,
    setup: ConstrainedSetup,
    tokenizer: Tokenizer,
    timer: MaskTimer,
) -> list[dict[str, Any]]:
    """Every share `args.rounds` times on the same prompts within a round (fresh ones per round),
    the order of the shares alternating between rounds; one row per share."""
    runs: dict[float, list[dict[str, Any]]] = {s: [] for s in shares}
    for r in range(args.rounds):
        prompts = make_prompts(
            engine.model_config.vocab_size, c, args.input_len, (args.seed * 1000 + c) * 100 + r
        )
        for s in shares if r % 2 == 0 else shares[::-1]:
            run = run_shares_batch(engine, prompts, s, setup, tokenizer, timer)
            runs[s].append(run)
            _log(
                f"concurrency {c}, round {r + 1}/{args.rounds}, share {s:g}: "
                f"{run['steps']} steps, median {_ms(run['decode_step_ms'])} ms, "
                f"CPU/wall {run['cpu_per_wall'] or 0:.2f}"
            )
    base = runs.get(0.0)
    rows = []
    for s in shares:
        ours = runs[s]
        step = _median(ours, "decode_step_ms")
        paired = (
            [
                a["decode_step_ms"] / b["decode_step_ms"] - 1
                for a, b in zip(ours, base, strict=True)
                if a["decode_step_ms"] and b["decode_step_ms"]
            ]
            if base is not None
            else []
        )
        base_step = _median(base, "decode_step_ms") if base is not None else None
        rows.append(
            {
                "concurrency": c,
                "share": s,
                "constrained": ours[0]["constrained"],
                "decode_step_ms": step,
                "decode_step_ms_rounds": [run["decode_step_ms"] for run in ours],
                "measured_steps": [run["steps"] for run in ours],
                # a round whose steps got less CPU than the others shared the machine
                "cpu_per_wall_rounds": [run["cpu_per_wall"] for run in ours],
                "load_1min_rounds": [run["load_1min"] for run in ours],
                "overhead": step / base_step - 1 if step and base_step else None,
                "overhead_paired_median": statistics.median(paired) if paired else None,
                "mask_ms": _median(ours, "mask_ms"),
                "mask_wait_ms": _median(ours, "mask_wait_ms"),
                "mask_alone_ms": _median(ours, "mask_alone_ms"),
                "valid": sum(run["valid"] for run in ours),
                "constrained_total": sum(run["constrained"] for run in ours),
                "constrained_tokens": [run["constrained_tokens"] for run in ours],
                "errors": [e for run in ours for e in run["errors"]][:3],
            }
        )
    return rows


def run_constrained(args: argparse.Namespace, model_dir: Path, levels: list[int]) -> int:
    shares = parse_shares(args.constrained_share)
    if args.num_speculative_tokens is not None or args.against != "transformers":
        raise ValueError("--constrained-share runs the engine alone: no speculation, no --against")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    load_avg = [os.getloadavg()[0]]
    config = engine_config(args)
    config = dataclasses.replace(
        config, max_num_seqs=max(config.max_num_seqs, max(levels)), seed=args.seed
    )
    _log(f"loading the engine from {model_dir}")
    engine = EngineCore(model_dir, config)
    tokenizer = Tokenizer.from_dir(model_dir)
    setup = ConstrainedSetup(
        {
            spec.name: spec.item_tokens(lambda t: tokenizer.encode(t, add_special_tokens=False))
            for spec in SCHEMAS
        },
        args.output_len,
        args.input_len,
        engine.max_model_len,
        math.ceil(max(levels) * args.input_len / config.max_num_batched_tokens),
        args.temperature,
        args.seed,
    )
    timer = MaskTimer()
    with timer:
        # one constrained request per schema: compiles their grammars (kept by the engine) and
        # builds llguidance's lazy lexers before anything is timed
        _log("warming up")
        warm = make_prompts(
            engine.model_config.vocab_size,
            len(SCHEMAS),
            min(args.input_len, 32),
            args.seed + 999_983,
        )
        run_shares_batch(engine, warm, 1.0, setup, tokenizer, timer)
        results = [
            row
            for c in levels
            for row in share_rounds(c, shares, args, engine, setup, tokenizer, timer)
        ]
    load_avg.append(os.getloadavg()[0])
    report = {
        "mode": "constrained",
        "results": results,
        "model": str(model_dir),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "rounds": args.rounds,
        "temperature": args.temperature,
        "shares": shares,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": str(engine.runner.device),
        "threads": torch.get_num_threads(),
        "load_average_1min": load_avg,
        "schemas": {spec.name: setup.schema(i)[0] for i, spec in enumerate(SCHEMAS)},
        "tokens_per_item": setup.tokens_per_item,
    }
    print_constrained_table(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _ms2(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def print_constrained_table(report: dict[str, Any]) -> None:
    print(
        f"decode step with JSON-schema-constrained requests: input {report['input_len']}, "
        f"up to {report['output_len']} measured steps, temperature {report['temperature']:g}, "
        f"{report['rounds']} round(s), {report['dtype']} on {report['device']}, "
        f"{report['threads']} threads, load average {report['load_average_1min'][0]:.1f} -> "
        f"{report['load_average_1min'][1]:.1f}"
    )
    print(
        f"{'conc':>5} {'share':>6} {'constr':>7} {'step ms':>8} {'overhead':>9} {'paired':>8} "
        f"{'mask ms':>8} {'alone ms':>9} {'wait ms':>8} {'steps':>6} {'valid':>8}"
    )
    for r in report["results"]:
        steps = min(r["measured_steps"]) if r["measured_steps"] else 0
        valid = f"{r['valid']}/{r['constrained_total']}" if r["constrained_total"] else "-"
        print(
            f"{r['concurrency']:>5} {r['share']:>6g} {r['constrained']:>7} "
            f"{_ms(r['decode_step_ms']):>8} {_pct(r['overhead']):>9} "
            f"{_pct(r['overhead_paired_median']):>8} {_ms2(r['mask_ms']):>8} "
            f"{_ms2(r['mask_alone_ms']):>9} "
            f"{_ms2(r['mask_wait_ms']):>8} {steps:>6} {valid:>8}"
        )
    print(
        "overhead: step(share) / step(0) - 1 of the medians; paired: its median over rounds, each "
        "against share 0 in the same round; mask ms: fill_masks beside the forward; alone ms: "
        "fill_masks of the same batch's states with nothing beside it; wait ms: the step's wait "
        "for the masks after its forward; steps: fewest measured in a round"
    )
    for r in report["results"]:
        for error in r["errors"]:
            print(f"conc {r['concurrency']} share {r['share']:g}: invalid output: {error}")
