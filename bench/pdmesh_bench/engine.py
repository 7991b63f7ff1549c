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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from pdmesh.cli.options import resolve_model
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
from pdmesh_engine.model.deepseek_v3.runtime import V3Family
from pdmesh_engine.sampling import SamplingParams
from pdmesh_engine.scheduler import SchedulerOutput
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
    add_engine_options(p)
    add_speculative_options(p, k_list=True)
    p.set_defaults(run=run)


def _defaults(args: argparse.Namespace) -> list[int]:
    for name, normal, small in (
        ("concurrency", "1,8,32", "1,2"),
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
