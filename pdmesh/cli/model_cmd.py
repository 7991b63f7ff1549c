"""`pdmesh model init`: write a seeded random-weight checkpoint (DeepSeek-V3 or V4), or copy an
embedded trained one; `pdmesh model train`: train one."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("model", help="model checkpoints")
    sub = p.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="write a seeded random checkpoint in Hugging Face layout")
    init.add_argument("dir", type=Path)
    init.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "tiny-draft", "small", "coder-v4", "coder", "coder-draft"],
        help="random presets: tiny, tiny-draft, small; coder-v4 (DeepSeek-V4, the default model), "
        "coder and coder-draft (DeepSeek-V3) copy the embedded trained checkpoints",
    )
    init.add_argument(
        "--arch",
        default=None,
        choices=["deepseek_v3", "deepseek_v4"],
        help="model family (default: a trained preset's own, else deepseek_v3; deepseek_v4: "
        "random presets tiny and small)",
    )
    init.add_argument(
        "--format",
        default="hf",
        choices=["hf", "official"],
        help="deepseek_v4's layout: hf (transformers' save layout, in --dtype) or official (the "
        "DeepSeek release's: FP8 dense weights, MXFP4 routed experts, BF16/F32 for the rest, an "
        "MTP layer; --dtype does not apply)",
    )
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    init.add_argument(
        "--expert-skew",
        type=float,
        default=0.0,
        metavar="ZIPF_S",
        help="Zipf exponent of expert popularity per MoE layer, each layer ranking "
        "experts differently (default 0: near-uniform routing; deepseek_v4: hf format, hash "
        "layers through their token table, top-k layers through the router bias)",
    )
    init.set_defaults(run=run_init)

    train = sub.add_parser(
        "train",
        help="train a preset on the Python standard library's sources (resumable)",
        description="Train a DeepSeek-V3 preset (MLA, sigmoid-routed experts with "
        "auxiliary-loss-free balancing, an MTP module), or with --arch deepseek_v4 a DeepSeek-V4 "
        "one (mHC, sliding-window + CSA/HCA attention with a Lightning Indexer, hash and top-k "
        "routed experts, an MTP module), on the standard library's Python sources; writes a "
        "Hugging Face checkpoint, training.json, loss_curve.png and a card.",
    )
    train.add_argument("dir", type=Path, help="run directory (the checkpoint is written there)")
    train.add_argument("--arch", default="deepseek_v3", choices=["deepseek_v3", "deepseek_v4"])
    train.add_argument(
        "--preset",
        default=None,
        choices=["coder", "coder-draft", "tiny", "tiny-draft", "small", "coder-v4"],
        help="deepseek_v3: coder (default), coder-draft, tiny, tiny-draft, small; deepseek_v4: "
        "coder-v4 (default), tiny, small",
    )
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    train.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    train.add_argument("--warmup-steps", type=int, default=50)
    train.add_argument("--mtp-weight", type=float, default=0.3)
    train.add_argument("--balance-weight", type=float, default=1e-4)
    train.add_argument(
        "--bias-gamma",
        type=float,
        default=1e-3,
        help="router correction-bias step per training step",
    )
    train.add_argument("--eval-every", type=int, default=100)
    train.add_argument("--eval-tokens", type=int, default=65536)
    train.add_argument("--save-every", type=int, default=50)
    train.add_argument(
        "--autocast",
        default="auto",
        choices=["auto", "bf16", "off"],
        help="bf16 autocast (auto: where the CPU has native bf16)",
    )
    train.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="dtype of the written weights",
    )
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=None)
    train.add_argument("--resume", action="store_true", help="continue the run saved in DIR")
    train.add_argument(
        "--until", type=int, default=None, metavar="STEP", help="stop after STEP (resumable)"
    )
    train.set_defaults(run=run_train)


def run_init(args: argparse.Namespace) -> int:
    from pdmesh.tools.model_init import init_model

    path = init_model(
        args.dir,
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        expert_skew=args.expert_skew,
        arch=args.arch,
        format=args.format,
    )
    print(path)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from pdmesh.train.trainer import TrainConfig, train

    default = "coder-v4" if args.arch == "deepseek_v4" else "coder"
    config = TrainConfig(
        preset=args.preset or default,
        arch=args.arch,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        mtp_weight=args.mtp_weight,
        balance_weight=args.balance_weight,
        bias_gamma=args.bias_gamma,
        eval_every=args.eval_every,
        eval_tokens=args.eval_tokens,
        save_every=args.save_every,
        autocast=args.autocast,
        dtype=args.dtype,
        seed=args.seed,
        threads=args.threads,
    )
    summary = train(args.dir, config, resume=args.resume, until=args.until)
    if summary is None:
        return 0
    print(
        f"{args.dir}: held-out loss {summary['held_out_loss']:.3f} "
        f"(perplexity {summary['held_out_perplexity']:.1f}; at initialisation "
        f"{summary['random_init_held_out_perplexity']:.0f})"
    )
    return 0
