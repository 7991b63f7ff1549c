"""The checks that need a CUDA GPU (CI has none): the Triton kernels against their torch
references, the engine's CUDA decode path (CUDA graphs on and off) against the CPU engine, and
DeepSeek-V4's MTP speculative decoding on CUDA against the CPU engine without it.

    PYTHONPATH=engine:kernels:protos:. python scripts/gpu_check.py --out DIR

Writes DIR/gpu_check.json and prints one line per check; exits 1 if any check fails. Every case
is seeded; the tolerances are those of the CPU kernel tests (fp32 1e-4 relative to the output's
scale, bf16 2e-2).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

CUDA = torch.device("cuda")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _time_ms(fn: Callable[[], Any], repeats: int = 20) -> float:
    """Median CUDA-event time of `fn` after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6))


def mla_cases() -> list[dict[str, Any]]:
    from pdmesh_kernels import mla_decode_attention_ref, mla_decode_attention_triton

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, heads, lat, rope, block, lens in (
            (4, 16, 512, 64, 16, [1, 17, 300, 1024]),
            (32, 16, 512, 64, 64, [4096] * 32),
            (3, 128, 512, 64, 16, [5, 2000, 33]),
            (64, 8, 128, 32, 16, [128 + 7 * i for i in range(64)]),
        ):
            gen = torch.Generator().manual_seed(batch * heads)
            used = [-(-n // block) for n in lens]
            num_blocks = sum(used) + 2
            kv = torch.randn(num_blocks, block, lat + rope, generator=gen)
            perm = torch.randperm(num_blocks, generator=gen).tolist()
            table = torch.zeros(batch, max(used), dtype=torch.int32)
            for b in range(batch):
                for j in range(used[b]):
                    table[b, j] = perm.pop()
            q_lat = torch.randn(batch, heads, lat, generator=gen)
            q_rope = torch.randn(batch, heads, rope, generator=gen)
            args = [t.to(CUDA) for t in (q_lat.to(dtype), q_rope.to(dtype), kv.to(dtype), table)]
            seq = torch.tensor(lens, dtype=torch.int32, device=CUDA)
            scale = (lat + rope) ** -0.5
            ref = mla_decode_attention_ref(*args, seq, scale)
            ours = mla_decode_attention_triton(*args, seq, scale)
            err = _rel_err(ours, ref)
            rows.append(
                {
                    "kernel": "mla_decode_attention",
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": f"B{batch} H{heads} L{lat} R{rope} BS{block} max_len {max(lens)}",
                    "rel_err": err,
                    "ok": err <= TOLERANCE[dtype],
                    "triton_ms": _time_ms(partial(mla_decode_attention_triton, *args, seq, scale)),
                    "torch_ms": _time_ms(partial(mla_decode_attention_ref, *args, seq, scale)),
                }
            )
    return rows


def moe_cases() -> list[dict[str, Any]]:
    from pdmesh_kernels import fused_moe

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, hidden, width, experts, top_k in (
            (1, 512, 128, 64, 4),
            (32, 512, 128, 64, 4),
            (512, 2048, 512, 64, 6),
            (4096, 1024, 256, 256, 8),
        ):
            gen = torch.Generator().manual_seed(tokens + experts)
            x = (torch.randn(tokens, hidden, generator=gen)).to(dtype).to(CUDA)
            w13 = torch.randn(experts, 2 * width, hidden, generator=gen) / hidden**0.5
            w2 = torch.randn(experts, hidden, width, generator=gen) / width**0.5
            w13, w2 = w13.to(dtype).to(CUDA), w2.to(dtype).to(CUDA)
            ids = torch.stack(
                [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
            )
            ids = ids.to(CUDA)
            weights = torch.rand(tokens, top_k, generator=gen).to(CUDA)
            ref = fused_moe(x, w13, w2, weights, ids, use_triton=False)
            ours = fused_moe(x, w13, w2, weights, ids, use_triton=True)
            err = _rel_err(ours, ref)
            rows.append(
                {
                    "kernel": "fused_moe",
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": f"T{tokens} D{hidden} I{width} E{experts} K{top_k}",
                    "rel_err": err,
                    "ok": err <= TOLERANCE[dtype],
                    "triton_ms": _time_ms(partial(fused_moe, x, w13, w2, weights, ids, True)),
                    "torch_ms": _time_ms(partial(fused_moe, x, w13, w2, weights, ids, False)),
                }
            )
    return rows


def engine_cases(root: Path) -> list[dict[str, Any]]:
    """Greedy tokens of the CUDA engine (graphs on, graphs off) equal the CPU engine's, for the
    tiny V3 preset (MLA + MoE kernels, CUDA graphs) and the tiny V4 preset (torch path)."""
    from pdmesh.tools.model_init import init_model
    from pdmesh_engine import EngineConfig, EngineCore, SamplingParams

    rows = []
    prompts = [
        torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 17, 60, 130, 9, 33, 250, 2)
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for arch in ("deepseek_v3", "deepseek_v4"):
        model = init_model(root / arch, "tiny", seed=1, arch=arch, verbose=False)
        results: dict[str, Any] = {}
        for name, overrides in (
            ("cpu", {"device": "cpu"}),
            ("cuda graphs", {"device": "cuda"}),
            ("cuda eager", {"device": "cuda", "cuda_graph_max_batch": 0}),
        ):
            engine = EngineCore(model, EngineConfig(dtype="float32", **overrides))
            ids = [engine.add_request(p, params) for p in prompts]
            tokens: dict[str, list[int]] = {i: [] for i in ids}
            start = time.perf_counter()
            while engine.has_unfinished:
                for out in engine.step():
                    tokens[out.request_id].extend(out.new_token_ids)
            results[name] = {
                "tokens": [tokens[i] for i in ids],
                "seconds": time.perf_counter() - start,
                "graphs": engine.runner.graphs is not None,
            }
        for name in ("cuda graphs", "cuda eager"):
            same = sum(
                a == b
                for a, b in zip(results[name]["tokens"], results["cpu"]["tokens"], strict=True)
            )
            rows.append(
                {
                    "engine": arch,
                    "path": name,
                    "graphs_used": results[name]["graphs"],
                    "prompts_equal_to_cpu": f"{same}/{len(prompts)}",
                    "ok": same == len(prompts),
                    "seconds": results[name]["seconds"],
                    "cpu_seconds": results["cpu"]["seconds"],
                }
            )
    return rows


def spec_cases(root: Path) -> list[dict[str, Any]]:
    """MTP speculative decoding on the CUDA engine: a tiny V4 in the release format (its `mtp.0.*`
    layer drafts K tokens) gives the greedy tokens of the CPU engine without speculation."""
    from pdmesh.tools.model_init import init_model
    from pdmesh_engine import EngineConfig, EngineCore, SamplingParams

    model = init_model(
        root / "v4-mtp", "tiny", seed=5, arch="deepseek_v4", format="official", verbose=False
    )
    prompts = [
        torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 60, 300, 9)
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def generate(config: EngineConfig) -> tuple[list[list[int]], float]:
        engine = EngineCore(model, config)
        ids = [engine.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        start = time.perf_counter()
        while engine.has_unfinished:
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
        return [tokens[i] for i in ids], time.perf_counter() - start

    expected, _ = generate(EngineConfig(dtype="float32", device="cpu"))
    rows = []
    for k in (1, 3):
        config = EngineConfig(
            dtype="float32", device="cuda", speculative_method="mtp", num_speculative_tokens=k
        )
        got, seconds = generate(config)
        same = sum(a == b for a, b in zip(got, expected, strict=True))
        rows.append(
            {
                "engine": "deepseek_v4 mtp",
                "path": f"cuda K={k}",
                "prompts_equal_to_cpu_without_speculation": f"{same}/{len(prompts)}",
                "ok": same == len(prompts),
                "seconds": seconds,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    checks: list[dict[str, Any]] = []
    for part in (mla_cases, moe_cases):
        try:
            checks += part()
        except Exception as e:  # noqa: BLE001 (a failed part is reported, the others still run)
            checks.append({"part": part.__name__, "ok": False, "error": repr(e)})
    with tempfile.TemporaryDirectory() as tmp:
        for engine_part in (engine_cases, spec_cases):
            try:
                checks += engine_part(Path(tmp))
            except Exception as e:  # noqa: BLE001 (reported like a failed check)
                checks.append({"part": engine_part.__name__, "ok": False, "error": repr(e)})
    report["checks"] = checks
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    for row in checks:
        print(json.dumps(row))
    failed = [row for row in checks if not row["ok"]]
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed on {report['device']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
