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


def v4_mix_cases() -> list[dict[str, Any]]:
    """DeepSeek-V4's compressor pooling and mHC kernels against their references: the small
    preset's widths and a Flash-like model's (hidden 4096, hc_mult 4, head_dim 512, CSA rate 4
    with its 128-wide indexer, HCA rate 128), for steps of 32-256 tokens."""
    from pdmesh_kernels import (
        compressor_pool_ref,
        compressor_pool_triton,
        mhc_collapse_ref,
        mhc_collapse_triton,
        mhc_expand_ref,
        mhc_expand_triton,
    )

    def row(
        kernel: str,
        dtype: torch.dtype,
        shape: str,
        err: float,
        ours: Callable[[], Any],
        ref: Callable[[], Any],
    ) -> dict[str, Any]:
        return {
            "kernel": kernel,
            "dtype": str(dtype).removeprefix("torch."),
            "shape": shape,
            "rel_err": err,
            "ok": err <= TOLERANCE[dtype],
            "triton_ms": _time_ms(ours),
            "torch_ms": _time_ms(ref),
        }

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        # (rate, series, dim, closing windows): CSA / indexer / HCA windows closing in a step
        for rate, series, dim, windows in (
            (4, 2, 512, 64),
            (4, 2, 128, 64),
            (128, 1, 512, 4),
            (4, 2, 128, 8),
        ):
            gen = torch.Generator().manual_seed(rate * dim + windows)
            pool = torch.randn(4096, 2 * series * dim, generator=gen).to(dtype).to(CUDA)
            slots = torch.randperm(4096, generator=gen)[: windows * series * rate]
            slots = slots.view(windows, series * rate).to(CUDA)
            first = (torch.arange(windows) % 5 == 0).to(CUDA)
            ape = torch.randn(rate, series * dim, generator=gen).to(CUDA)
            weight = (torch.rand(dim, generator=gen) + 0.5).to(CUDA)
            args = (pool, slots, first, ape, weight, 1e-6)
            ref = compressor_pool_ref(*args)
            err = _rel_err(compressor_pool_triton(*args), ref)
            rows.append(
                row(
                    "compressor_pool",
                    dtype,
                    f"rate {rate} S{series} D{dim} C{windows}",
                    err,
                    partial(compressor_pool_triton, *args),
                    partial(compressor_pool_ref, *args),
                )
            )
        for tokens, n, hidden in ((32, 4, 4096), (256, 4, 4096), (64, 4, 512), (128, 2, 64)):
            gen = torch.Generator().manual_seed(tokens * n + hidden)
            m = (2 + n) * n
            streams = torch.randn(tokens, n, hidden, generator=gen).to(dtype).to(CUDA)
            fn = (torch.randn(m, n * hidden, generator=gen) * 4 / (n * hidden) ** 0.5).to(CUDA)
            base = torch.randn(m, generator=gen).to(CUDA)
            scale = (torch.rand(3, generator=gen) + 0.5).to(CUDA)
            out = torch.randn(tokens, hidden, generator=gen).to(dtype).to(CUDA)
            args = (streams, fn, base, scale, 20, 1e-6, 1e-6)
            ref = mhc_collapse_ref(*args)
            ours = mhc_collapse_triton(*args)
            err = max(_rel_err(a, b) for a, b in zip(ours, ref, strict=True))
            shape = f"T{tokens} N{n} D{hidden}"
            rows.append(
                row(
                    "mhc_collapse",
                    dtype,
                    shape + " sinkhorn 20",
                    err,
                    partial(mhc_collapse_triton, *args),
                    partial(mhc_collapse_ref, *args),
                )
            )
            exp_args = (streams, out, ref[1], ref[2])
            err = _rel_err(mhc_expand_triton(*exp_args), mhc_expand_ref(*exp_args))
            rows.append(
                row(
                    "mhc_expand",
                    dtype,
                    shape,
                    err,
                    partial(mhc_expand_triton, *exp_args),
                    partial(mhc_expand_ref, *exp_args),
                )
            )
    return rows


def v4_attention_cases() -> list[dict[str, Any]]:
    """DeepSeek-V4's Lightning Indexer and sparse attention against their references, on random
    paged steps (ragged visible counts, some queries near the sequence start): the small preset's
    CSA layer (8 heads x 128, indexer 16 x 64 top-128), Flash-like CSA and HCA layers (64 heads x
    512, window 128, indexer 64 x 128 top-512 of 4096 entries; HCA all of 256 entries), and a
    256-token prefill chunk. The indexer's rel_err is its scores'; its choice must be as good as the
    reference's (the reference scores of the chosen entries, sorted, within the tolerance:
    near-ties may swap), and index_rows_equal says how many rows chose the very same set."""
    from pdmesh_kernels import (
        indexer_scores_ref,
        indexer_scores_triton,
        indexer_topk_ref,
        indexer_topk_triton,
        v4_attention_ref,
        v4_attention_triton,
    )

    def dev(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (t if dtype is None else t.to(dtype)).to(CUDA)

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        # (name, tokens, H, C, W, Hi, Ci, top_k (None: HCA), entries)
        for name, tokens, heads, dim, window, ih, idim, top_k, entries in (
            ("small CSA decode", 32, 8, 128, 128, 16, 64, 128, 512),
            ("flash CSA decode", 32, 64, 512, 128, 64, 128, 512, 4096),
            ("flash HCA decode", 32, 64, 512, 128, 0, 0, None, 256),
            ("small CSA prefill", 256, 8, 128, 128, 16, 64, 128, 1024),
        ):
            gen = torch.Generator().manual_seed(tokens * heads + entries)
            seqs = 4
            token_seq = torch.arange(tokens) % seqs
            visible = torch.randint(1, entries + 1, (tokens,), generator=gen)
            visible[:3] = torch.tensor([1, 2, entries])[: min(3, tokens)]
            pos = torch.randint(0, 4 * window, (tokens,), generator=gen)
            window_valid = pos[:, None] - window + 1 + torch.arange(window)[None, :] >= 0
            num_rows = tokens * window + 64
            window_slots = torch.randint(0, num_rows, (tokens, window), generator=gen)
            entry_slots = torch.randperm(seqs * entries + 64, generator=gen)[: seqs * entries]
            entry_slots = entry_slots.view(seqs, entries)

            token_seq, visible, window_valid = dev(token_seq), dev(visible), dev(window_valid)
            window_slots, entry_slots = dev(window_slots), dev(entry_slots)
            chosen = None
            shape = f"T{tokens} H{heads} C{dim} W{window} E{entries}"
            if top_k is not None:
                q_idx = dev(torch.randn(tokens, ih, idim, generator=gen), dtype)
                weights = dev(torch.randn(tokens, ih, generator=gen), dtype)
                index_pool = dev(torch.randn(seqs * entries + 64, idim, generator=gen), dtype)
                args = (q_idx, weights, index_pool, entry_slots, token_seq, visible)
                ref_score = indexer_scores_ref(*args)
                live = torch.isfinite(ref_score)
                score = indexer_scores_triton(*args)
                scale = ref_score[live].abs().max()
                err = float((score[live] - ref_score[live]).abs().max() / scale)
                ref_chosen, ref_ok = indexer_topk_ref(*args, top_k)
                chosen, ok = indexer_topk_triton(*args, top_k)
                got = ref_score.gather(1, chosen).masked_fill(~ok, 0).sort(dim=1).values
                want = ref_score.gather(1, ref_chosen).masked_fill(~ref_ok, 0).sort(dim=1).values
                choice_err = float((got - want).abs().max() / scale)
                same = chosen.masked_fill(~ok, -1).sort(dim=1).values
                same = same == ref_chosen.masked_fill(~ref_ok, -1).sort(dim=1).values
                rows.append(
                    {
                        "kernel": "indexer_topk",
                        "dtype": str(dtype).removeprefix("torch."),
                        "shape": f"{name}: T{tokens} Hi{ih} Ci{idim} E{entries} top-{top_k}",
                        "rel_err": err,
                        "choice_err": choice_err,
                        "index_rows_equal": f"{int(same.all(dim=1).sum())}/{tokens}",
                        "ok": max(err, choice_err) <= TOLERANCE[dtype] and torch.equal(ok, ref_ok),
                        "triton_ms": _time_ms(partial(indexer_topk_triton, *args, top_k)),
                        "torch_ms": _time_ms(partial(indexer_topk_ref, *args, top_k)),
                    }
                )
                chosen = ref_chosen
            q = dev(torch.randn(tokens, heads, dim, generator=gen), dtype)
            window_pool = dev(torch.randn(num_rows, dim, generator=gen), dtype)
            entry_pool = dev(torch.randn(seqs * entries + 64, dim, generator=gen), dtype)
            sink = dev(torch.randn(heads, generator=gen))
            args = (q, window_pool, window_slots, window_valid, sink, dim**-0.5, entry_pool)
            args += (entry_slots, token_seq, visible, chosen)
            err = _rel_err(v4_attention_triton(*args), v4_attention_ref(*args))
            rows.append(
                {
                    "kernel": "v4_attention",
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": f"{name}: {shape}" + (f" top-{top_k}" if top_k else " all"),
                    "rel_err": err,
                    "ok": err <= TOLERANCE[dtype],
                    "triton_ms": _time_ms(partial(v4_attention_triton, *args)),
                    "torch_ms": _time_ms(partial(v4_attention_ref, *args)),
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
    for part in (mla_cases, moe_cases, v4_mix_cases, v4_attention_cases):
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
