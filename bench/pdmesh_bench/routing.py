"""`pdmesh bench routing`: the gateway's routing policies side by side, one mesh per policy, the
same requests (`pdmesh bench serve` options) against each, in one run.

--compare prefill   2 prefill + 1 decode (--prefill/--decode): least-loaded (fewest requests in
                    flight, the policy without the prefix index) vs cache-aware. On an agentic
                    trace (`--serve "--trace DIR --sessions --scale-to-context"`) this is what
                    prefix reuse across a session's turns is worth.
--compare disagg    always (every prompt to a prefill rank: --local-prefill-tokens off), never (agg
                    mode: decode prefills everything, no prefill instance) and conditional
                    (--local-prefill-tokens, default auto), on a mix of short and long prompts.

Per policy: TTFT p50/p90, e2e, throughput, the prompt tokens served from cache (and of the trace's
reusable prefix), the prompt tokens computed, and where prompts were computed (the gateway's
/mesh `routing.prefill_paths`). The first policy is the baseline of the printed ratios. `--plot`
draws the policies' TTFT distributions in one PNG; `--json` keeps everything (per-request rows
included). Meshes start one after the other on this machine (loopback only) and are stopped after
their run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_bench import serve
from pdmesh_bench.plots import write_ttft_plot
from pdmesh_service.redis_server import free_port


@dataclass(frozen=True)
class Policy:
    name: str
    mode: str  # disagg | agg
    gateway_args: tuple[str, ...]
    uses_prefill: bool = True


def policies(compare: str, local_prefill: str) -> list[Policy]:
    """The policies of a comparison, baseline first."""
    if compare == "prefill":
        return [
            Policy("least-loaded", "disagg", ("--prefill-routing", "least-loaded")),
            Policy("cache-aware", "disagg", ("--prefill-routing", "cache-aware")),
        ]
    if compare == "disagg":
        return [
            Policy("always", "disagg", ("--local-prefill-tokens", "off")),
            Policy("never", "agg", (), uses_prefill=False),
            Policy("conditional", "disagg", ("--local-prefill-tokens", local_prefill)),
        ]
    raise ValueError(f"--compare must be prefill or disagg, got {compare!r}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("routing", help="routing policies side by side, one mesh per policy")
    p.add_argument("--compare", choices=["prefill", "disagg"], required=True)
    p.add_argument(
        "--serve",
        default="--synthetic --num-requests 40 --concurrency 4",
        help="`pdmesh bench serve` options of the load, the same for every policy (quoted)",
    )
    p.add_argument("--model", help="model directory (default: the cached default model)")
    p.add_argument("--prefill", type=int, default=2, help="prefill instances (disagg policies)")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument(
        "--local-prefill-tokens",
        default="auto",
        help="the conditional policy's setting (auto or N; default %(default)s)",
    )
    p.add_argument("--worker-args", default="", help="engine options of every worker rank (quoted)")
    p.add_argument("--only", help="run only these policies (comma-separated names)")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--log-dir", type=Path, help="the meshes' logs (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write every policy's results here")
    p.add_argument("--plot", type=Path, help="write the policies' TTFT distributions to this PNG")
    p.set_defaults(run=run)


def serve_options(text: str) -> serve.ServeOptions:
    """`pdmesh bench serve` options from their command-line form (the url is set per mesh)."""
    parser = argparse.ArgumentParser(prog="pdmesh bench serve")
    serve.register(parser.add_subparsers(dest="bench_command", required=True))
    return serve.ServeOptions.from_args(parser.parse_args(["serve", *shlex.split(text)]))


def run(args: argparse.Namespace) -> int:
    from pdmesh.cli.options import resolve_model

    load = serve_options(args.serve)
    chosen = policies(args.compare, args.local_prefill_tokens)
    if args.only:
        names = set(args.only.split(","))
        chosen = [p for p in chosen if p.name in names]
        if not chosen:
            raise SystemExit(f"--only {args.only}: no such policy")
    model = resolve_model(Path(args.model) if args.model else None)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdmesh-bench-routing-"))
    results = {}
    for policy in chosen:
        _say(f"policy {policy.name}: starting the mesh")
        results[policy.name] = run_policy(policy, args, model, log_dir, load)
    report = {
        "compare": args.compare,
        "policies": results,
        "config": {
            "serve": args.serve,
            "prefill": args.prefill,
            "decode": args.decode,
            "model": str(model),
            "worker_args": args.worker_args,
        },
    }
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        curves = [(name, serve_ttfts(r)) for name, r in results.items()]
        write_ttft_plot(args.plot, curves, title=f"TTFT per {args.compare} policy")
        _say(f"plot: {args.plot}")
    return 1 if any(r["num_errors"] for r in results.values()) else 0


def run_policy(
    policy: Policy,
    args: argparse.Namespace,
    model: Path,
    log_dir: Path,
    load: serve.ServeOptions,
) -> dict[str, Any]:
    options = MeshOptions(
        model_dir=model,
        num_prefill=args.prefill if policy.uses_prefill else 0,
        num_decode=args.decode,
        mode=policy.mode,
        http_port=free_port(),
        grpc_port=free_port(),
        deployment=f"bench-routing-{os.getpid()}-{policy.name}",
        log_dir=log_dir / policy.name,
        worker_args=tuple(shlex.split(args.worker_args)),
        gateway_args=policy.gateway_args,
    )
    mesh = Mesh(options)
    mesh.start(timeout_s=args.start_timeout_s, progress=_say)
    try:
        url = f"http://{options.host}:{options.http_port}"
        result = serve.run_benchmark(replace(load, url=url, label=policy.name))
        result["routing"] = httpx.get(f"{url}/mesh", timeout=10).json().get("routing")
    finally:
        mesh.stop()
    return result


def serve_ttfts(result: dict[str, Any]) -> list[float]:
    return sorted(r["ttft_ms"] for r in result.get("requests", []) if r.get("ok"))


def computed_tokens(result: dict[str, Any]) -> int:
    """Prompt tokens some rank computed (not served from a cache)."""
    return int(result["input_tokens"]) - int(result["cached_input_tokens"])


def print_report(report: dict[str, Any]) -> None:
    results = report["policies"]
    base_name = next(iter(results))
    base = results[base_name]
    print(f"bench routing: --compare {report['compare']} ({report['config']['serve']})")
    print(
        f"  {'policy':<13}{'ok':>6}{'ttft p50':>10}{'ttft p90':>10}{'e2e p90':>10}"
        f"{'out tok/s':>11}{'cached':>8}{'of reus.':>9}{'computed':>10}  paths"
    )
    for name, r in results.items():
        reusable = r.get("cached_of_reusable")
        paths = (r.get("routing") or {}).get("prefill_paths") or {}
        print(
            f"  {name:<13}{r['num_completed']:>3}/{r['num_requests']:<3}"
            f"{_ms(r['ttft_ms']['p50']):>9}{_ms(r['ttft_ms']['p90']):>10}"
            f"{_ms(r['e2e_ms']['p90']):>10}{r['output_tokens_per_s']:>11.1f}"
            f"{_pct(r['cache_hit_ratio']):>8}{_pct(reusable):>9}{computed_tokens(r):>10}  "
            + ", ".join(f"{k} {v}" for k, v in paths.items() if v)
        )
    for name, r in list(results.items())[1:]:
        ttft, base_ttft = r["ttft_ms"], base["ttft_ms"]
        print(
            f"  {name} vs {base_name}: TTFT p50 {_ratio(base_ttft['p50'], ttft['p50'])} better, "
            f"p90 {_ratio(base_ttft['p90'], ttft['p90'])} better; "
            f"throughput {_ratio(r['output_tokens_per_s'], base['output_tokens_per_s'])}; "
            f"prompt tokens computed {_ratio(computed_tokens(r), computed_tokens(base))}"
        )


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}ms"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}x"


def _say(line: str) -> None:
    print(f"bench routing: {line}", file=sys.stderr, flush=True)
