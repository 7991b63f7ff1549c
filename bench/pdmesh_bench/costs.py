"""`pdmesh bench costs --model DIR --out COSTS.json`: measure the cost model `pdmesh sim` replays
traces against, on this machine, with the engine options the workers use.

The model. One engine step of a rank that computes T new tokens in total, whose tokens attend
A = sum over the new tokens of the context positions each attends (a token at position p attends
p + 1: `costs_fit.attention_tokens`), takes

    step(T, A) = interp(tokens, seconds)(T) + attn_s_per_token_ctx * A_decode
                                             + prefill_attn_s_per_token_ctx * A_prefill

(piecewise-linear in T, extended linearly past the ends), for the entry of `steps` whose (dep,
threads) the rank runs with. On a mesh, with the overheads below:

    TTFT (agg, idle)     = request_s + step(prompt) + token_s
    TTFT (disagg, idle)  = request_s + step(prompt, prefill rank's threads)
                           + kv_transfer.latency_s + prompt * kv_bytes_per_token / bytes_per_s
                           + handoff_s
    ITL (idle, 1 user)   = step(1, context + 1) + token_s
    ITL (B streams)      = step(B, B (context + 1)) + token_s + B * sequence_s

What is measured (`costs_steps`, `costs_mesh`; medians throughout):
- steps: one `EngineCore.step()` (schedule + forward + sample + update, as a worker's engine loop
  runs it) per sample, for dep 1 at threads 1, cores // 2 and cores (`pdmesh up` gives each worker
  cores // worker processes threads) and --torch-threads if given; thread counts interleaved step
  by step. T <= max_num_seqs: a decode batch of T requests at a short context (24-token prompts);
  larger T: a prefill of one fresh prompt of T tokens (several equal ones where the context is
  shorter). `seconds[i]` = median step time - attn_s_per_token_ctx * its A, so that the formula
  gives back the measured step.
- attn_s_per_token_ctx: decode batches of 4 and 16 at contexts 32, 512 and 1536 (capped by the
  context); the least-squares slope of step seconds in A shared by the batch sizes, each with its
  own intercept (`costs_fit.fit_shared_slope`), clamped at >= 0.
- prefill_attn_s_per_token_ctx: a prefill check times the largest prefill point of <= 1024 tokens
  as several 128-token prompts (less A, the same T); the slope between it and the one-prompt point
  (clamped >= 0). The prefill points' `seconds` have their own A removed at this slope.
- allreduce_s: `pdmesh_bench.allreduce.measure`: the per-step DP sync of a DEP instance (int64 [8]:
  the 5 counts and the placement switch's triple, `pdmesh_engine.parallel.dep`), recursive
  doubling, p50 of back-to-back calls, per DEP size. The MoE all-to-alls are not in it.
- kv_transfer: `pdmesh_bench.kvxfer.run_bench` (NIXL push of consecutive blocks between two
  processes): least-squares line of the median push time in bytes; latency = its intercept
  (clamped >= 0), bytes_per_s = 1 / its slope. model.kv_bytes_per_token: the bytes per prompt token
  of the groups a hand-off moves whole (`costs_steps.handoff_bytes`); a windowed model's fixed part
  (V4's window blocks) is in the notes only.
- overheads (a real mesh: agg = 1 decode, then disagg = 1 prefill + 1 decode; `--no-mesh` leaves
  them 0 with a note): short prompts sent one at a time to the idle mesh; token_s, per thread
  count of the decode rank (agg: every core; disagg: its share) = median ITL - step(1, the median
  context + 1) at those threads; request_s = median agg TTFT - step(prompt) - the agg token_s (the
  decode rank's loop pays token_s on its prefill step too); sequence_s, per thread count = (median
  ITL of the later halves of 8 streams sent at once - step(8, ...) - token_s) / 8; handoff_s =
  median disagg TTFT - request_s - step(prompt at the disagg workers' threads) - the transfer time
  of its bytes; each clamped >= 0.
- moe: share = the MoE modules' inclusive time / the hooked step's wall time
  (`pdmesh_bench.forward.module_times` around decode steps at a full batch, mean over the thread
  counts); balancedness: per step of that batch, mean / max rank load over the MoE layers with the
  experts split over the smallest DEP size measured: `none` the initial placement, `eplb` a plan
  (`pdmesh_eplb.planner.plan`, no redundant slots) fitted on those same steps (in-sample).

A shared host's other work is checked around every measurement (`costs_host.HostGuard`: done
again after a quiet moment, at most 4 tries, 300 s of waiting in all; `--quick` only counts);
what was kept contended is in notes["host"]. Known limit of the model: one attention slope serves
decode and prefill tokens, and it is fitted on decode steps; where a prefill's attention costs more
per (token x context) (DeepSeek-V4 here), a one-prompt T point carries its own prompt's cost and
several shorter prompts in one step come out cheaper than the model says (notes["prefill_check"]
gives both, and the prefill slope).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdmesh.cli.options import resolve_model
from pdmesh_bench import costs_parts as parts
from pdmesh_bench.costs_fit import StepModel
from pdmesh_bench.costs_host import HostGuard
from pdmesh_service.worker.engine_options import add_engine_options

VERSION = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("costs", help="measure the cost model `pdmesh sim` replays traces against")
    p.add_argument("--out", type=Path, default=Path("costs.json"), help="the JSON written")
    p.add_argument("--quick", action="store_true", help="few points and repeats (a smoke run)")
    p.add_argument("--no-mesh", action="store_true", help="skip the mesh overheads (left 0)")
    p.add_argument(
        "--tokens", default=None, help="comma-separated step sizes T (default: 1, 2, 4 .. budget)"
    )
    p.add_argument(
        "--dep-sizes", default=None, help="DP-sync sizes timed (default 2,4; --quick: 2)"
    )
    p.add_argument(
        "--kv-sizes",
        default=None,
        help="NIXL push sizes (default 64K,256K,1M,4M,16M; quick 64K,1M)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 2; quick 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15; quick 3)")
    p.add_argument(
        "--mesh-requests", type=int, default=12, help="requests per mesh, the first 2 untimed"
    )
    p.add_argument("--mesh-timeout-s", type=float, default=300.0, help="mesh start and requests")
    p.add_argument("--log-dir", type=Path, default=None, help="mesh logs (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0)
    add_engine_options(p)
    p.set_defaults(run=run)


def say(line: str) -> None:
    print(f"bench costs: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    plan = parts.Plan.from_args(args)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    model_dir = resolve_model(args.model)
    say(f"model {model_dir}; threads {plan.threads}; quick {args.quick}")
    guard = HostGuard(say, *plan.host_guard)
    engine_part = parts.measure_engine(args, model_dir, plan, guard)
    gc.collect()  # the engine's memory goes before the other processes start
    kv = parts.measure_kv_transfer(plan, guard)
    allreduce = parts.measure_allreduce(plan, guard)
    model = StepModel(plan.tokens, engine_part.steps, engine_part.attn)
    if args.no_mesh:
        overheads = dict(parts.DEFAULT_OVERHEADS)
        mesh_notes = {"overheads": "not measured (--no-mesh)"}
    else:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-costs-"))
        say(f"mesh logs in {log_dir}")
        from pdmesh_bench.costs_mesh import measure_overheads

        transfer = (kv.latency_s, kv.bytes_per_s, engine_part.kv_bytes_per_token)
        overheads, mesh_notes = measure_overheads(
            args, model_dir, log_dir, model, transfer, plan.mesh, guard
        )
    report = assemble(engine_part, kv, allreduce, overheads, mesh_notes, plan)
    report["notes"]["host"] = guard.note()
    report["notes"]["run"] = (
        f"{time.perf_counter() - started:.0f} s on {os.cpu_count()} cores; load average "
        f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (a shared host's "
        "other work inflates the medians, the 2-thread ones most)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    say(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    return 0


def assemble(
    engine: parts.EnginePart,
    kv: parts.KVTransfer,
    allreduce: dict[str, float],
    overheads: dict[str, float],
    mesh_notes: dict[str, str],
    plan: parts.Plan,
) -> dict[str, Any]:
    """The version-1 JSON."""
    return {
        "version": VERSION,
        "source": "measured by pdmesh bench costs",
        "notes": {
            **engine.notes,
            **kv.notes,
            **parts.allreduce_notes(plan, allreduce),
            **mesh_notes,
        },
        "model": engine.model,
        "engine": engine.engine,
        "hardware": {
            "kind": engine.device_kind,
            "cores": os.cpu_count() or 1,
            "corun_slowdown": engine.corun_slowdown,
        },
        "steps": [
            {
                "dep": 1,
                "threads": threads,
                "tokens": list(plan.tokens),
                "seconds": engine.steps[threads],
                "attn_s_per_token_ctx": engine.attn[threads],
                "prefill_attn_s_per_token_ctx": engine.prefill_attn[threads],
            }
            for threads in plan.threads
        ],
        "allreduce_s": allreduce,
        "kv_transfer": {"latency_s": kv.latency_s, "bytes_per_s": kv.bytes_per_s},
        "overheads": overheads,
        "moe": engine.moe,
    }


def print_table(report: dict[str, Any]) -> None:
    steps = report["steps"]
    m = report["model"]
    print(
        f"pdmesh bench costs: {m['name']} (block {m['block_size']}, "
        f"{m['kv_bytes_per_token']:g} KV bytes/token, {m['num_kv_blocks']} blocks, context "
        f"{m['max_model_len']}), {report['hardware']['cores']} {report['hardware']['kind']} cores"
    )
    print("  step seconds at short context (ms), dep 1:")
    print("  " + f"{'T':>6}" + "".join(f"{s['threads']:>8} thr" for s in steps))
    for i, tokens in enumerate(steps[0]["tokens"]):
        print("  " + f"{tokens:>6}" + "".join(f"{s['seconds'][i] * 1e3:>12.2f}" for s in steps))
    print(
        "  attn s/token-ctx: "
        + ", ".join(f"{s['threads']} thr {s['attn_s_per_token_ctx']:.3g}" for s in steps)
    )
    allreduce = ", ".join(f"{p} ranks {s * 1e6:.0f} us" for p, s in report["allreduce_s"].items())
    print(f"  DP sync: {allreduce or 'not measured'}")
    kv = report["kv_transfer"]
    print(
        f"  KV transfer: {kv['latency_s'] * 1e6:.0f} us + bytes / "
        f"{kv['bytes_per_s'] / 1e9:.2f} GB/s"
    )
    o = report["overheads"]
    print(
        f"  overheads: request {o['request_s'] * 1e3:.2f} ms, hand-off {o['handoff_s'] * 1e3:.2f} "
        "ms, token "
        + ", ".join(f"{v * 1e3:.2f} ms at {t} thr" for t, v in o["token_s"].items())
        + ", per sequence "
        + ", ".join(f"{v * 1e3:.2f} ms at {t} thr" for t, v in o["sequence_s"].items())
    )
    moe = report["moe"]
    print(
        f"  MoE: share {moe['share']:.2f}, balancedness eplb {moe['balancedness']['eplb']:.3f}, "
        f"none {moe['balancedness']['none']:.3f}"
    )
