"""What a finished training run writes beside its checkpoint: the loss curve (PNG), a greedy
sample, and the model card (`README.md`) built from the run's summary (`training.json`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pdmesh.train.model import DeepseekV3ForTraining
from pdmesh.train.model_v4 import DeepseekV4ForTraining

ARCHITECTURES = {
    "deepseek_v3": "A DeepSeek-V3-architecture model (MLA, shared + routed experts with sigmoid "
    "routing and auxiliary-loss-free balancing",
    "deepseek_v4": "A DeepSeek-V4-architecture model (manifold-constrained hyper-connections, "
    "sliding-window attention with sinks plus compressed (CSA with a Lightning Indexer, HCA) "
    "entries, hash-routed and top-k-routed experts with auxiliary-loss-free balancing",
}

# no trailing newline: the tokenizer merges a newline with the next line's indent, so a prompt that
# ends in "\n" starts the model on a split it never saw in training
SAMPLE_PROMPT = "def fibonacci(n):"


def write_loss_curve(history: dict[str, Any], path: Path, title: str) -> None:
    """Train loss per step (and the MTP loss) with the held-out evaluations, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history["train"]]
    ax.plot(steps, [r["loss"] for r in history["train"]], lw=0.8, label="train")
    if any(r["mtp_loss"] for r in history["train"]):
        ax.plot(steps, [r["mtp_loss"] for r in history["train"]], lw=0.8, label="train (MTP, t+2)")
    ev = history["eval"]
    ax.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"pdmesh model train --preset {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@torch.no_grad()
def greedy_sample(
    model: DeepseekV3ForTraining | DeepseekV4ForTraining,
    tokenizer: Tokenizer,
    prompt: str = SAMPLE_PROMPT,
    tokens: int = 48,
) -> str:
    """The model's greedy continuation of `prompt` (the card shows it)."""
    model.eval()
    ids = tokenizer.encode(prompt).ids
    for _ in range(tokens):
        ids.append(int(model.logits(torch.tensor([ids]))[0, -1].argmax()))
    model.train()
    return tokenizer.decode(ids[len(tokenizer.encode(prompt).ids) :])


def write_card(summary: dict[str, Any], path: Path) -> None:
    """The model card: data, command, steps, tokens, time, losses, expert-load skew, a sample."""
    c = summary["config"]
    arch = c.get("arch", "deepseek_v3")
    command = (
        "pdmesh model train DIR "
        + (f"--arch {arch} " if arch != "deepseek_v3" else "")
        + f"--preset {c['preset']} --steps {c['steps']} "
        f"--batch-size {c['batch_size']} --seq-len {c['seq_len']} --lr {c['lr']} "
        f"--seed {c['seed']}"
    )
    skew = ", ".join(f"{x:.2f}" for x in summary["expert_load_skew"]) or "(no MoE layer)"
    runs = summary["runs"]
    threads = (
        f"{runs[0]['threads']} CPU thread(s)"
        if len({r["threads"] for r in runs}) == 1
        else ", then ".join(f"{r['threads']} thread(s) from step {r['start_step']}" for r in runs)
    )
    mtp = summary["held_out_mtp_loss"] > 0
    bits = summary["held_out_loss"] / math.log(2)
    lines = [
        f"# pdmesh `{c['preset']}` (trained)",
        "",
        ARCHITECTURES[arch]
        + (", one MTP module" if mtp else "")
        + ") trained by `pdmesh model train` on the Python standard library's own sources.",
        "",
        "| | |",
        "|---|---|",
        f"| command | `{command}` |",
        f"| data | the `.py` files of Python {summary['python']}'s standard library "
        "(tests, bundled packages, GUI code and codec tables left out), one file in 20 held "
        "out by a hash of its path |",
        f"| tokens | {summary['train_stream_tokens']:,} train, {summary['held_out_tokens']:,} "
        "held out (byte-level BPE trained on the train files) |",
        f"| parameters | {summary['parameters'] / 1e6:.2f}M"
        + (
            " (MTP included; embedding and head shared with it"
            + (", stored twice in the checkpoint)" if arch == "deepseek_v3" else ")")
            if mtp
            else ""
        )
        + " |",
        f"| steps | {summary['steps']:,} of {c['batch_size']} x {c['seq_len']} tokens "
        f"({summary['tokens_seen']:,} tokens seen) |",
        f"| wall time | {summary['wall_time_s'] / 60:.1f} min of training steps on {threads} "
        f"(torch {summary['torch']}) |",
        f"| final train loss | {summary['final_train_loss']:.3f} (mean of the last 50 steps) |",
        f"| held-out loss | {summary['held_out_loss']:.3f} nats/token, perplexity "
        f"{summary['held_out_perplexity']:.1f} ({bits:.2f} bits/token) |",
        f"| at initialisation | held-out loss {summary['random_init_held_out_loss']:.3f}, "
        f"perplexity {summary['random_init_held_out_perplexity']:,.0f} |",
    ]
    if mtp:
        lines.append(
            f"| held-out MTP loss | {summary['held_out_mtp_loss']:.3f} (token t+2), perplexity "
            f"{math.exp(summary['held_out_mtp_loss']):.1f} |"
        )
    lines += [
        f"| expert load skew | busiest expert / mean, per MoE layer on the held-out text: {skew} |",
        f"| weights | {summary['weight_bytes'] / 1e6:.1f} MB, {c['dtype']} (routers fp32) |",
        "",
        "Loss curve: `loss_curve.png`; every step's losses and the evaluations: `training.json`.",
        "",
        f"Greedy continuation of `{summary['sample']['prompt'].strip()}`:",
        "",
        "```python",
        summary["sample"]["prompt"] + summary["sample"]["completion"],
        "```",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")
