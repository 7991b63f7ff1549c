"""Options shared by commands that run an engine, read and validated in one place.

Every default is `EngineConfig`'s (`_DEFAULTS`), and `engine_argv` writes back only what differs
from it. Workers (and `pdmesh up`, which passes them on) also take the speculative-decoding options
(`add_speculative_options`; `worker_engine_config` reads both groups), and the KV-integrity options
of a hand-off (`add_kv_integrity_options`: `--kv-digest`, and on workers the fault hook
`--fault-corrupt-kv`; `kv_integrity_from_args` reads them).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pdmesh_engine.config import DTYPE_NAMES, SPECULATIVE_METHODS, EngineConfig
from pdmesh_engine.transfer.digest import DIGEST_MODES, CorruptKV, DigestMode, check_mode

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


DEFAULT_KV_DIGEST: DigestMode = "sampled"


@dataclasses.dataclass(frozen=True)
class KVIntegrityOptions:
    """How a worker checks the KV of its hand-offs (`pdmesh_engine.transfer.digest`), and the fault
    hook that tests it: each WRITE flips one byte with probability `corrupt_kv` (at most
    `corrupt_kv_limit` times when > 0; seeded by `fault_seed` and the rank's instance id)."""

    digest: DigestMode = DEFAULT_KV_DIGEST
    corrupt_kv: float = 0.0
    corrupt_kv_limit: int = 0
    fault_seed: int = 0

    def __post_init__(self) -> None:
        check_mode(self.digest)
        if not 0.0 <= self.corrupt_kv <= 1.0:
            raise ValueError(f"--fault-corrupt-kv must be in [0, 1], got {self.corrupt_kv}")
        if self.corrupt_kv_limit < 0:
            raise ValueError(f"--fault-corrupt-kv-limit must be >= 0, got {self.corrupt_kv_limit}")

    def fault(self, instance_id: str) -> CorruptKV | None:
        """The prefill rank's fault hook (None: off)."""
        if self.corrupt_kv <= 0.0:
            return None
        seed = f"{self.fault_seed}:{instance_id}"
        return CorruptKV(self.corrupt_kv, seed, self.corrupt_kv_limit)


def add_kv_integrity_options(p: argparse.ArgumentParser, faults: bool = True) -> None:
    """--kv-digest (every command that runs or launches workers) and, with `faults`, the test hook
    --fault-corrupt-kv[-limit] and --fault-seed (prefill acts on them; decode accepts them, as the
    launcher passes one set of worker options to both)."""
    g = p.add_argument_group("KV integrity")
    g.add_argument(
        "--kv-digest",
        choices=DIGEST_MODES,
        default=DEFAULT_KV_DIGEST,
        help="digest of each hand-off's KV bytes, sent by prefill and checked by decode before "
        "admission; a mismatch fails the hand-off closed (retried elsewhere). sampled: 1 hand-off "
        "in 16, chosen by request id; all: every one; off: none. Give prefill and decode the same "
        f"mode (default: {DEFAULT_KV_DIGEST})",
    )
    if not faults:
        return
    g.add_argument(
        "--fault-corrupt-kv",
        type=float,
        default=0.0,
        metavar="P",
        help="TEST HOOK (prefill): flip one byte of a KV WRITE in flight with probability P "
        "(the rank's own KV stays intact); for tests and `pdmesh bench chaos --corrupt-kv`",
    )
    g.add_argument(
        "--fault-corrupt-kv-limit",
        type=int,
        default=0,
        metavar="N",
        help="TEST HOOK: at most N corrupted WRITEs per rank (0: no limit)",
    )
    g.add_argument("--fault-seed", type=int, default=0, help="TEST HOOK: seed of the fault draws")


def kv_integrity_from_args(args: argparse.Namespace) -> KVIntegrityOptions:
    return KVIntegrityOptions(
        args.kv_digest,
        getattr(args, "fault_corrupt_kv", 0.0),
        getattr(args, "fault_corrupt_kv_limit", 0),
        getattr(args, "fault_seed", 0),
    )


def kv_integrity_argv(args: argparse.Namespace) -> list[str]:
    """--kv-digest as a worker flag when `args` has it and it is not the default."""
    mode = getattr(args, "kv_digest", DEFAULT_KV_DIGEST)
    return [] if mode == DEFAULT_KV_DIGEST else ["--kv-digest", mode]


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
    return argv + speculative_argv(args) + kv_integrity_argv(args)


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
