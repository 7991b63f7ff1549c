"""The measurements of `pdmesh bench costs` that run in this process or its children (the model and
what each figure means: `pdmesh_bench.costs`): `Plan` (what to measure, from the options),
`measure_engine` (steps, attention slope, prefill check, MoE), `measure_kv_transfer` (NIXL),
`measure_allreduce` (the DP sync).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from pdmesh_bench.costs_fit import StepModel, fit_line, fit_shared_slope
from pdmesh_bench.costs_host import HostGuard
from pdmesh_bench.costs_steps import StepBench, handoff_bytes, median_time

SHORT_CONTEXT = 24  # prompt tokens of the decode batches of `steps`
CHECK_PROMPTS = 8  # the prefill check's prompts
DP_SYNC_ELEMENTS = 11  # int64 [5 counts + 2 placement triples] (pdmesh_engine.parallel.dep)
DEFAULT_OVERHEADS = {  # "0": any thread count
    "request_s": 0.0,
    "handoff_s": 0.0,
    "token_s": {"0": 0.0},
    "sequence_s": {"0": 0.0},
}
MIN_FRACTION = 0.1  # a step's context-free part is kept at least this share of its median


def context_free(seconds: float, attn_s_per_token_ctx: float, attn_tokens: float) -> float:
    """A measured step's time less its attention's, kept >= MIN_FRACTION of it (the simulator
    needs every point > 0)."""
    return max(seconds - attn_s_per_token_ctx * attn_tokens, MIN_FRACTION * seconds)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise ValueError(f"{what} must be integers >= 1, got {text!r}")
    return sorted(set(values))


def default_tokens(max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, ... up to the step budget, and the budget itself."""
    points = [1 << i for i in range(max_num_batched_tokens.bit_length())]
    return sorted({*points, max_num_batched_tokens})


@dataclass(frozen=True)
class Plan:
    threads: list[int]
    tokens: list[int]
    max_num_seqs: int
    warmup: int
    repeats: int  # decode steps, per thread count
    prefill_repeats: int
    moe_repeats: int
    attn_batches: list[int]
    attn_contexts: list[int]
    dep_sizes: list[int]
    kv_sizes: list[int]
    kv_rounds: tuple[int, int]  # (warmup, repeats) of each NIXL size
    allreduce_rounds: tuple[int, int]
    host_guard: tuple[int, float]  # (tries, max wait s) of `costs_host.HostGuard`
    mesh: dict[str, int] = field(default_factory=dict)
    quick: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        from pdmesh_bench.kvxfer import parse_size

        quick, cores = args.quick, os.cpu_count() or 1
        budget = args.max_num_batched_tokens
        tokens = _ints(args.tokens, "--tokens") if args.tokens else default_tokens(budget)
        if quick and not args.tokens:
            tokens = [t for t in (1, 4, 16, 128) if t <= budget]
        if max(tokens) > budget:
            raise ValueError(f"--tokens {max(tokens)} exceeds the step budget {budget}")
        warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
        repeats = args.repeats or (3 if quick else 15)
        if warmup < 0 or repeats < 1 or args.mesh_requests < 3:
            raise ValueError("--warmup must be >= 0, --repeats >= 1, --mesh-requests >= 3")
        threads = {1, cores, max(1, cores // 2)} | (
            {args.torch_threads} if args.torch_threads else set()
        )
        return cls(
            threads=sorted(threads),
            tokens=tokens,
            max_num_seqs=args.max_num_seqs,
            warmup=warmup,
            repeats=repeats,
            prefill_repeats=max(2, (repeats + 1) // 2),
            moe_repeats=2 if quick else 8,
            attn_batches=[2] if quick else [4, 16],
            attn_contexts=[16, 96] if quick else [32, 512, 1536],
            dep_sizes=_ints(args.dep_sizes or ("2" if quick else "2,4"), "--dep-sizes"),
            kv_sizes=[
                parse_size(s)
                for s in (args.kv_sizes or ("64K,1M" if quick else "64K,256K,1M,4M,16M")).split(",")
            ],
            kv_rounds=(1, 3) if quick else (3, 10),
            allreduce_rounds=(5, 20) if quick else (10, 100),
            host_guard=(1, 0.0) if quick else (4, 60.0),
            mesh={"requests": args.mesh_requests, "warmup": 2, "prompt": 32, "max_tokens": 24},
            quick=quick,
        )


# ----- the engine -----------------------------------------------------------------------------


@dataclass
class EnginePart:
    steps: dict[int, list[float]]  # threads -> seconds per token point (attention removed)
    attn: dict[int, float]  # threads -> a decode token's seconds per position it attends
    prefill_attn: dict[int, float]  # the same for prefill tokens (V4: its indexer grows with T)
    corun_slowdown: float  # a 1-thread step beside another busy 1-thread rank (costs_corun)
    model: dict[str, Any]
    engine: dict[str, int]
    device_kind: str
    moe: dict[str, Any]
    kv_bytes_per_token: float
    notes: dict[str, str]


def measure_engine(
    args: argparse.Namespace, model_dir: Path, plan: Plan, guard: HostGuard
) -> EnginePart:
    from pdmesh_engine.engine_core import EngineCore
    from pdmesh_service.worker.engine_options import engine_config

    engine = EngineCore(model_dir, engine_config(args))
    bench = StepBench(engine, plan.threads, args.seed)
    notes: dict[str, str] = {}
    raw = measure_steps(bench, plan, guard)
    attn, notes["attn_s_per_token_ctx"] = measure_attn(bench, plan, guard)
    steps = {th: [context_free(s, attn[th], a) for s, a in raw[th]] for th in plan.threads}
    floored = sum(
        s == MIN_FRACTION * r
        for th in plan.threads
        for s, (r, _) in zip(steps[th], raw[th], strict=True)
    )
    notes["steps"] = (
        f"median whole EngineCore.step() of {plan.repeats} (decode, T <= {plan.max_num_seqs}: T "
        f"requests of {SHORT_CONTEXT}-token prompts) or {plan.prefill_repeats} (prefill: fresh "
        f"prompts of T tokens in all) after {plan.warmup} warm-up rounds, thread counts "
        "interleaved step by step; seconds = median - attn_s_per_token_ctx * A, at least "
        f"{MIN_FRACTION:g} of the median ({floored} points held there). Raw medians (ms): "
        + "; ".join(
            f"{th} thr " + ", ".join(f"{s * 1e3:.2f}" for s, _ in raw[th]) for th in plan.threads
        )
    )
    model = StepModel(plan.tokens, steps, attn)
    prefill_attn, notes["prefill_check"] = prefill_check(bench, plan, model, raw, guard)
    for th in plan.threads:  # prefill points: their own prompt's attention at the prefill slope
        for i, tokens in enumerate(plan.tokens):
            if tokens > plan.max_num_seqs:
                steps[th][i] = context_free(raw[th][i][0], prefill_attn[th], raw[th][i][1])
    moe, notes["moe"] = measure_moe(bench, plan, guard)
    corun, notes["corun_slowdown"] = 1.0, "not measured (--quick, or 1 thread not timed)"
    if not plan.quick and 1 in plan.threads and engine.runner.device.type == "cpu":
        from pdmesh_bench.costs_corun import measure_corun

        corun, notes["corun_slowdown"] = measure_corun(
            bench, model_dir, 8, plan.warmup, plan.repeats
        )
        guard.say(f"co-run: {notes['corun_slowdown']}")
    per_token, fixed = handoff_bytes(engine)
    notes["kv_bytes_per_token"] = (
        f"bytes per prompt token of the KV groups a hand-off moves whole; fixed part per hand-off "
        f"(window groups, not in the figure): {fixed:.0f} bytes"
    )
    layout = engine.runner.kv_layout
    return EnginePart(
        steps,
        attn,
        prefill_attn,
        corun,
        {
            "name": model_dir.name,
            "block_size": layout.block_size,
            "kv_bytes_per_token": round(per_token),
            "max_model_len": engine.max_model_len,
            "num_kv_blocks": engine.kv_stats().num_blocks,
        },
        {
            "max_num_seqs": engine.config.max_num_seqs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        },
        engine.runner.device.type,
        moe,
        per_token,
        notes,
    )


def measure_steps(
    bench: StepBench, plan: Plan, guard: HostGuard
) -> dict[int, list[tuple[float, float]]]:
    """threads -> [(median seconds, median A)] per token point."""
    out: dict[int, list[tuple[float, float]]] = {th: [] for th in plan.threads}
    for tokens in plan.tokens:
        if tokens <= plan.max_num_seqs:
            measure = partial(bench.decode, tokens, SHORT_CONTEXT, plan.warmup, plan.repeats)
        else:
            measure = partial(bench.prefill, tokens, plan.warmup, plan.prefill_repeats)
        times = guard.guarded(f"step T={tokens}", measure)
        for th in plan.threads:
            seconds, _, attn = median_time(times, th)
            out[th].append((seconds, attn))
        guard.say(
            f"step T={tokens}: "
            + ", ".join(f"{th} thr {out[th][-1][0] * 1e3:.2f} ms" for th in plan.threads)
        )
    return out


def measure_attn(bench: StepBench, plan: Plan, guard: HostGuard) -> tuple[dict[int, float], str]:
    """Per thread count, the slope of decode step seconds in A shared by the batch sizes."""
    room = bench.engine.max_model_len - (plan.warmup + plan.repeats) * len(plan.threads) - 64
    contexts = sorted({min(c, room) for c in plan.attn_contexts if min(c, room) >= 1})
    batches = sorted({min(b, plan.max_num_seqs) for b in plan.attn_batches})
    if len(contexts) < 2:
        raise ValueError(
            f"the context ({bench.engine.max_model_len}) leaves no two decode contexts"
        )
    groups: dict[int, dict[int, list[tuple[float, float]]]] = {th: {} for th in plan.threads}
    for batch in batches:
        for context in contexts:
            times = guard.guarded(
                f"attention batch {batch} context {context}",
                partial(bench.decode, batch, context, plan.warmup, plan.repeats),
            )
            for th in plan.threads:
                seconds, _, attn = median_time(times, th)
                groups[th].setdefault(batch, []).append((attn, seconds))
            guard.say(f"attention: batch {batch} context {context} done")
    slopes = {th: max(0.0, fit_shared_slope(groups[th])) for th in plan.threads}
    points = "; ".join(
        f"{th} thr batch {b}: " + ", ".join(f"A {a:.0f} {s * 1e3:.2f} ms" for a, s in pts)
        for th in plan.threads
        for b, pts in groups[th].items()
    )
    note = (
        f"decode batches {batches} at contexts {contexts}, median of {plan.repeats} steps each; "
        f"least-squares slope in A shared by the batch sizes (own intercepts), clamped >= 0. "
        f"Points: {points}"
    )
    return slopes, note


def prefill_check(
    bench: StepBench,
    plan: Plan,
    model: StepModel,
    raw: dict[int, list[tuple[float, float]]],
    guard: HostGuard,
) -> tuple[dict[int, float], str]:
    """T tokens of prefill as CHECK_PROMPTS equal prompts, measured against the model; and the
    slope in A between them and the point's own (one-prompt) step: a prefill token's attention
    cost per position (threads -> slope, clamped >= 0; the decode slope where it cannot be
    measured), with the note."""
    slopes = dict(model.attn)
    points = [t for t in plan.tokens if plan.max_num_seqs < t <= 1024 and t >= CHECK_PROMPTS]
    if not points:
        return slopes, "not run: no prefill point of at most 1024 tokens (decode slope kept)"
    point = max(points)
    length = point // CHECK_PROMPTS
    lengths = [length] * CHECK_PROMPTS
    times = guard.guarded(
        "prefill check", partial(bench.prefill, 0, plan.warmup, plan.prefill_repeats, lengths)
    )
    lines = []
    for th in plan.threads:
        seconds, tokens, attn = median_time(times, th)
        predicted = model.step_s(th, tokens, attn)
        line = (
            f"{th} thr measured {seconds * 1e3:.2f} ms, model {predicted * 1e3:.2f} ms "
            f"(x{seconds / predicted:.2f})"
        )
        single_s, single_attn = raw[th][plan.tokens.index(point)]
        if tokens == point and single_attn > attn:
            slopes[th] = max(0.0, (single_s - seconds) / (single_attn - attn))
            line += f", prefill slope vs the {point}-token step {slopes[th]:.3g} s/token-ctx"
        lines.append(line)
    guard.say("prefill check: " + "; ".join(lines))
    return slopes, (
        f"{CHECK_PROMPTS} prompts of {length} tokens in one step (the model: the {point}-token "
        "point, one prompt, with its A less these prompts' A times the decode-fitted slope): "
        + "; ".join(lines)
        + "; the prefill slope (clamped >= 0) is the curve's prefill_attn_s_per_token_ctx and "
        "its prefill points' seconds have their own A removed at it"
    )


def measure_moe(bench: StepBench, plan: Plan, guard: HostGuard) -> tuple[dict[str, Any], str]:
    from pdmesh_bench.costs_moe import balancedness_of, moe_fallback

    batch = max([t for t in plan.tokens if t <= plan.max_num_seqs] or [1])
    shares = guard.guarded(
        "MoE share", partial(bench.moe_share, batch, SHORT_CONTEXT, plan.moe_repeats)
    )
    rows = bench.expert_rows(plan.moe_repeats * len(plan.threads))
    measured = [s for s in shares.values() if s is not None]
    if measured:
        share = sum(measured) / len(measured)
        how = f"module hooks, decode batch {batch}: " + ", ".join(
            f"{th} thr {s:.3f}" for th, s in shares.items() if s is not None
        )
    else:
        share, how = moe_fallback(bench.engine, batch)
    ranks = min(plan.dep_sizes)
    balance, balance_note = balancedness_of(rows, ranks)
    guard.say(f"MoE share {share:.3f}; balancedness {balance}")
    return {"share": share, "balancedness": balance}, f"share: {how}. balancedness: {balance_note}"


# ----- other processes ------------------------------------------------------------------------


@dataclass(frozen=True)
class KVTransfer:
    latency_s: float
    bytes_per_s: float
    notes: dict[str, str]


def measure_kv_transfer(plan: Plan, guard: HostGuard) -> KVTransfer:
    from pdmesh_bench.kvxfer import run_bench

    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # both agents on loopback, as kvxfer's run
    warmup, repeats = plan.kv_rounds
    guard.say(f"NIXL push of {len(plan.kv_sizes)} sizes")
    rows, kvxfer_notes = guard.guarded(
        "NIXL push", partial(run_bench, plan.kv_sizes, repeats, warmup)
    )
    sizes = [float(r.bytes) for r in rows]
    seconds = [r.nixl_us / 1e6 for r in rows]
    intercept, slope = fit_line(sizes, seconds) if len(rows) > 1 else (0.0, seconds[0] / sizes[0])
    bytes_per_s = (
        1.0 / slope if slope > 0 else max(b / s for b, s in zip(sizes, seconds, strict=True))
    )
    points = ", ".join(
        f"{int(b) >> 10} KiB {s * 1e6:.0f} us" for b, s in zip(sizes, seconds, strict=True)
    )
    note = (
        f"kvxfer: median of {repeats} NIXL pushes per size after {warmup} ({points}); "
        f"least-squares line of time in bytes, intercept {intercept * 1e6:.1f} us clamped >= 0. "
        + "; ".join(kvxfer_notes)
    )
    guard.say(
        f"KV transfer: {max(0.0, intercept) * 1e6:.0f} us + bytes at {bytes_per_s / 1e9:.2f} GB/s"
    )
    return KVTransfer(max(0.0, intercept), bytes_per_s, {"kv_transfer": note})


def measure_allreduce(plan: Plan, guard: HostGuard) -> dict[str, float]:
    """DEP size -> p50 seconds of the recursive-doubling DP sync; a size that fails is left out
    (its error is printed)."""
    from pdmesh_bench.allreduce import measure

    warmup, repeats = plan.allreduce_rounds
    out: dict[str, float] = {}
    for ranks in plan.dep_sizes:
        try:
            row = guard.guarded(
                f"DP sync on {ranks} ranks",
                partial(measure, ranks, DP_SYNC_ELEMENTS, repeats, warmup),
            )
        except RuntimeError as e:
            guard.say(f"DP sync on {ranks} ranks failed, left out: {str(e).splitlines()[0][:200]}")
            continue
        out[str(ranks)] = row.ours_us_p50 / 1e6
        guard.say(f"DP sync on {ranks} ranks: {row.ours_us_p50:.0f} us (p50)")
    return out


def allreduce_notes(plan: Plan, measured: dict[str, float]) -> dict[str, str]:
    cores = os.cpu_count() or 1
    warmup, repeats = plan.allreduce_rounds
    text = (
        f"allreduce bench: recursive doubling, int64 [{DP_SYNC_ELEMENTS}] (the per-step DP sync), "
        f"p50 of {repeats} back-to-back calls after {warmup}, gloo on loopback, 1 thread per rank; "
        "the MoE all-to-alls of a DEP step are not included"
    )
    over = [p for p in plan.dep_sizes if p > cores]
    if over:
        text += f"; sizes {over} run more ranks than the {cores} cores (OS scheduling dominates)"
    missing = [p for p in plan.dep_sizes if str(p) not in measured]
    if missing:
        text += f"; failed, left out: {missing}"
    return {"allreduce_s": text}
