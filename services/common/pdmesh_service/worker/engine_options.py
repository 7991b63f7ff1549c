"""Options shared by commands that run an engine, read and validated in one place."""
from __future__ import annotations

import argparse
from pathlib import Path

from pdmesh_engine.config import EngineConfig


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face model directory (the `pdmesh` command defaults to its cached default model)")
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-mib)")
    g.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache memory when --num-blocks is not set")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--torch-threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    g.add_argument("--expert-load-window", type=int, default=1000, help="steps of expert load kept for EPLB")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory_bytes=args.kv_cache_mib << 20, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching, dtype=args.dtype, device=args.device,
                        num_threads=args.torch_threads, expert_load_window=args.expert_load_window)


def resolve_model(model: Path | None) -> Path:
    """The --model directory; a worker needs one (`pdmesh serve` fills in the cached default model)."""
    if model is None:
        raise ValueError("--model is required: a Hugging Face model directory (config.json, *.safetensors)")
    return model


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of `args` as command-line flags again (the launcher passes them to workers)."""
    argv = ["--dtype", args.dtype, "--device", args.device, "--block-size", str(args.block_size),
            "--kv-cache-mib", str(args.kv_cache_mib), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--expert-load-window", str(args.expert_load_window)]
    if args.num_blocks is not None:
        argv += ["--num-blocks", str(args.num_blocks)]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    if args.torch_threads is not None:
        argv += ["--torch-threads", str(args.torch_threads)]
    return argv
