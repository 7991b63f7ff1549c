"""Options shared by commands that run an engine, read and validated in one place."""
from __future__ import annotations

import argparse
from pathlib import Path

from pdmesh.engine.config import EngineConfig


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face model directory (default: the cached 'small' preset, generated on first use)")
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


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory_bytes=args.kv_cache_mib << 20, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching, dtype=args.dtype, device=args.device)


def resolve_model(model: Path | None) -> Path:
    """The given directory, or the cached default model (generated once)."""
    if model is not None:
        return model
    from pdmesh.engine.model_init import default_model_dir

    return default_model_dir()
