"""`pdmesh model train`: train a DeepSeek-V3 preset on the standard library's Python sources.

The run directory holds the run (`.train/`: the resumable state, the history) and, when it ends,
the Hugging Face checkpoint (`export.py`), `training.json` with the figures of the run, the loss
curve `loss_curve.png` and a model card `README.md`. Interrupted runs resume from the last saved
state (`--resume`), batch for batch: batches are a function of (seed, step).

Recipe: AdamW (betas 0.9/0.95, weight decay on matrices only), linear warmup then cosine decay to
`min_lr_ratio`, gradient clipping at 1, bf16 autocast where the CPU has native bf16; the loss is
next-token cross-entropy + `mtp_weight` x the MTP module's + `balance_weight` x the sequence-wise
balance loss; after every step each router's correction bias moves by `bias_gamma` towards equal
expert loads (DeepSeek-V3's auxiliary-loss-free balancing).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pdmesh.tools.model_init import preset_model_config
from pdmesh.tools.tokenizer_train import train_bpe
from pdmesh.train.data import TokenStream, split, stdlib_sources
from pdmesh.train.export import export_checkpoint
from pdmesh.train.model import DeepseekV3ForTraining
from pdmesh_engine.cpu_dtype import has_native_bf16

STATE_DIR = ".train"
SAMPLE_PROMPT = "def fibonacci(n):\n"


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "coder"
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    balance_weight: float = 1e-4
    bias_gamma: float = 1e-3
    seed: int = 0
    eval_every: int = 100
    eval_tokens: int = 65536
    save_every: int = 50
    autocast: str = "auto"  # auto | bf16 | off
    dtype: str = "bfloat16"  # of the exported weights
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.autocast not in ("auto", "bf16", "off"):
            raise ValueError(f"autocast must be auto, bf16 or off, got {self.autocast!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def use_bf16(self) -> bool:
        return self.autocast == "bf16" or (self.autocast == "auto" and has_native_bf16())


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup to `lr`, then cosine down to `lr * min_lr_ratio` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


@dataclass
class Evaluation:
    step: int
    loss: float  # held-out next-token cross-entropy (nats per token)
    mtp_loss: float  # held-out MTP cross-entropy (token t+2)
    expert_load: list[list[int]] = field(default_factory=list)  # per MoE layer, tokens per expert

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def load_skew(self) -> list[float]:
        """Per MoE layer: the busiest expert's load over the mean load (1 = balanced)."""
        return [max(load) * len(load) / max(sum(load), 1) for load in self.expert_load]


def _optimizer(model: DeepseekV3ForTraining, config: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


@torch.no_grad()
def evaluate(
    model: DeepseekV3ForTraining, stream: TokenStream, config: TrainConfig, step: int
) -> Evaluation:
    """Held-out losses over the first `eval_tokens` tokens, and the experts' loads there."""
    model.eval()
    windows = stream.windows(config.seq_len, config.eval_tokens)
    lm = mtp = 0.0
    loads: list[torch.Tensor] = []
    for start in range(0, len(windows), config.batch_size):
        batch = torch.stack(windows[start : start + config.batch_size])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.use_bf16()):
            losses = model(batch)
        lm += float(losses.lm) * len(batch)
        mtp += float(losses.mtp) * len(batch)
        counts = [s.load for s in losses.routing]
        loads = counts if not loads else [a + b for a, b in zip(loads, counts, strict=True)]
    model.train()
    n = max(len(windows), 1)
    return Evaluation(step, lm / n, mtp / n, [c.tolist() for c in loads])


class Progress:
    """One status line (rewritten in place on a terminal, every `every` steps otherwise)."""

    def __init__(self, total: int, every: int = 10) -> None:
        self.total, self.every = total, every
        self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, mtp: float, tokens_per_s: float, eta_s: float) -> None:
        if not self.tty and step % self.every and step != self.total:
            return
        width = 30
        done = int(width * step / self.total)
        line = (
            f"[{'#' * done}{'.' * (width - done)}] {step}/{self.total} loss {loss:.3f} "
            + (f"mtp {mtp:.3f} " if mtp else "")
            + f"{tokens_per_s:,.0f} tok/s eta {eta_s / 60:.1f} min"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr)
        sys.stderr.flush()

    def message(self, text: str) -> None:
        print(("\n" if self.tty else "") + f"pdmesh: {text}", file=sys.stderr, flush=True)


def _without_threads(config: dict[str, Any]) -> dict[str, Any]:
    """The settings a resumed run must share (the thread count may change)."""
    return {k: v for k, v in config.items() if k != "threads"}


def _save_state(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(
    out_dir: str | Path,
    config: TrainConfig,
    *,
    resume: bool = False,
    until: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """Train `config.preset` into `out_dir` (see the module docstring); returns the summary that
    `training.json` holds. `until`: stop after that step with the state saved (None if the run
    is not finished; `resume` continues it)."""
    out = Path(out_dir).expanduser()
    state_dir = out / STATE_DIR
    state_path = state_dir / "state.pt"
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(f"{out} is not empty (pass --resume to continue a run there)")
    if resume and not state_path.is_file():
        raise FileNotFoundError(f"{state_path}: no saved run to resume")
    state_dir.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    progress = Progress(config.steps)
    say = log or progress.message
    model_config = preset_model_config(config.preset)

    files = stdlib_sources()
    train_files, held_out_files = split(files)
    tokenizer_path = state_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        tokenizer_path.write_text(
            train_bpe([f.text for f in train_files], model_config.vocab_size), encoding="utf-8"
        )
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")
    tokenizer = Tokenizer.from_str(tokenizer_json)
    train_stream = TokenStream(train_files, tokenizer)
    held_out = TokenStream(held_out_files, tokenizer)
    say(
        f"data: {len(train_files)} train files ({len(train_stream):,} tokens), "
        f"{len(held_out_files)} held-out files ({len(held_out):,} tokens)"
    )

    torch.manual_seed(config.seed)
    model = DeepseekV3ForTraining(model_config)
    model.init_weights(config.seed)
    optimizer = _optimizer(model, config)
    history: dict[str, Any] = {"train": [], "eval": []}
    step, elapsed = 0, 0.0
    if resume:
        saved = torch.load(state_path, weights_only=False)
        if _without_threads(saved["config"]) != _without_threads(asdict(config)):
            raise ValueError(f"{state_path} was saved with other settings: {saved['config']}")
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, elapsed, history = saved["step"], saved["elapsed_s"], saved["history"]
        say(f"resuming at step {step}/{config.steps}")
    else:
        initial = evaluate(model, held_out, config, 0)
        history["eval"].append(asdict(initial))
        say(f"step 0: held-out loss {initial.loss:.3f} (perplexity {initial.perplexity:,.0f})")
    history.setdefault("runs", []).append({"start_step": step, "threads": torch.get_num_threads()})
    say(
        f"training {config.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters, {config.steps} steps of {config.tokens_per_step} tokens, "
        f"bf16 autocast {'on' if config.use_bf16() else 'off'}"
    )

    model.train()
    window_start, window_tokens = time.perf_counter(), 0
    stop = min(config.steps, until or config.steps)
    while step < stop:
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        batch = train_stream.batch(config.batch_size, config.seq_len, config.seed, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.use_bf16()):
            losses = model(batch)
            loss = losses.total(config.mtp_weight, config.balance_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        model.update_balance_bias(losses.routing, config.bias_gamma)
        step += 1
        elapsed += time.perf_counter() - t0
        window_tokens += config.tokens_per_step
        rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
        record = {
            "step": step,
            "loss": losses.lm.item(),
            "mtp_loss": losses.mtp.item(),
            "balance_loss": losses.balance.item(),
            "grad_norm": grad_norm,
            "lr": learning_rate(config, step - 1),
        }
        history["train"].append(record)
        progress.update(
            step, record["loss"], record["mtp_loss"], rate, (config.steps - step) * elapsed / step
        )
        if step % config.eval_every == 0 or step == config.steps:
            ev = evaluate(model, held_out, config, step)
            history["eval"].append(asdict(ev))
            say(
                f"step {step}: held-out loss {ev.loss:.3f} (perplexity {ev.perplexity:.1f}), "
                f"mtp {ev.mtp_loss:.3f}, busiest expert / mean "
                f"{max(ev.load_skew, default=1.0):.2f}"
            )
        if step % config.save_every == 0 or step == stop:
            _save_state(
                state_path,
                {
                    "config": asdict(config),
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "elapsed_s": elapsed,
                    "history": history,
                },
            )
            window_start, window_tokens = time.perf_counter(), 0
    if step < config.steps:
        say(f"stopped at step {step}/{config.steps}; --resume continues")
        return None
    summary = _summary(config, history, elapsed, len(train_stream), len(held_out), model)
    weight_bytes = export_checkpoint(model, config.preset, tokenizer_json, out, config.dtype)
    summary["weight_bytes"] = weight_bytes
    summary["sample"] = {"prompt": SAMPLE_PROMPT, "completion": greedy_sample(model, tokenizer)}
    (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    write_loss_curve(history, out / "loss_curve.png", config.preset)
    write_card(summary, out / "README.md")
    say(f"wrote {out} ({weight_bytes / 1e6:.1f} MB of weights)")
    return summary


def _summary(
    config: TrainConfig,
    history: dict[str, Any],
    elapsed: float,
    train_tokens: int,
    held_out_tokens: int,
    model: DeepseekV3ForTraining,
) -> dict[str, Any]:
    first, last = Evaluation(**history["eval"][0]), Evaluation(**history["eval"][-1])
    tail = history["train"][-max(1, min(50, len(history["train"]))) :]
    return {
        "preset": config.preset,
        "config": asdict(config),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "runs": history["runs"],  # where each (re)start began, and its thread count
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": len(history["train"]),
        "tokens_seen": len(history["train"]) * config.tokens_per_step,
        "train_stream_tokens": train_tokens,
        "held_out_tokens": held_out_tokens,
        "wall_time_s": round(elapsed, 1),
        "final_train_loss": sum(r["loss"] for r in tail) / len(tail),
        "random_init_held_out_loss": first.loss,
        "random_init_held_out_perplexity": first.perplexity,
        "held_out_loss": last.loss,
        "held_out_perplexity": last.perplexity,
        "held_out_mtp_loss": last.mtp_loss,
        "expert_load_skew": last.load_skew,
        "history": history,
    }


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
    model: DeepseekV3ForTraining,
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
    command = (
        f"pdmesh model train DIR --preset {c['preset']} --steps {c['steps']} "
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
        "A DeepSeek-V3-architecture model (MLA, shared + routed experts with sigmoid routing and",
        "auxiliary-loss-free balancing"
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
            " (MTP included; embedding and head shared with it, stored twice in the checkpoint)"
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
