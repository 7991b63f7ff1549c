"""`pdmesh bench forward`: time one exact forward batch of the engine's model (as `vllm bench
forward`).

- prefill: B sequences of C new tokens each, in one `ForwardBatch` (positions 0..C-1).
- decode:  B sequences that each already hold C tokens in the KV cache, plus one new token each.
  The cache is filled synthetically: sequence b owns the disjoint block range
  [b * M, (b + 1) * M) of `runner.kv_caches` (M = blocks for C + 1 tokens), and those rows get
  N(0, 1) values, the scale of the real entries (the latent after its RMSNorm, and the rope key
  projected from a unit-RMS hidden state). No prefill runs.

One timed forward = `model(batch, kv_caches)` plus `compute_logits` on the B sampled rows (what a
step computes before sampling). Reported: median and p90 ms over `--repeats` after `--warmup`,
tokens/s at the median, the decode cost model's FLOP/s and bytes/s against the machine's measured
peaks (decode only, see `pdmesh_bench.machine`), and with `--profile` the top 15 ops by self CPU
time from `torch.profiler`, inclusive time per module kind (attention, MoE, ...) and per kernel
call, and the op count: aten ops dispatched per forward, in total and per decoder layer (dense and
MoE layers apart), counted by a `TorchDispatchMode` (every op that reaches a kernel, views
included; what the Python overhead of a step scales with).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdmesh.cli.options import resolve_model
from pdmesh_bench.machine import (
    DecodeCostModel,
    measure_peaks,
    percentile,
    roofline,
    rss_snapshot,
    set_threads,
    time_calls,
)
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v3.runtime import V3Family
from pdmesh_engine.model.deepseek_v4.runtime import V4Family
from pdmesh_engine.model.registry import family_of, read_model_config
from pdmesh_engine.model_runner import ModelRunner
from pdmesh_service.worker.engine_options import add_engine_options, engine_config

PROFILE_ROWS = 15


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "forward", help="time one forward batch (prefill or decode) of the engine's model"
    )
    p.add_argument("--phase", choices=["prefill", "decode"], default="decode")
    p.add_argument(
        "--batch", type=int, default=None, help="sequences in the batch (default 32; quick: 2)"
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="prefill: new tokens per sequence; decode: tokens already cached (default 384; quick: "
        "16)",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed forwards (default 20; quick: 3)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed forwards first (default 3; quick: 1)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    p.add_argument(
        "--profile", action="store_true", help="print the top ops (torch.profiler) and module times"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    add_engine_options(p)
    p.set_defaults(run=run)


def _defaults(args: argparse.Namespace) -> None:
    quick = args.quick
    for name, normal, small in (
        ("batch", 32, 2),
        ("context", 384, 16),
        ("repeats", 20, 3),
        ("warmup", 3, 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else normal)
    if args.batch < 1 or args.context < 1 or args.repeats < 1 or args.warmup < 0:
        raise ValueError("--batch, --context and --repeats must be >= 1, --warmup >= 0")
    set_threads(args.torch_threads)  # before the machine peaks are measured


def build_runner(model_dir: Path, args: argparse.Namespace) -> tuple[ModelRunner, int]:
    """A runner whose KV pool holds B disjoint ranges of M blocks; returns (runner, M)."""
    model_config = read_model_config(model_dir)
    config = family_of(model_config).engine_config(engine_config(args))
    blocks_per_seq = -(-(args.context + 1) // config.block_size)
    needed = args.batch * blocks_per_seq
    config = dataclasses.replace(
        config, num_blocks=max(needed, config.num_blocks or 0), seed=args.seed
    )
    if args.context + 1 > model_config.max_position_embeddings:
        raise ValueError(
            f"--context {args.context} leaves no room for a new token in the model's "
            f"{model_config.max_position_embeddings} positions"
        )
    return ModelRunner(model_dir, model_config, config), blocks_per_seq


def make_batch(
    runner: ModelRunner,
    phase: str,
    batch: int,
    context: int,
    blocks_per_seq: int,
    gen: torch.Generator,
) -> ForwardBatch:
    """The exact batch to time; for decode also fills the cache rows the sequences attend to."""
    vocab = runner.model_config.vocab_size
    block_ids = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    new = 1 if phase == "decode" else context
    tokens = torch.randint(0, vocab, (batch, new), generator=gen).tolist()
    starts = [context if phase == "decode" else 0] * batch
    if phase == "decode":
        fill_kv_cache(runner, batch * blocks_per_seq, gen)
    window_ids = (
        window_tables(runner, batch, starts[0], starts[0] + new)
        if isinstance(runner.family, V4Family)
        else None
    )
    return ForwardBatch.build(
        tokens,
        starts,
        block_ids,
        runner.config.block_size,
        [True] * batch,
        runner.device,
        window_ids,
    )


def window_tables(runner: ModelRunner, batch: int, start: int, end: int) -> list[list[int]]:
    """A windowed family's second tables: per sequence, distinct window-pool blocks for the
    positions a step over [start, end) reads (from `start - span` on), 0 below."""
    layout, size = runner.kv_layout, runner.config.block_size
    first = max(0, start - layout.span) // size
    last = -(-end // size)
    per_seq = last - first
    if 1 + batch * per_seq > layout.num_window_blocks:
        raise ValueError(
            f"the window pool has {layout.num_window_blocks} blocks, the batch reads "
            f"{batch * per_seq}: raise --max-num-seqs or --max-num-batched-tokens"
        )
    return [[0] * first + list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]


def fill_kv_cache(runner: ModelRunner, num_blocks: int, gen: torch.Generator) -> None:
    """N(0, 1) in blocks [0, num_blocks) of every layer of every cache tensor (a V4 cache has
    several), generated on the CPU, then copied."""
    caches = runner.kv_caches
    for tensor in caches.tensors() if hasattr(caches, "tensors") else [caches]:
        values = torch.randn(tensor[:, :num_blocks].shape, generator=gen, dtype=torch.float32)
        tensor[:, :num_blocks] = values.to(device=tensor.device, dtype=tensor.dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_fn(runner: ModelRunner, batch: ForwardBatch) -> Callable[[], torch.Tensor]:
    def run_once() -> torch.Tensor:
        with torch.inference_mode():
            hidden = runner.model(batch, runner.kv_caches)
            logits = runner.model.compute_logits(hidden[batch.logits_indices])
        _sync(runner.device)
        return logits

    return run_once


def _module_labels() -> dict[type, str]:
    from pdmesh_engine.model.deepseek_v3.layers import DenseMLP, MLAttention, RMSNorm
    from pdmesh_engine.model.deepseek_v4 import attention as v4_attention
    from pdmesh_engine.model.deepseek_v4 import blocks as v4
    from pdmesh_engine.model.moe import MoE, Router

    return {
        MLAttention: "attention",
        MoE: "moe (router + experts + shared)",
        Router: "moe.router",
        DenseMLP: "dense mlp / shared experts",
        RMSNorm: "rmsnorm",
        # DeepSeek-V4 (attention is split by layer kind in `_label`)
        v4_attention.Attention: "attention",
        v4_attention.Compressor: "attention.compressors (kv and indexer keys)",
        v4_attention.Indexer: "attention.indexer (scores + top-k)",
        v4.HyperConnection: "mhc (hyper-connection weights, Sinkhorn)",
        v4.HyperHead: "mhc head",
        v4.MoE: "moe (router + experts + shared)",
        v4.Router: "moe.router",
        v4.SharedExpert: "moe.shared expert",
        v4.RMSNorm: "rmsnorm",
    }


def _label(labels: dict[type, str], module: torch.nn.Module) -> str:
    """The module's kind; a V4 attention layer's includes its layer kind (sliding, CSA, HCA)."""
    kind = getattr(module, "kind", None)
    label = labels[type(module)]
    return f"{label} ({kind.split('_')[0]})" if label == "attention" and kind else label


def _kernel_entry_points() -> list[tuple[Any, str, str]]:
    """(module, attribute, label) of the kernel functions the model calls, timed like modules
    (CUDA runs the `kernel` ones, CPU the `cpu` ones; only those called are reported)."""
    from pdmesh_engine.model import experts
    from pdmesh_engine.model.deepseek_v3 import layers

    return [
        (layers, "mla_decode_attention", "kernel mla_decode_attention"),
        (layers, "mla_decode_cpu", "cpu mla_decode_cpu"),
        (experts, "fused_moe", "kernel fused_moe"),
        (experts, "expert_rows", "cpu expert_rows"),
    ]


def module_times(model: torch.nn.Module, fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Inclusive wall ms per forward of each module kind and kernel call (CPU: ops are
    synchronous)."""
    labels = _module_labels()
    totals: dict[str, float] = {}
    starts: dict[int, float] = {}

    def add(label: str, seconds: float) -> None:
        totals[label] = totals.get(label, 0.0) + seconds

    def pre(module: torch.nn.Module, _inputs: Any) -> None:
        starts[id(module)] = time.perf_counter()

    def post(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        add(_label(labels, module), time.perf_counter() - starts.pop(id(module)))

    def timed(function: Callable, label: str) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                add(label, time.perf_counter() - start)

        return wrapper

    handles = [
        h
        for m in model.modules()
        if type(m) in labels
        for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))
    ]
    patched = [(owner, name, getattr(owner, name)) for owner, name, _ in _kernel_entry_points()]
    for (owner, name, function), (_, _, label) in zip(patched, _kernel_entry_points(), strict=True):
        setattr(owner, name, timed(function, label))
    try:
        for _ in range(repeats):
            fn()
    finally:
        for handle in handles:
            handle.remove()
        for owner, name, function in patched:
            setattr(owner, name, function)
    return {k: v * 1e3 / repeats for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def op_counts(model: torch.nn.Module, fn: Callable[[], Any]) -> dict[str, Any]:
    """aten ops dispatched by one forward: {"total", "per_layer" [num layers], "dense_layer" and
    "moe_layer" (the mean over layers of that kind, 0 when there is none)}."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pdmesh_engine.model.deepseek_v3.model import DecoderLayer
    from pdmesh_engine.model.moe import MoE

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            Counter.count += 1
            return func(*args, **(kwargs or {}))

    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    per_layer = [0] * len(layers)
    marks: dict[int, int] = {}
    index = {id(layer): i for i, layer in enumerate(layers)}

    def pre(module: torch.nn.Module, _inputs: Any) -> None:
        marks[id(module)] = Counter.count

    def post(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        per_layer[index[id(module)]] += Counter.count - marks.pop(id(module))

    handles = [
        h for m in layers for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))
    ]
    try:
        with Counter():
            fn()
    finally:
        for handle in handles:
            handle.remove()
    kinds: dict[str, list[int]] = {"dense_layer": [], "moe_layer": []}
    for layer, count in zip(layers, per_layer, strict=True):
        if count:  # MTP layers never run
            kinds["moe_layer" if isinstance(layer.mlp, MoE) else "dense_layer"].append(count)
    return {
        "total": Counter.count,
        "per_layer": [c for c in per_layer if c],
        **{k: sum(v) / len(v) if v else 0 for k, v in kinds.items()},
    }


def profile_ops(fn: Callable[[], Any], repeats: int) -> tuple[str, list[dict[str, Any]]]:
    """torch.profiler over `repeats` forwards: (key_averages table, the top ops as dicts per
    forward)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    )
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    top = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:PROFILE_ROWS]
    rows = [
        {
            "op": e.key,
            "calls_per_forward": e.count / repeats,
            "self_cpu_ms_per_forward": e.self_cpu_time_total / 1e3 / repeats,
            "self_cpu_percent": 100.0 * e.self_cpu_time_total / total,
        }
        for e in top
    ]
    return table, rows


def run(args: argparse.Namespace) -> int:
    _defaults(args)
    model_dir = resolve_model(args.model)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"bench forward: loading {model_dir}", file=sys.stderr)
    runner, blocks_per_seq = build_runner(model_dir, args)
    batch = make_batch(runner, args.phase, args.batch, args.context, blocks_per_seq, gen)
    fn = forward_fn(runner, batch)
    print(
        f"bench forward: {args.phase} batch={args.batch} context={args.context}: "
        f"{args.warmup} warmup + {args.repeats} timed forwards",
        file=sys.stderr,
    )
    times = time_calls(fn, args.repeats, args.warmup)
    result = summarize(args, runner, batch, times)
    if args.phase == "decode" and isinstance(runner.family, V3Family):  # an MLA cost model
        peaks = measure_peaks(args.quick)
        cost = DecodeCostModel.from_model(runner.model, runner.kv_layout.bytes_per_token)
        contexts = [args.context + 1] * args.batch
        result.update(
            machine=peaks.to_dict(),
            cost_model=cost.to_dict(),
            roofline=roofline(cost, [(result["median_ms"] / 1e3, contexts)], peaks),
        )
    print_summary(result)
    if args.profile:
        result["module_ms_per_forward"] = module_times(runner.model, fn, args.repeats)
        result["op_counts"] = op_counts(runner.model, fn)
        table, result["top_ops"] = profile_ops(fn, min(args.repeats, 10))
        print_profile(
            result["module_ms_per_forward"], result["median_ms"], table, result["op_counts"]
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def summarize(
    args: argparse.Namespace, runner: ModelRunner, batch: ForwardBatch, times: list[float]
) -> dict:
    median = percentile(times, 50)
    cpu_layers = getattr(runner.model, "cpu_layers", None)  # V3 only: the C layer path
    return {
        "phase": args.phase,
        "batch": args.batch,
        "context": args.context,
        "num_tokens": batch.num_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "median_ms": median * 1e3,
        "p90_ms": percentile(times, 90) * 1e3,
        "min_ms": min(times) * 1e3,
        "tokens_per_s": batch.num_tokens / median,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(runner.device),
        "threads": torch.get_num_threads(),
        # which path ran the layers: "c" (model.deepseek_v3.cpu_path, one C call) or "torch"
        "layer_path": "c"
        if cpu_layers is not None and cpu_layers.takes(batch, runner.kv_caches)
        else "torch",
        "kv_bytes_per_token": runner.kv_layout.bytes_per_token,
        **rss_snapshot(),
    }


def print_summary(r: dict) -> None:
    print(
        f"{r['phase']}  batch {r['batch']}  context {r['context']}  ({r['num_tokens']} tokens, "
        f"{r['dtype']}, "
        f"{r['device']}, {r['threads']} threads, {r['layer_path']} layer path)"
    )
    print(
        f"  median {r['median_ms']:.2f} ms   p90 {r['p90_ms']:.2f} ms   min {r['min_ms']:.2f} ms   "
        f"{r['tokens_per_s']:.1f} tokens/s"
    )
    roof = r.get("roofline")
    if roof:
        m = r["machine"]
        print(
            f"  decode model: {roof['decode_flops_per_s'] / 1e9:.2f} GFLOP/s "
            f"({100 * roof['flops_fraction_of_peak']:.2f}% of {m['matmul_flops_per_s'] / 1e9:.1f} "
            "measured), "
            f"{roof['decode_bytes_per_s'] / 1e9:.2f} GB/s "
            f"({100 * roof['bandwidth_fraction_of_peak']:.1f}% of "
            f"{m['memory_bytes_per_s'] / 1e9:.1f} measured)"
        )


def print_profile(
    modules: dict[str, float], median_ms: float, table: str, ops: dict[str, Any]
) -> None:
    print(
        f"\naten ops per forward: {ops['total']}  (per dense layer {ops['dense_layer']:.0f}, "
        f"per MoE layer {ops['moe_layer']:.0f})"
    )
    print(
        "\ninclusive time per module kind and kernel call (ms per forward, % of the median "
        "forward; "
        "nested kinds overlap):"
    )
    for label, ms in modules.items():
        print(f"  {label:<34} {ms:8.2f} ms  {100 * ms / median_ms:5.1f}%")
    print(f"\ntop {PROFILE_ROWS} ops by self CPU time (torch.profiler):")
    print(table)
