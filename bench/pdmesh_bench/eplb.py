"""`pdmesh bench eplb --loads FILES`: our expert-placement planner vs a from-scratch baseline.

Offline: each loads file (JSON {"logical_count": [[tokens] * E] * L}, one window of per-expert
loads) goes through `pdmesh_eplb.simulate.evaluate` → a side-by-side table per file, ours vs the
baseline (DeepSeek-style greedy EPLB, re-planned from scratch every time):
  * window balancedness: mean rank load / max rank load of a fresh plan on the file's window;
  * moved per rebalance: the fraction of slots whose expert changes, per rebalance along a drift
    chain (every expert's load times an independent factor in [1 - noise, 1 + noise] per window, a
    random walk); ours re-plans from its previous plan under `--move-budget`, the baseline from
    scratch;
  * next-window balancedness: each rebalanced plan scored on the window after the one it was fitted
    to;
  * co-located replicas: replicas sharing a rank with another replica of the same expert;
  * plan ms: ours from scratch / ours rebalancing (median), the baseline's one plan;
  * per-step balancedness (with `--step-samples` > 0): sampled steps of `--tokens` tokens.

The live mode (`--dep N --model DIR`: a DEP decode instance with EPLB off, on, and the
uniform-routing reference, plus a PNG plot) is `pdmesh_bench.eplb_live`; it takes no `--loads`.

JSON: {"results": [{"loads", "planner" ("ours" | "baseline"), "window_balancedness",
"moved_fraction_per_rebalance", "next_window_balancedness", "colocated_replicas", "plan_ms",
"step_balancedness"}], "simulation": `evaluate`'s full report, "notes": [...], "config": {...}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, NoReturn

from pdmesh_bench.eplb_live import add_live_arguments, run_live

PLANNERS = ("ours", "baseline")
OFFLINE_STEPS = 5  # --steps of the offline mode: rebalances along each drift chain


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--loads",
        type=Path,
        nargs="+",
        default=None,
        help='offline: expert-load files, JSON {"logical_count": [[tokens] * E] * L}',
    )
    p.add_argument("--ranks", type=int, default=32, help="expert-parallel ranks R")
    p.add_argument("--redundant", type=int, default=32, help="redundant slots S per layer")
    p.add_argument("--nodes", type=int, default=1, help="nodes N (R / N ranks each)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"offline: rebalances along each drift chain ({OFFLINE_STEPS}); "
        "live: timed decode steps per phase (40)",
    )
    p.add_argument("--noise", type=float, default=0.2, help="drift per window, +- fraction")
    p.add_argument(
        "--move-budget",
        type=float,
        default=0.2,
        help="our max fraction of slots moved per layer and rebalance",
    )
    p.add_argument("--top-k", type=int, default=8, help="experts per token in sampled steps")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per sampled step")
    p.add_argument("--step-samples", type=int, default=4, help="sampled steps per plan (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--dep", type=int, default=None, help="live: DEP ranks of the decode instance")
    p.add_argument(
        "--model", type=Path, default=None, help="live: model directory (a skewed checkpoint)"
    )
    add_live_arguments(p)


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("eplb", help="expert placement: our planner vs a from-scratch baseline")
    add_arguments(p)
    p.set_defaults(run=run)


def rows_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per planner from one `evaluate` result (see the module docstring for the fields)."""
    rounds = result["drift"]["rounds"]  # >= 1: run() requires --steps >= 1
    step = result["per_step"] or {}
    plan_ms = {
        "ours": {
            "scratch": result["plan_ms"]["ours_scratch"],
            "rebalance_median": statistics.median(result["drift"]["plan_ms_previous"]),
        },
        "baseline": {"scratch": result["plan_ms"]["baseline"]},
    }
    return [
        {
            "loads": result["name"],
            "planner": name,
            "window_balancedness": result["window"][name],
            "moved_fraction_per_rebalance": statistics.fmean(r[f"moved_{name}"] for r in rounds),
            "next_window_balancedness": statistics.fmean(r[f"following_{name}"] for r in rounds),
            "colocated_replicas": result["colocated"][name],
            "plan_ms": plan_ms[name],
            "step_balancedness": step.get(name),
        }
        for name in PLANNERS
    ]  # None: no sampled steps


def format_table(rows: list[dict[str, Any]], noise: float) -> str:
    """Side by side per loads file: one line per measure, one column per planner."""
    lines: list[str] = []
    for i in range(0, len(rows), len(PLANNERS)):
        ours, base = rows[i : i + len(PLANNERS)]
        lines += [f"{ours['loads']}", f"  {'':<36} {'ours':>16} {'from scratch':>16}"]
        cells = [
            ("window balancedness", "{:.4f}", "window_balancedness"),
            (
                f"moved per rebalance (+-{noise:.0%} drift)",
                "{:.1%}",
                "moved_fraction_per_rebalance",
            ),
            ("next-window balancedness", "{:.4f}", "next_window_balancedness"),
            ("co-located replicas", "{}", "colocated_replicas"),
            ("per-step balancedness (sampled)", "{:.4f}", "step_balancedness"),
        ]
        for label, fmt, key in cells:
            a, b = ("-" if r[key] is None else fmt.format(r[key]) for r in (ours, base))
            lines.append(f"  {label:<36} {a:>16} {b:>16}")
        ours_ms = f"{ours['plan_ms']['scratch']:.1f} / {ours['plan_ms']['rebalance_median']:.1f}"
        base_ms = f"{base['plan_ms']['scratch']:.1f}"
        lines.append(f"  {'plan ms (scratch / rebalance)':<36} {ours_ms:>16} {base_ms:>16}")
    return "\n".join(lines)


def _notes(args: argparse.Namespace) -> list[str]:
    return [
        "window: a fresh plan on the file's window; moved and next-window: mean over the "
        f"drift chain's {args.steps} rebalances (ours from its previous plan, at most "
        f"{args.move_budget:.0%} of slots per layer; the baseline from scratch)",
        "balancedness = mean rank load / max rank load, averaged over MoE layers (1 = even)",
        "baseline: greedy EPLB in the style of DeepSeek's public one (may co-locate replicas)",
    ]


def _usage_error(message: str) -> NoReturn:
    """A bad combination of modes: exit 2 with the message, as argparse does for a bad option."""
    print(f"pdmesh bench eplb: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run(args: argparse.Namespace) -> int:
    """`--dep`/`--model`: the live mode; otherwise offline on `--loads`."""
    from pdmesh_eplb.simulate import evaluate

    if args.dep is not None or args.model is not None:
        if args.loads is not None or args.dep is None or args.model is None:
            _usage_error("the live mode takes --dep N and --model DIR, and no --loads")
        return run_live(args)
    if args.loads is None:
        _usage_error("give --loads FILES (offline) or --dep N --model DIR (the live mode)")
    steps = OFFLINE_STEPS if args.steps is None else args.steps
    args = argparse.Namespace(**{**vars(args), "steps": steps})
    if args.steps < 1 or args.step_samples < 0:
        raise ValueError("--steps must be >= 1 and --step-samples >= 0")
    report = evaluate(
        [str(p) for p in args.loads],
        args.ranks,
        args.redundant,
        num_nodes=args.nodes,
        steps=args.steps,
        noise=args.noise,
        move_budget=args.move_budget,
        tokens_per_step=args.tokens,
        top_k=args.top_k,
        num_step_samples=args.step_samples,
        seed=args.seed,
    )
    rows = [row for result in report["results"] for row in rows_of(result)]
    notes = _notes(args)
    print(format_table(rows, args.noise))
    for note in notes:
        print(f"# {note}")
    if args.json is not None:
        out = {
            "results": rows,
            "simulation": report,
            "notes": notes,
            "config": {**report["config"], "loads": [str(p) for p in args.loads]},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench eplb", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
