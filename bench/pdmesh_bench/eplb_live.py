"""`pdmesh bench eplb --dep N --model DIR`: live EPLB on a DEP decode instance, off / on / uniform.

One run, one DEP instance of N rank processes (`run_ranks`, gloo on loopback, the harness of
`pdmesh bench decode`), one seeded workload: each rank decodes R requests of C tokens of synthetic
KV (no prefill, greedy, ignore_eos), a steady batch of R tokens per rank per step. The model is a
DeepSeek-V3 or V4 checkpoint (e.g. `pdmesh model init DIR --preset tiny [--arch deepseek_v4]
--expert-skew 1.2`); every MoE layer is planned from its own recorded loads, V4's hash layers
included (pdmesh_eplb.controller says why that already plans them from the token frequencies).
Phases:
  off      W untimed + K timed steps on the initial placement (slot s holds expert s % E);
  on       the same requests again (aborted, re-seeded identically), W + K steps; before timed
           step k = I, 2I, ... (when no rebalance is in flight) every rank reads
           `EngineCore.expert_load_window()` (per-slot loads since the last switch, at most
           --window steps), the loads are summed over ranks (all-reduce), rank 0 plans with
           `pdmesh_eplb.planner.plan(previous=current, move_budget)` and broadcasts the plan, and
           every rank calls `stage_placement(V, plan)`; `step()` switches by itself;
  uniform  no engine run: per timed step, the same number of tokens T each pick K distinct
           experts uniformly at random, one replica at random per token (`pdmesh_eplb.simulate`),
           on a placement planned for uniform loads: the sampling-noise floor at this batch.

Per-step balancedness per MoE layer: each rank's ring row (`runner.expert_load`: tokens IT routed
to each global slot in that step) summed over ranks gives the tokens each slot received; rank
load = sum of its slots (slot s lives on rank s // (P / N)); balancedness = mean / max rank load.
A phase reports the mean over layers per step, then the mean and p10 over steps.
Steps: instance step time = max over ranks (host wall time of `engine.step()`); p50/p99 over the
K timed steps; tokens/s = output tokens of all ranks / sum of instance step times. MoE time per
rank: expert compute (`DispatchStats.compute_s`) and dispatch + combine, means per step.
A rebalance window = the steps from the first after `stage_placement` through the one that
switched (`placement_version == V` after it; the switch precedes that step's forward); steady
state = the on phase's other steps. gap_recovered = (on - off) / (uniform - off) of the mean
per-step balancedness, "on" counted from the first switch's step on ("settled"); also over all.

JSON: {"phases": {"off" | "on": {"balancedness_per_step" [K], "balancedness_per_layer" [K][L],
"balancedness_mean", "balancedness_p10", "step_ms" [K], "step_ms_p50", "step_ms_p99",
"tokens_per_s", "moe_per_rank": [{"rank", "expert_ms", "dispatch_combine_ms"}]}, "uniform":
{the balancedness fields}}, "on_settled": {the balancedness fields}, "rebalances": [{"version",
"accepted", "staged_before_step", "switched_at_step", "window_steps", "plan_ms", "moved_slots",
"num_slots", "window_balancedness_before", "window_balancedness_planned", "collective_ms",
"step_ms_during"}], "gap_recovered", "gap_recovered_all_steps", "steady_step_ms_p99",
"max_rebalance_step_ms", "rebalance_step_ratio", "outputs_identical", "final_placement_version",
"notes", "config"}; NaN is written as null.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pdmesh_bench.allreduce import percentile, run_ranks
from pdmesh_bench.decode import BLOCK_SIZE, StepProbe, cores

DEFAULTS = {
    "requests_per_rank": 8,
    "context": 64,
    "steps": 40,
    "warmup": 2,
    "window": 10,
    "interval": 10,
}


@dataclass(frozen=True)
class LiveConfig:
    dep: int
    num_redundant: int
    requests: int
    context: int
    steps: int  # K timed steps per phase
    warmup: int  # W untimed steps first, per phase
    window: int  # the engine's expert-load ring (steps)
    interval: int  # I: a rebalance before timed step I, 2I, ...
    move_budget: float
    seed: int
    dp_sync: str
    threads_per_rank: int | None

    @property
    def max_tokens(self) -> int:  # the first token, W + K decoded ones, and a margin
        return self.warmup + self.steps + 4


# ------------------------------------------------------------------------------ rank side


def build_engine(rank: int, cfg: LiveConfig, model_dir: Path, threads: int) -> Any:
    """A DEP rank's engine: room for two phases of R requests, the ring `window` steps long."""
    from pdmesh_engine.config import EngineConfig
    from pdmesh_engine.engine_core import EngineCore
    from pdmesh_engine.parallel.dep import DEPConfig, init_dep

    blocks = 2 * cfg.requests * -(-(cfg.context + cfg.max_tokens + 1) // BLOCK_SIZE) + 1
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=blocks,
        max_num_seqs=max(64, cfg.requests),
        max_num_batched_tokens=max(2048, cfg.requests),
        device="cpu",
        seed=cfg.seed + rank,
        num_threads=threads,
        enable_prefix_caching=False,
        expert_load_window=cfg.window,
    )
    dep = init_dep(
        DEPConfig(rank, cfg.dep, dp_sync=cfg.dp_sync, num_redundant_experts=cfg.num_redundant)
    )
    return EngineCore(model_dir, config, dep=dep)


def seed_requests(engine: Any, rank: int, cfg: LiveConfig, phase: str) -> list[str]:
    """R requests with C tokens of synthetic KV, handed to decode with a first token; the same
    prompts, KV values and first tokens in every phase (the generator is re-seeded).

    The KV is N(0, 1) in every tensor of every KV group (`EngineCore.kv_memory`: V3's one pool
    `kv`; V4's `full` compressed entries and `window` per-token state, each group on its own
    block ids) at the blocks the reservation holds in that group, as a prompt's hand-off from a
    prefill rank would fill them."""
    from pdmesh_engine.sampling import SamplingParams

    gen = torch.Generator().manual_seed(1000 * cfg.seed + rank)
    vocab, memory = engine.model_config.vocab_size, engine.kv_memory()
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
    ids = []
    for i in range(cfg.requests):
        prompt = torch.randint(2, vocab, (cfg.context,), generator=gen).tolist()
        request_id = f"{phase}-r{rank}-{i}"
        tables = engine.reserve(prompt, params, request_id)
        if tables is None:
            raise RuntimeError(f"rank {rank}: the KV pool has no room for request {i}")
        for group in memory:
            blocks = torch.tensor(tables[group.name], dtype=torch.int64)
            for pool in group.tensors:  # [L, N, B, D]
                values = torch.randn((pool.shape[0], len(blocks), *pool.shape[2:]), generator=gen)
                pool[:, blocks] = values.to(pool.dtype)
        first = int(torch.randint(2, vocab, (1,), generator=gen))
        if engine.kv_arrived(request_id, first) is not None:
            raise RuntimeError(f"rank {rank}: request {i} finished on its first token")
        ids.append(request_id)
    return ids


def current_placement(engine: Any) -> torch.Tensor:
    """[L, P] int64: the logical expert each slot holds now, per decoder MoE layer."""
    layers = engine.runner.model.moe_layers
    return torch.stack([m.placement.physical_to_logical.cpu() for m in layers])


def start_rebalance(engine: Any, cfg: LiveConfig, rank: int, step: int) -> dict[str, Any]:
    """Collective (all ranks, same step): sum the ranks' window loads, plan on rank 0, broadcast,
    stage version V on every rank. Returns the rebalance record (the switch is filled in later)."""
    from pdmesh_eplb.planner import plan, window_balancedness

    start = time.perf_counter()
    num_steps, _window, counts = engine.expert_load_window()
    slot_loads = torch.as_tensor(counts, dtype=torch.int64).clone()
    dist.all_reduce(slot_loads)  # [L, P] tokens per slot, all ranks
    current = current_placement(engine)
    logical = np.zeros((current.shape[0], engine.model_config.n_routed_experts))  # [L, E]
    np.add.at(logical, (np.arange(current.shape[0])[:, None], current.numpy()), slot_loads.numpy())
    new, plan_ms = torch.empty_like(current), 0.0
    if rank == 0:
        t0 = time.perf_counter()
        planned = plan(
            logical,
            cfg.dep,
            cfg.num_redundant,
            previous=current.numpy(),
            move_budget=cfg.move_budget,
        )
        new.copy_(torch.tensor(planned.physical_to_logical))
        plan_ms = (time.perf_counter() - t0) * 1e3
    dist.broadcast(new, 0)
    version = engine.placement_version + 1
    accepted = bool(engine.stage_placement(version, new.tolist()))
    return {
        "version": version,
        "accepted": accepted,
        "staged_before_step": step,
        "switched_at_step": None,
        "window_steps": int(num_steps),
        "plan_ms": plan_ms,
        "moved_slots": int((new != current).sum()),
        "num_slots": int(new.numel()),
        "window_balancedness_before": window_balancedness(logical, current.numpy(), cfg.dep),
        "window_balancedness_planned": window_balancedness(logical, new.numpy(), cfg.dep),
        "collective_ms": (time.perf_counter() - start) * 1e3,
    }


def run_phase(
    engine: Any, probe: StepProbe, rank: int, cfg: LiveConfig, phase: str
) -> dict[str, Any]:
    """W + K decode steps of freshly seeded requests; phase "on" rebalances every I steps."""
    ids = seed_requests(engine, rank, cfg, phase)
    ring = engine.runner.expert_load
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    records, rows, rebalances = [], [], []
    pending: dict[str, Any] | None = None
    for index in range(cfg.warmup + cfg.steps):
        k = index - cfg.warmup
        if phase == "on" and k > 0 and k % cfg.interval == 0 and pending is None:
            rebalances.append(start_rebalance(engine, cfg, rank, k))
            pending = rebalances[-1] if rebalances[-1]["accepted"] else None
        before, ring_step = probe.totals(), ring.step
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        after = probe.totals()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
        if pending is not None and engine.placement_version >= pending["version"]:
            pending["switched_at_step"], pending = k, None
        if k < 0:
            continue
        # this step's ring row: [L, P] tokens this rank routed to each global slot
        row = ring.counts[(ring.step - 1) % ring.window].cpu()
        is_recorded = ring.step == ring_step + 1 and int(row.sum()) > 0
        rows.append(row.tolist() if is_recorded else None)
        records.append(
            {
                "step": elapsed,
                "tokens": sum(len(o.new_token_ids) for o in outputs),
                "expert": after["expert"] - before["expert"],
                "dispatch_combine": after["dispatch_combine"] - before["dispatch_combine"],
            }
        )
    for request_id in ids:
        engine.abort(request_id)
    return {
        "records": records,
        "rows": rows,
        "rebalances": rebalances,
        "tokens": [tokens[i] for i in ids],
    }


def live_rank(rank: int, world: int, model_dir: str, cfg: LiveConfig) -> dict[str, Any]:
    """One rank (the `run_ranks` target): phase off, then phase on, on the same engine."""
    threads = cfg.threads_per_rank or max(1, cores() // world)
    torch.set_num_threads(threads)
    engine = build_engine(rank, cfg, Path(model_dir), threads)
    probe = StepProbe(engine)
    off = run_phase(engine, probe, rank, cfg, "off")
    on = run_phase(engine, probe, rank, cfg, "on")
    return {
        "threads": threads,
        "off": off,
        "on": on,
        "placement_version": int(engine.placement_version),
    }


# ------------------------------------------------------------------------------ summaries


def step_balancedness(rows_by_rank: list[list[Any]], num_ranks: int) -> np.ndarray:
    """[K, L] mean / max rank load per step and MoE layer (NaN where a rank lacks the row)."""
    steps = list(zip(*rows_by_rank, strict=True))  # K tuples of N rows [L][P]
    num_layers = len(next(row for rows in steps for row in rows if row is not None))
    out = np.full((len(steps), num_layers), np.nan)
    for k, rows in enumerate(steps):
        if any(row is None for row in rows):
            continue
        slots = np.sum(np.asarray(rows, dtype=np.float64), axis=0)  # [L, P]
        rank_load = slots.reshape(num_layers, num_ranks, -1).sum(2)  # [L, N]
        peak = rank_load.max(1)
        out[k] = np.divide(rank_load.mean(1), peak, out=np.ones(num_layers), where=peak > 0)
    return out


def uniform_balancedness(
    rows_by_rank: list[list[Any]], num_experts: int, top_k: int, cfg: LiveConfig
) -> np.ndarray:
    """[K, L] per-step balancedness of uniform routing of the same number of tokens per step."""
    from pdmesh_eplb.planner import plan
    from pdmesh_eplb.simulate import per_step_balancedness, sample_step_loads

    rng = np.random.default_rng(cfg.seed)
    steps = list(zip(*rows_by_rank, strict=True))
    num_layers = len(next(row for rows in steps for row in rows if row is not None))
    uniform = np.ones((num_layers, num_experts))
    p2l = plan(uniform, cfg.dep, cfg.num_redundant).physical_to_logical
    out = np.full((len(steps), num_layers), np.nan)
    for k, rows in enumerate(steps):
        if any(row is None for row in rows):
            continue
        num_tokens = round(sum(float(np.sum(row[0])) for row in rows) / top_k)  # layer 0 picks / K
        loads = sample_step_loads(uniform, num_tokens, top_k, rng)
        out[k] = per_step_balancedness(loads, p2l, cfg.dep, rng)
    return out


def _bal_stats(per_layer: np.ndarray) -> dict[str, Any]:
    per_step = per_layer.mean(axis=1)  # NaN for steps without rows
    valid = per_step[~np.isnan(per_step)]
    return {
        "balancedness_per_step": per_step.tolist(),
        "balancedness_per_layer": per_layer.tolist(),
        "balancedness_mean": float(valid.mean()) if valid.size else math.nan,
        "balancedness_p10": percentile(valid.tolist(), 10) if valid.size else math.nan,
    }


def _time_stats(reports: list[dict[str, Any]], phase: str) -> dict[str, Any]:
    per_rank = [r[phase]["records"] for r in reports]
    step_ms = [max(rec["step"] for rec in recs) * 1e3 for recs in zip(*per_rank, strict=True)]
    tokens = sum(rec["tokens"] for records in per_rank for rec in records)
    moe = [
        {
            "rank": rank,
            "expert_ms": 1e3 * float(np.mean([r["expert"] for r in records])),
            "dispatch_combine_ms": 1e3 * float(np.mean([r["dispatch_combine"] for r in records])),
        }
        for rank, records in enumerate(per_rank)
    ]
    return {
        "step_ms": step_ms,
        "step_ms_p50": percentile(step_ms, 50),
        "step_ms_p99": percentile(step_ms, 99),
        "tokens_per_s": tokens / (sum(step_ms) / 1e3),
        "moe_per_rank": moe,
    }


def _window(rebalance: dict[str, Any], steps: int) -> range:
    """Timed steps from the first after staging through the switch (the last step if none)."""
    if not rebalance["accepted"]:
        return range(0)
    end = rebalance["switched_at_step"]
    return range(rebalance["staged_before_step"], (steps - 1 if end is None else end) + 1)


def _gap(on: float, off: float, uniform: float) -> float:
    return (on - off) / (uniform - off) if uniform != off else math.nan


def summarize(
    reports: list[dict[str, Any]], cfg: LiveConfig, num_experts: int, top_k: int
) -> dict[str, Any]:
    """The rank reports -> the JSON result (module docstring)."""
    rows = {p: [r[p]["rows"] for r in reports] for p in ("off", "on")}
    per_layer = {p: step_balancedness(rows[p], cfg.dep) for p in rows}
    per_layer["uniform"] = uniform_balancedness(rows["on"], num_experts, top_k, cfg)
    phases = {p: _bal_stats(per_layer[p]) for p in per_layer}
    for p in rows:
        phases[p].update(_time_stats(reports, p))
    rebalances = reports[0]["on"]["rebalances"]
    switched = [r["switched_at_step"] for r in rebalances if r["switched_at_step"] is not None]
    settled = _bal_stats(per_layer["on"][switched[0] :]) if switched else None
    step_ms = phases["on"]["step_ms"]
    inside: set[int] = set()
    for r in rebalances:
        r["step_ms_during"] = [step_ms[k] for k in _window(r, cfg.steps)]
        inside.update(_window(r, cfg.steps))
    steady_p99 = percentile([t for k, t in enumerate(step_ms) if k not in inside] or step_ms, 99)
    max_during = max((step_ms[k] for k in inside), default=math.nan)
    off_mean = phases["off"]["balancedness_mean"]
    uniform_mean = phases["uniform"]["balancedness_mean"]
    return {
        "phases": phases,
        "on_settled": settled,
        "rebalances": rebalances,
        "gap_recovered": (
            _gap(settled["balancedness_mean"], off_mean, uniform_mean) if settled else None
        ),
        "gap_recovered_all_steps": _gap(phases["on"]["balancedness_mean"], off_mean, uniform_mean),
        "steady_step_ms_p99": steady_p99,
        "max_rebalance_step_ms": max_during,
        "rebalance_step_ratio": max_during / steady_p99 if inside else None,
        "outputs_identical": all(r["off"]["tokens"] == r["on"]["tokens"] for r in reports),
        "final_placement_version": [r["placement_version"] for r in reports],
    }


# ------------------------------------------------------------------------------ output


def _finite_or_none(value: Any) -> Any:
    """The result with NaN / inf floats as None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


def _fmt(value: Any, spec: str) -> str:
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    return "-" if missing else format(value, spec)


def _rebalance_line(r: dict[str, Any]) -> str:
    during = r["step_ms_during"]
    return (
        f"rebalance v{r['version']}: staged before step {r['staged_before_step']}, switched at "
        f"step {_fmt(r['switched_at_step'], 'd')}; {r['moved_slots']}/{r['num_slots']} slots "
        f"moved; plan {r['plan_ms']:.1f} ms; window balancedness "
        f"{r['window_balancedness_before']:.3f} -> {r['window_balancedness_planned']:.3f} "
        f"(planned); steps during (ms) {', '.join(f'{t:.1f}' for t in during) or '-'}"
        + ("" if r["accepted"] else "; REJECTED by stage_placement")
    )


def format_table(result: dict[str, Any]) -> str:
    phases = result["phases"]
    lines = [
        f"{'phase':<11} {'bal mean':>8} {'bal p10':>8} {'step p50':>9} {'step p99':>9} "
        f"{'tok/s':>7}  expert ms per rank (dispatch+combine)"
    ]
    named = [
        ("off", phases["off"]),
        ("on", phases["on"]),
        ("on settled", result["on_settled"]),
        ("uniform", phases["uniform"]),
    ]
    for name, p in named:
        if p is None:
            continue
        moe = "  ".join(
            f"{m['expert_ms']:.2f} ({m['dispatch_combine_ms']:.2f})"
            for m in p.get("moe_per_rank", [])
        )
        lines.append(
            f"{name:<11} {_fmt(p['balancedness_mean'], '8.4f')} "
            f"{_fmt(p['balancedness_p10'], '8.4f')} "
            f"{_fmt(p.get('step_ms_p50'), '9.2f'):>9} "
            f"{_fmt(p.get('step_ms_p99'), '9.2f'):>9} "
            f"{_fmt(p.get('tokens_per_s'), '7.1f'):>7}  {moe}"
        )
    gap, gap_all = result["gap_recovered"], result["gap_recovered_all_steps"]
    lines += [
        "",
        f"gap off->uniform recovered: {_fmt(gap, '.1%')} (on settled), "
        f"{_fmt(gap_all, '.1%')} (all on steps)",
    ]
    lines += [_rebalance_line(r) for r in result["rebalances"]]
    lines.append(
        f"steady-state step p99 {result['steady_step_ms_p99']:.2f} ms; max step during "
        f"rebalances {_fmt(result['max_rebalance_step_ms'], '.2f')} ms; ratio "
        f"{_fmt(result['rebalance_step_ratio'], '.2f')} (done when <= 1.5)"
    )
    same = "yes" if result["outputs_identical"] else "NO"
    lines.append(f"greedy outputs identical off vs on: {same}")
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Balancedness over steps (mean over MoE layers) of off, on and uniform; each rebalance as a
    shaded window (staging through switch) and a dashed line at its switch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, color, label in (
        ("off", "tab:red", "EPLB off"),
        ("on", "tab:blue", "EPLB on"),
        ("uniform", "tab:gray", "uniform routing"),
    ):
        values = result["phases"][name]["balancedness_per_step"]
        ax.plot(range(len(values)), values, color=color, label=label, linewidth=1.2)
    done = [r for r in result["rebalances"] if r["accepted"]]
    for i, r in enumerate(done):
        end = r["switched_at_step"]
        if end is not None:
            ax.axvline(
                end,
                color="tab:green",
                linestyle="--",
                linewidth=1,
                label="rebalance (switch)" if i == 0 else None,
            )
        ax.axvspan(
            r["staged_before_step"] - 0.5,
            (end if end is not None else len(values)) + 0.5,
            color="tab:green",
            alpha=0.12,
        )
    ax.set(
        xlabel="timed decode step",
        ylabel="balancedness (mean / max rank load)",
        ylim=(0, 1.02),
        title=title,
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def _notes(cfg: LiveConfig, model_dir: Path, threads: int) -> list[str]:
    return [
        f"model {model_dir.name}; DEP{cfg.dep}, {cfg.num_redundant} redundant slots; per rank "
        f"{cfg.requests} requests x {cfg.context} tokens of synthetic KV, greedy; per phase "
        f"{cfg.warmup} untimed + {cfg.steps} timed steps; CPU, gloo on loopback, {threads} "
        f"torch threads per rank on {cores()} cores",
        f"EPLB on: a rebalance before timed step {cfg.interval}, {2 * cfg.interval}, ... (none "
        f"while one is in flight), planned on the loads since the last switch (ring of "
        f"{cfg.window} steps), move budget {cfg.move_budget:.0%} of slots per layer",
        "uniform: per step the same token count, K distinct experts per token uniformly at "
        "random, one replica at random per token, on a placement planned for uniform loads "
        "(the engine picks replicas by token index, a little more evenly than at random)",
        "balancedness = mean / max rank load per MoE layer and step, averaged over layers; "
        "on settled = the on phase from its first switch on; step times: the slowest rank's",
    ]


# ------------------------------------------------------------------------------ command line


def add_live_arguments(p: argparse.ArgumentParser) -> None:
    """The live mode's own options (`--dep`, `--model`, `--steps`, `--move-budget`, `--seed` and
    `--json` are the eplb benchmark's shared ones)."""
    p.add_argument(
        "--num-redundant-experts", type=int, default=0, help="live: redundant slots per MoE layer"
    )
    p.add_argument(
        "--requests-per-rank", type=int, default=None, help="live: decoding requests per rank (8)"
    )
    p.add_argument("--context", type=int, default=None, help="live: KV tokens per request (64)")
    p.add_argument("--warmup", type=int, default=None, help="live: untimed steps per phase (2)")
    p.add_argument("--window", type=int, default=None, help="live: expert-load ring, steps (10)")
    p.add_argument("--interval", type=int, default=None, help="live: steps between rebalances (10)")
    p.add_argument("--dp-sync", default="recursive_doubling", help="live: the per-step DP sync")
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="live: torch threads per rank (default: max(1, cores // N))",
    )
    p.add_argument("--timeout-s", type=float, default=1800.0, help="live: for all ranks to report")
    p.add_argument("--plot", type=Path, default=None, help="live: the balancedness plot (PNG)")


def live_config(args: argparse.Namespace) -> LiveConfig:
    values = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in DEFAULTS.items()}
    sizes = ("requests_per_rank", "context", "steps", "window", "interval")
    if min(values[k] for k in sizes) < 1 or values["warmup"] < 0 or args.dep < 1:
        raise ValueError(
            "--dep, --requests-per-rank, --context, --steps, --window and --interval "
            "must be >= 1, --warmup >= 0"
        )
    return LiveConfig(
        args.dep,
        args.num_redundant_experts,
        values["requests_per_rank"],
        values["context"],
        values["steps"],
        values["warmup"],
        values["window"],
        values["interval"],
        args.move_budget,
        args.seed,
        args.dp_sync,
        args.threads_per_rank,
    )


def run_live(args: argparse.Namespace) -> int:
    from pdmesh_engine.model.configs import read_model_config
    from pdmesh_engine.parallel.dep import slots_of_rank

    cfg = live_config(args)
    model = read_model_config(args.model)  # DeepSeek-V3 or V4
    slots_of_rank(model.n_routed_experts, cfg.num_redundant, cfg.dep, 0)  # ValueError: P % N
    if cfg.context + cfg.max_tokens > model.max_position_embeddings:
        raise ValueError(
            f"--context {cfg.context} + {cfg.max_tokens} tokens exceed the model's "
            f"{model.max_position_embeddings} positions"
        )
    reports = run_ranks(cfg.dep, live_rank, (str(args.model), cfg), timeout_s=args.timeout_s)
    result = summarize(reports, cfg, model.n_routed_experts, model.num_experts_per_tok)
    result["notes"] = _notes(cfg, args.model, reports[0]["threads"])
    result["config"] = {
        **asdict(cfg),
        "model": args.model.name,
        "cores": cores(),
        "num_experts": model.n_routed_experts,
        "top_k": model.num_experts_per_tok,
    }
    print(format_table(result))
    for note in result["notes"]:
        print(f"# {note}")
    if args.plot is not None:
        write_plot(
            result,
            args.plot,
            f"EPLB live: {args.model.name}, DEP{cfg.dep}, {cfg.num_redundant} redundant slots",
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_finite_or_none(result), indent=2, allow_nan=False)
        args.json.write_text(text + "\n")
    return 0
