"""Options shared by commands that run an engine, read and validated in one place.

Every default is `EngineConfig`'s (`_DEFAULTS`), and `engine_argv` writes back only what differs
from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdmesh_engine.config import DTYPE_NAMES, EngineConfig

_DEFAULTS = EngineConfig()
_MIB = 1 << 20
# EngineConfig field -> its flag (kv_cache_memory_bytes is given in MiB; enable_prefix_caching is
# --no-prefix-caching; seed is not a flag)
_FLAGS = {
    "dtype": "--dtype",
    "device": "--device",
    "block_size": "--block-size",
    "num_blocks": "--num-blocks",
    "kv_cache_memory_bytes": "--kv-cache-mib",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "num_threads": "--torch-threads",
    "expert_load_window": "--expert-load-window",
    "max_kv_loads_per_step": "--max-kv-loads-per-step",
}


def add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face model directory (the `pdmesh` command defaults to its cached default "
        "model)",
    )
    g = p.add_argument_group("engine")
    d = _DEFAULTS
    g.add_argument("--dtype", default=d.dtype, choices=["auto", *DTYPE_NAMES])
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument(
        "--num-blocks",
        type=int,
        default=d.num_blocks,
        help="KV blocks (default: from --kv-cache-mib)",
    )
    g.add_argument(
        "--kv-cache-mib",
        type=int,
        default=d.kv_cache_memory_bytes // _MIB,
        help="KV cache memory when --num-blocks is not set",
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget per step",
    )
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--torch-threads",
        type=int,
        default=d.num_threads,
        help="CPU threads for torch (default: torch's)",
    )
    g.add_argument(
        "--expert-load-window",
        type=int,
        default=d.expert_load_window,
        help="steps of expert load kept for EPLB",
    )
    g.add_argument(
        "--max-kv-loads-per-step",
        type=int,
        default=d.max_kv_loads_per_step,
        metavar="N",
        help="decode: at most N requests whose prefilled KV just arrived join the running batch "
        "per step; the rest wait in order for later steps (default: no cap; 0 also means no cap; "
        "upstream found 4 a good value)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_mib * _MIB,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.torch_threads,
        expert_load_window=args.expert_load_window,
        max_kv_loads_per_step=args.max_kv_loads_per_step or None,
    )


def resolve_model(model: Path | None) -> Path:
    """The --model directory; a worker needs one (`pdmesh serve` fills in the cached default
    model)."""
    if model is None:
        raise ValueError(
            "--model is required: a Hugging Face model directory (config.json, *.safetensors)"
        )
    return model


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of `args` as command-line flags again (the launcher passes them to
    workers): only those that differ from EngineConfig's defaults."""
    config = engine_config(args)
    argv: list[str] = []
    for name, flag in _FLAGS.items():
        value = getattr(config, name)
        if value != getattr(_DEFAULTS, name):
            argv += [flag, str(value // _MIB if name == "kv_cache_memory_bytes" else value)]
    if not config.enable_prefix_caching:
        argv.append("--no-prefix-caching")
    return argv
