"""Options shared by commands that run an engine, read and validated in one place.

Every default is `EngineConfig`'s (`_DEFAULTS`), and `engine_argv` writes back only what differs
from it. Workers (and `pdmesh up`, which passes them on) also take the speculative-decoding options
(`add_speculative_options`; `worker_engine_config` reads both groups).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pdmesh_engine.config import DTYPE_NAMES, SPECULATIVE_METHODS, EngineConfig

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
    "cuda_graph_max_batch": "--cuda-graph-max-batch",
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
    g.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        default=d.cuda_graph_max_batch,
        metavar="N",
        help="on a GPU, decode steps of up to N requests replay CUDA graphs (0: always eager, "
        "like vLLM's --enforce-eager)",
    )


def add_speculative_options(p: argparse.ArgumentParser, k_list: bool = False) -> None:
    """--speculative-method, --num-speculative-tokens (`k_list`: a comma-separated list, for
    benchmarks), --draft-model."""
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-method",
        choices=list(SPECULATIVE_METHODS),
        default=None,
        help="draft tokens with the checkpoint's MTP layer or a separate draft model and verify "
        "them in one forward" + (" (default: mtp)" if k_list else " (default: off)"),
    )
    spec.add_argument(
        "--num-speculative-tokens",
        default=None,
        type=str if k_list else int,
        metavar="K,K,..." if k_list else "K",
        help="drafts per step, comma-separated, 0 = off (default 0,1,2,3)"
        if k_list
        else "drafts per step, 1..8 (default with a method: 1)",
    )
    spec.add_argument(
        "--draft-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="the draft checkpoint of --speculative-method draft_model (the same tokenizer; "
        "default: the embedded coder-draft)",
    )


def speculative_fields(
    method: str | None, k: int | None, draft_model: Path | None
) -> dict[str, object]:
    """EngineConfig's speculative-decoding fields (validated there): a method alone means K = 1,
    draft_model without a directory means the embedded draft model."""
    if k is None:
        k = 1 if method else 0
    if method == "draft_model" and draft_model is None:
        from pdmesh_engine.checkpoint import embedded_model_dir

        draft_model = embedded_model_dir("coder-draft")
    return {
        "speculative_method": method if k else None,
        "num_speculative_tokens": k,
        "draft_model": str(draft_model) if draft_model is not None and k else None,
    }


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
        cuda_graph_max_batch=args.cuda_graph_max_batch,
    )


def worker_engine_config(args: argparse.Namespace) -> EngineConfig:
    """`engine_config` with the speculative-decoding fields of `add_speculative_options` (a worker,
    `pdmesh up`)."""
    return dataclasses.replace(
        engine_config(args),
        **speculative_fields(  # type: ignore[arg-type]
            args.speculative_method, args.num_speculative_tokens, args.draft_model
        ),
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
    return argv + speculative_argv(args)


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """The speculative-decoding options of `args` (when it has them) as flags, resolved as the
    engine will run them (a method alone: K = 1; draft_model alone: the embedded draft model;
    the draft directory absolute); [] with speculation off."""
    if getattr(args, "speculative_method", None) is None and not getattr(
        args, "num_speculative_tokens", None
    ):
        return []
    fields = speculative_fields(
        args.speculative_method, args.num_speculative_tokens, args.draft_model
    )
    if not fields["speculative_method"]:
        return []
    argv = [
        "--speculative-method",
        str(fields["speculative_method"]),
        "--num-speculative-tokens",
        str(fields["num_speculative_tokens"]),
    ]
    if fields["draft_model"] is not None:
        argv += ["--draft-model", str(Path(str(fields["draft_model"])).resolve())]
    return argv
