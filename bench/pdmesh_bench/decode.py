"""`pdmesh bench decode`: where a DEP instance's decode step goes, per rank, for DEP sizes n = 1, 2,
4, ...

For each n of `--dep`, n spawned rank processes (gloo on loopback, `run_ranks`) each build an engine
(DEP1: the plain `EngineCore` on its torch layer path, experts in-process through the local
dispatcher; n > 1: `init_dep` + `EngineCore(dep=...)`, the all-to-all dispatcher and the lockstep
DP sync) with
`torch.set_num_threads(max(1, cores // n))`. No prefill runs: each rank `reserve`s R requests of C
random prompt tokens, writes N(0, 1) into their KV blocks (the scale of real entries: the latent
after its RMSNorm and the rope key of a unit-RMS hidden state) and calls `kv_arrived(id,
first_token)`, the path by which a decode instance receives prefilled KV. Then every rank calls
`engine.step()` W + N times (greedy, ignore_eos, max_tokens above W + N + 1, so every step is a
decode of R tokens on every rank and the ranks stay in lockstep); the first W steps are not timed.

Per timed step i of a rank (host wall time, `perf_counter`; CPU ops are synchronous):
    step_i      = wall time of `engine.step()` (schedule -> [DP sync] -> forward -> sample ->
                  update)
    attn_i      = sum over `MLAttention` modules of (forward hook - forward pre-hook)
    expert_i    = n > 1: delta of `DispatchStats.compute_s`; DEP1: time inside the MoE layers'
                  dispatcher (a timing wrapper around the local dispatcher: the routed experts,
                  `fused_moe`)
    dc_i        = delta of `DispatchStats.dispatch_s + combine_s` (plan, all-to-alls, combine;
                  includes waiting for slower ranks); 0 for DEP1
    sync_i      = delta of `LockstepCounters.sync_s` (the DP all-reduce, includes waiting); 0 for
                  DEP1
    model_i     = the model's forward (hook on the top module; not the lm head)
Reported per rank (ms): step p50 / p90 / mean over the N steps; each component as its mean over the
N steps; cpu_sched = mean(step) - mean(attn + expert + dc + sync) (the intervals are disjoint and
inside the step, so cpu_sched >= 0 and the five parts sum to step_ms_mean), split further into
other_model = mean(model - attn - expert - dc) (embedding, norms, dense MLPs, shared experts,
router) and host = cpu_sched - other_model (scheduling, batch building, lm head, sampling, updates).
    tokens_per_s (rank)     = output tokens of the N steps / sum(step_i)   (R tokens per step)
    tokens_per_s (instance) = sum over ranks
    step_ms_p50 (instance)  = median_i(max over ranks of step_i)

JSON: {"results": [{"dep", "rank", "step_ms_p50", "step_ms_p90", "step_ms_mean", "attention_ms",
"expert_ms", "dispatch_combine_ms", "dp_sync_ms", "cpu_sched_ms", "other_model_ms", "host_ms",
"tokens_per_s", "threads"}], "instances": [{"dep", "tokens_per_s", "step_ms_p50"}], "notes": [...],
"config": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdmesh.cli.options import resolve_model
from pdmesh_bench.allreduce import percentile, run_ranks
from pdmesh_engine.config import EngineConfig, ModelConfig
from pdmesh_engine.engine_core import EngineCore
from pdmesh_engine.model.moe import ExpertDispatcher, MoE
from pdmesh_engine.parallel.allreduce import DP_SYNC_IMPLS
from pdmesh_engine.sampling import SamplingParams

COMPONENTS = ("attention", "expert", "dispatch_combine", "dp_sync")
DEFAULTS = {"requests_per_rank": 8, "context": 256, "steps": 20, "warmup": 3}
QUICK = {"requests_per_rank": 2, "context": 16, "steps": 3, "warmup": 1}
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    requests: int
    context: int
    steps: int
    warmup: int
    dp_sync: str
    seed: int
    threads_per_rank: int | None = None  # None: max(1, cores // n)

    @property
    def max_tokens(self) -> int:  # the first token, W + N decoded ones, and a margin
        return self.warmup + self.steps + 4


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class _TimedDispatcher(ExpertDispatcher):
    """Wraps a dispatcher and adds its wall time to `probe.seconds["expert"]` (DEP1's routed
    experts)."""

    def __init__(self, inner: ExpertDispatcher, probe: StepProbe) -> None:
        self.inner, self.probe = inner, probe

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slot_ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self.inner(x, weights, slot_ids, w13, w2)
        finally:
            self.probe.seconds["expert"] += time.perf_counter() - start


class StepProbe:
    """Cumulative seconds per component of one engine, from hooks and the engine's own stats
    objects."""

    def __init__(self, engine: EngineCore) -> None:
        from pdmesh_engine.model.deepseek_v3.layers import MLAttention

        self.engine = engine
        self.seconds = {"attention": 0.0, "expert": 0.0, "model": 0.0}
        self._starts: dict[int, float] = {}
        model = engine.runner.model
        for module in model.modules():
            if isinstance(module, MLAttention):
                module.register_forward_pre_hook(self._pre)
                module.register_forward_hook(self._post("attention"))
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post("model"))
        self.stats = engine.runner.dispatch_stats()
        if self.stats is None:  # in-process experts: time the dispatcher call
            for module in model.modules():
                if isinstance(module, MoE):
                    module.dispatcher = _TimedDispatcher(module.dispatcher, self)

    def _pre(self, module: torch.nn.Module, _inputs: Any) -> None:
        self._starts[id(module)] = time.perf_counter()

    def _post(self, key: str) -> Any:
        def hook(module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
            self.seconds[key] += time.perf_counter() - self._starts.pop(id(module))

        return hook

    def totals(self) -> dict[str, float]:
        stats, lockstep = self.stats, self.engine.lockstep
        expert = stats.compute_s if stats is not None else self.seconds["expert"]
        return {
            "attention": self.seconds["attention"],
            "expert": expert,
            "model": self.seconds["model"],
            "dispatch_combine": stats.dispatch_s + stats.combine_s if stats is not None else 0.0,
            "dp_sync": lockstep.counters.sync_s if lockstep is not None else 0.0,
        }


def build_engine(
    rank: int, world: int, model_dir: Path, work: Workload, threads: int
) -> EngineCore:
    """The rank's engine with room for R requests of C + max_tokens tokens (+1 scratch block for
    DEP)."""
    blocks = work.requests * -(-(work.context + work.max_tokens + 1) // BLOCK_SIZE) + 1
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        num_blocks=blocks,
        max_num_seqs=max(64, work.requests),
        max_num_batched_tokens=max(2048, work.requests),
        device="cpu",
        seed=work.seed + rank,
        num_threads=threads,
    )
    if world == 1:
        # The torch layer path, as on the DEP ranks (which have no C path): the same code is
        # compared, and its attention and experts are modules the hooks can time.
        os.environ["PDMESH_CPU_LAYERS"] = "0"
        return EngineCore(model_dir, config)
    from pdmesh_engine.parallel.dep import DEPConfig, init_dep

    return EngineCore(model_dir, config, dep=init_dep(DEPConfig(rank, world, dp_sync=work.dp_sync)))


def seed_requests(engine: EngineCore, rank: int, work: Workload) -> None:
    """R requests with C tokens of synthetic KV each, handed to decode with a first token (no
    prefill)."""
    gen = torch.Generator().manual_seed(1000 * work.seed + rank)
    vocab, caches = engine.model_config.vocab_size, engine.runner.kv_caches
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(work.requests):
        prompt = torch.randint(2, vocab, (work.context,), generator=gen).tolist()
        request_id = f"r{rank}-{i}"
        tables = engine.reserve(prompt, params, request_id)
        if tables is None:
            raise RuntimeError(f"rank {rank}: the KV pool has no room for request {i}")
        blocks = tables["kv"]
        index = torch.tensor(blocks, dtype=torch.int64)
        values = torch.randn((caches.shape[0], len(blocks), *caches.shape[2:]), generator=gen)
        caches[:, index] = values.to(caches.dtype)
        first = int(torch.randint(2, vocab, (1,), generator=gen))
        if engine.kv_arrived(request_id, first) is not None:
            raise RuntimeError(f"rank {rank}: request {i} finished on its first token")


def decode_rank(rank: int, world: int, model_dir: str, work: Workload) -> dict[str, Any]:
    """One rank (the `run_ranks` target, which owns the process group): W + N lockstep decode
    steps."""
    threads = work.threads_per_rank or max(1, cores() // world)
    torch.set_num_threads(threads)
    engine = build_engine(rank, world, Path(model_dir), work, threads)
    seed_requests(engine, rank, work)
    probe = StepProbe(engine)
    records: list[dict[str, float]] = []
    for index in range(work.warmup + work.steps):
        before = probe.totals()
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        after = probe.totals()
        if index >= work.warmup:
            record = {key: after[key] - before[key] for key in after}
            record.update(step=elapsed, tokens=float(sum(len(o.new_token_ids) for o in outputs)))
            records.append(record)
    if engine.lockstep is not None and (
        engine.lockstep.counters.dummies or engine.lockstep.counters.idle
    ):
        raise RuntimeError(f"rank {rank}: dummy or idle lockstep steps: {engine.lockstep.counters}")
    return {"threads": threads, "records": records}


@dataclass(frozen=True)
class Row:
    dep: int
    rank: int
    step_ms_p50: float
    step_ms_p90: float
    step_ms_mean: float
    attention_ms: float
    expert_ms: float
    dispatch_combine_ms: float
    dp_sync_ms: float
    cpu_sched_ms: float
    other_model_ms: float
    host_ms: float
    tokens_per_s: float
    threads: int


def summarize_rank(dep: int, rank: int, report: dict[str, Any]) -> Row:
    records = report["records"]
    steps = [r["step"] * 1e3 for r in records]

    def mean_ms(key: str) -> float:
        return sum(r[key] for r in records) * 1e3 / len(records)

    parts = {name: mean_ms(name) for name in COMPONENTS}
    step_mean, model = sum(steps) / len(steps), mean_ms("model")
    cpu_sched = step_mean - sum(parts.values())
    other_model = model - parts["attention"] - parts["expert"] - parts["dispatch_combine"]
    tokens_per_s = sum(r["tokens"] for r in records) / (sum(steps) / 1e3)
    return Row(
        dep,
        rank,
        percentile(steps, 50),
        percentile(steps, 90),
        step_mean,
        parts["attention"],
        parts["expert"],
        parts["dispatch_combine"],
        parts["dp_sync"],
        cpu_sched,
        other_model,
        cpu_sched - other_model,
        tokens_per_s,
        report["threads"],
    )


def summarize_instance(dep: int, reports: list[dict[str, Any]], rows: list[Row]) -> dict[str, Any]:
    per_step = zip(
        *[[r["step"] * 1e3 for r in report["records"]] for report in reports], strict=True
    )
    slowest = [max(times) for times in per_step]
    return {
        "dep": dep,
        "tokens_per_s": sum(r.tokens_per_s for r in rows),
        "step_ms_p50": percentile(slowest, 50),
    }


def measure(
    dep: int, model_dir: Path, work: Workload, timeout_s: float
) -> tuple[list[Row], dict[str, Any]]:
    reports = run_ranks(dep, decode_rank, (str(model_dir), work), timeout_s=timeout_s)
    rows = [summarize_rank(dep, rank, report) for rank, report in enumerate(reports)]
    return rows, summarize_instance(dep, reports, rows)


def format_table(rows: list[Row], instances: list[dict[str, Any]]) -> str:
    head = (
        f"{'dep':>3} {'rank':>4} {'thr':>3} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8} {'attn':>7} "
        f"{'expert':>7} {'disp+comb':>9} {'dp sync':>7} {'cpu/sch':>7} {'(model':>7} {'host)':>7} "
        f"{'tok/s':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.dep:>3} {r.rank:>4} {r.threads:>3} {r.step_ms_p50:>8.2f} {r.step_ms_p90:>8.2f} "
            f"{r.step_ms_mean:>8.2f} {r.attention_ms:>7.2f} {r.expert_ms:>7.2f} "
            f"{r.dispatch_combine_ms:>9.2f} {r.dp_sync_ms:>7.2f} {r.cpu_sched_ms:>7.2f} "
            f"{r.other_model_ms:>7.2f} {r.host_ms:>7.2f} {r.tokens_per_s:>8.1f}"
        )
    lines.append("")
    lines.append(f"{'dep':>3} {'instance tok/s':>14} {'step p50 ms (slowest rank per step)':>36}")
    for inst in instances:
        lines.append(f"{inst['dep']:>3} {inst['tokens_per_s']:>14.1f} {inst['step_ms_p50']:>36.2f}")
    return "\n".join(lines)


def _notes(deps: list[int], work: Workload, model_dir: Path) -> list[str]:
    n_cores = cores()
    over = [n for n in deps if n > n_cores]
    threads = (
        f"{work.threads_per_rank} (--threads-per-rank)"
        if work.threads_per_rank
        else "max(1, cores // n)"
    )
    return [
        f"host {n_cores} cores; torch threads per rank = {threads}"
        + (
            f"; DEP {over} run more rank processes than cores (oversubscribed): their step times "
            "include "
            "OS time-slicing and the ranks wait for each other in the collectives"
            if over
            else ""
        ),
        f"model {model_dir.name}; per rank {work.requests} requests with {work.context} tokens of "
        "synthetic "
        f"KV (no prefill), greedy; {work.warmup} untimed + {work.steps} timed decode steps; CPU, "
        "gloo on "
        f"loopback, dp_sync {work.dp_sync}",
        "components are per-step means; attention + expert + dispatch_combine + dp_sync + "
        "cpu_sched "
        "= step_ms_mean; cpu_sched = other_model (embedding, norms, dense MLPs, shared experts, "
        "router) "
        "+ host (scheduling, batch building, lm head, sampling, updates)",
        "DEP1 is the plain engine (local dispatcher, no DP sync); dispatch_combine and dp_sync "
        "include "
        "waiting for slower ranks",
        f"load average {os.getloadavg()[0]:.1f} at the end (shared host: expect noise)",
    ]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model directory (default: the cached 'small' preset)",
    )
    p.add_argument(
        "--dep", default=None, help="comma-separated DEP sizes (default 1,2,4; --quick: 1,2)"
    )
    p.add_argument(
        "--requests-per-rank", type=int, default=None, help="decoding requests per rank (default 8)"
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens already in each request's KV (default 256)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 20)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed decode steps first (default 3)"
    )
    p.add_argument("--dp-sync", default="recursive_doubling", choices=sorted(DP_SYNC_IMPLS))
    p.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        help="torch threads in each rank (default: max(1, cores // n))",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout-s", type=float, default=900.0, help="per DEP size, for all ranks to report"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "decode", help="DEP decode step breakdown per rank (attention, experts, dispatch, sync)"
    )
    add_arguments(p)
    p.set_defaults(run=run)


def _workload(args: argparse.Namespace) -> Workload:
    sizes = QUICK if args.quick else DEFAULTS
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in sizes.items()}
    if (
        values["requests_per_rank"] < 1
        or values["context"] < 1
        or values["steps"] < 1
        or values["warmup"] < 0
        or (args.threads_per_rank is not None and args.threads_per_rank < 1)
    ):
        raise ValueError(
            "--requests-per-rank, --context, --steps and --threads-per-rank must be >= 1, --warmup "
            ">= 0"
        )
    return Workload(
        values["requests_per_rank"],
        values["context"],
        values["steps"],
        values["warmup"],
        args.dp_sync,
        args.seed,
        args.threads_per_rank,
    )


def _check(deps: list[int], work: Workload, config: ModelConfig) -> None:
    bad = [n for n in deps if n < 1 or config.n_routed_experts % n]
    if bad:
        raise ValueError(
            f"DEP sizes {bad}: each must be >= 1 and divide the {config.n_routed_experts} experts"
        )
    if work.context + work.max_tokens > config.max_position_embeddings:
        raise ValueError(
            f"--context {work.context} + {work.max_tokens} decoded tokens exceed the model's "
            f"{config.max_position_embeddings} positions"
        )


def run(args: argparse.Namespace) -> int:
    work = _workload(args)
    deps = [int(x) for x in (args.dep or ("1,2" if args.quick else "1,2,4")).split(",")]
    model_dir = resolve_model(args.model)
    _check(deps, work, ModelConfig.from_dir(model_dir))
    rows: list[Row] = []
    instances: list[dict[str, Any]] = []
    for dep in deps:
        print(f"bench decode: DEP{dep} ...", file=sys.stderr)
        dep_rows, instance = measure(dep, model_dir, work, args.timeout_s)
        rows += dep_rows
        instances.append(instance)
    notes = _notes(deps, work, model_dir)
    print(format_table(rows, instances))
    for note in notes:
        print(f"# {note}")
    if args.json is not None:
        report = {
            "results": [asdict(r) for r in rows],
            "instances": instances,
            "notes": notes,
            "config": {"dep": deps, **asdict(work), "model": model_dir.name, "cores": cores()},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh bench decode",
        description=__doc__.split("\n\n")[0],  # the summary paragraph
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
