"""`pdmesh model train`: train a DeepSeek-V3 preset (or, with `--arch deepseek_v4`, a DeepSeek-V4
one) on the standard library's Python sources.

The run directory holds the run (`.train/`: the resumable state, the history) and, when it ends,
the Hugging Face checkpoint (`export.py`), `training.json` with the figures of the run, the loss
curve `loss_curve.png` and a model card `README.md`. Interrupted runs resume from the last saved
state (`--resume`), batch for batch: batches are a function of (seed, step).

Recipe: AdamW (betas 0.9/0.95, weight decay on matrices only), linear warmup then cosine decay to
`min_lr_ratio`, gradient clipping at 1, bf16 autocast where the CPU has native bf16; the loss is
next-token cross-entropy + `mtp_weight` x the MTP module's + `balance_weight` x the sequence-wise
balance loss; after every step each router's correction bias moves by `bias_gamma` towards equal
expert loads (DeepSeek-V3's auxiliary-loss-free balancing). DeepSeek-V4 adds its indexers' KL loss
(weight 1, it trains the Lightning Indexers only; `model_v4.py`), routes its hash layers by a frozen
random table, and always trains one MTP module.
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

from pdmesh.tools.model_init_v4 import V4_PRESETS, v4_preset_config
from pdmesh.tools.presets import PRESETS, preset_model_config
from pdmesh.tools.tokenizer_train import train_bpe
from pdmesh.train.data import TokenStream, split, stdlib_sources
from pdmesh.train.export import export_checkpoint, export_v4_checkpoint
from pdmesh.train.model import DeepseekV3ForTraining
from pdmesh.train.model_v4 import DeepseekV4ForTraining, LossesV4
from pdmesh.train.report import SAMPLE_PROMPT, greedy_sample, write_card, write_loss_curve
from pdmesh_engine.cpu_dtype import has_native_bf16
from pdmesh_engine.model.deepseek_v4.config import V4Config

STATE_DIR = ".train"
ARCH_PRESETS = {"deepseek_v3": PRESETS, "deepseek_v4": V4_PRESETS}
TrainingModel = DeepseekV3ForTraining | DeepseekV4ForTraining


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "coder"
    arch: str = "deepseek_v3"  # deepseek_v3 | deepseek_v4
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
        if self.arch not in ARCH_PRESETS:
            raise ValueError(f"arch must be one of {sorted(ARCH_PRESETS)}, got {self.arch!r}")
        if self.preset not in ARCH_PRESETS[self.arch]:
            raise ValueError(
                f"unknown {self.arch} preset {self.preset!r}; "
                f"choose from {sorted(ARCH_PRESETS[self.arch])}"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def use_bf16(self) -> bool:
        return self.autocast == "bf16" or (self.autocast == "auto" and has_native_bf16())


def v4_config_json(preset: str, dtype: str) -> dict[str, Any]:
    """config.json (transformers' spelling) of a DeepSeek-V4 preset as trained: one MTP module."""
    return {**v4_preset_config(preset, dtype), "num_nextn_predict_layers": 1}


def new_model(config: TrainConfig) -> TrainingModel:
    """The untrained model of `config`'s arch and preset (weights not initialised)."""
    if config.arch == "deepseek_v4":
        return DeepseekV4ForTraining(V4Config.from_dict(v4_config_json(config.preset, "float32")))
    return DeepseekV3ForTraining(preset_model_config(config.preset))


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


def _optimizer(model: TrainingModel, config: TrainConfig) -> torch.optim.AdamW:
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
    model: TrainingModel, stream: TokenStream, config: TrainConfig, step: int
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
    """The settings a resumed run must share (the thread count may change; a setting saved before
    it existed counts as its default)."""
    return {k: v for k, v in {**asdict(TrainConfig()), **config}.items() if k != "threads"}


class Trainer:
    """One training run in `out_dir` (module docstring): `run(until)` trains, saves and, at the
    last step, writes the checkpoint and its report."""

    def __init__(
        self,
        out_dir: str | Path,
        config: TrainConfig,
        *,
        resume: bool = False,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.out, self.config = Path(out_dir).expanduser(), config
        self.state_path = self.out / STATE_DIR / "state.pt"
        if self.out.exists() and any(self.out.iterdir()) and not resume:
            raise FileExistsError(
                f"{self.out} is not empty (pass --resume to continue a run there)"
            )
        if resume and not self.state_path.is_file():
            raise FileNotFoundError(f"{self.state_path}: no saved run to resume")
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        if config.threads:
            torch.set_num_threads(config.threads)
        if config.arch == "deepseek_v4":  # squares of tiny gradients in AdamW's second moments
            torch.set_flush_denormal(True)  # are denormal floats; they slowed its steps severalfold
        self.progress = Progress(config.steps)
        self.say = log or self.progress.message
        self._init_data()
        self._init_model(resume)

    def _init_data(self) -> None:
        """The tokenizer (trained on the train files once per run, kept in the run's state
        folder) and both token streams."""
        vocab_size = ARCH_PRESETS[self.config.arch][self.config.preset]["vocab_size"]
        train_files, held_out_files = split(stdlib_sources())
        path = self.state_path.parent / "tokenizer.json"
        if not path.is_file():
            texts = [f.text for f in train_files]
            path.write_text(train_bpe(texts, vocab_size), encoding="utf-8")
        self.tokenizer_json = path.read_text(encoding="utf-8")
        self.tokenizer = Tokenizer.from_str(self.tokenizer_json)
        self.train_stream = TokenStream(train_files, self.tokenizer)
        self.held_out = TokenStream(held_out_files, self.tokenizer)
        self.say(
            f"data: {len(train_files)} train files ({len(self.train_stream):,} tokens), "
            f"{len(held_out_files)} held-out files ({len(self.held_out):,} tokens)"
        )

    def _init_model(self, resume: bool) -> None:
        """A seeded model and optimizer, then the saved state when resuming (else the held-out
        loss at initialisation, the baseline of the card)."""
        config = self.config
        torch.manual_seed(config.seed)
        self.model = new_model(config)
        self.model.init_weights(config.seed)
        self.optimizer = _optimizer(self.model, config)
        self.history: dict[str, Any] = {"train": [], "eval": []}
        self.step, self.elapsed = 0, 0.0
        if resume:
            saved = torch.load(self.state_path, weights_only=False)
            if _without_threads(saved["config"]) != _without_threads(asdict(config)):
                raise ValueError(
                    f"{self.state_path} was saved with other settings: {saved['config']}"
                )
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.step, self.elapsed, self.history = (
                saved["step"],
                saved["elapsed_s"],
                saved["history"],
            )
            self.say(f"resuming at step {self.step}/{config.steps}")
        else:
            initial = evaluate(self.model, self.held_out, config, 0)
            self.history["eval"].append(asdict(initial))
            self.say(
                f"step 0: held-out loss {initial.loss:.3f} (perplexity {initial.perplexity:,.0f})"
            )
        self.history.setdefault("runs", []).append(
            {"start_step": self.step, "threads": torch.get_num_threads()}
        )
        self.say(
            f"training {config.arch} {config.preset}: "
            f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M parameters, "
            f"{config.steps} steps of {config.tokens_per_step} tokens, "
            f"bf16 autocast {'on' if config.use_bf16() else 'off'}"
        )

    def run(self, until: int | None = None) -> dict[str, Any] | None:
        """Train to the last step (or `until`, saving there); the summary at the last step."""
        config = self.config
        self.model.train()
        window_start, window_tokens = time.perf_counter(), 0
        stop = min(config.steps, until or config.steps)
        while self.step < stop:
            record = self._train_step()
            window_tokens += config.tokens_per_step
            rate = window_tokens / max(time.perf_counter() - window_start, 1e-9)
            eta = (config.steps - self.step) * self.elapsed / self.step
            self.progress.update(self.step, record["loss"], record["mtp_loss"], rate, eta)
            if self.step % config.eval_every == 0 or self.step == config.steps:
                self._evaluate()
            if self.step % config.save_every == 0 or self.step == stop:
                self._save()
                window_start, window_tokens = time.perf_counter(), 0
        if self.step < config.steps:
            self.say(f"stopped at step {self.step}/{config.steps}; --resume continues")
            return None
        return self._finish()

    def _train_step(self) -> dict[str, float]:
        """One optimizer step and the balancing-bias update; its record in the history."""
        config, model, t0 = self.config, self.model, time.perf_counter()
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(config, self.step)
        batch = self.train_stream.batch(config.batch_size, config.seq_len, config.seed, self.step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.use_bf16()):
            losses = model(batch)
            loss = losses.total(config.mtp_weight, config.balance_weight)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        self.optimizer.step()
        model.update_balance_bias(losses.routing, config.bias_gamma)
        self.elapsed += time.perf_counter() - t0
        record = {
            "step": self.step + 1,
            "loss": losses.lm.item(),
            "mtp_loss": losses.mtp.item(),
            "balance_loss": losses.balance.item(),
            "grad_norm": grad_norm,
            "lr": learning_rate(config, self.step),
        }
        if isinstance(losses, LossesV4):
            record["indexer_loss"] = losses.indexer.item()
        self.step += 1
        self.history["train"].append(record)
        return record

    def _evaluate(self) -> None:
        ev = evaluate(self.model, self.held_out, self.config, self.step)
        self.history["eval"].append(asdict(ev))
        self.say(
            f"step {self.step}: held-out loss {ev.loss:.3f} (perplexity {ev.perplexity:.1f}), "
            f"mtp {ev.mtp_loss:.3f}, busiest expert / mean {max(ev.load_skew, default=1.0):.2f}"
        )

    def _save(self) -> None:
        """The resumable state, replaced atomically."""
        state = {
            "config": asdict(self.config),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "elapsed_s": self.elapsed,
            "history": self.history,
        }
        tmp = self.state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)

    def _export(self) -> int:
        """The checkpoint in the run directory; returns the weights' bytes."""
        config, model, out = self.config, self.model, self.out
        if isinstance(model, DeepseekV4ForTraining):
            cfg = v4_config_json(config.preset, config.dtype)
            return export_v4_checkpoint(model, cfg, self.tokenizer_json, out, config.dtype)
        return export_checkpoint(model, config.preset, self.tokenizer_json, out, config.dtype)

    def _finish(self) -> dict[str, Any]:
        """Export the checkpoint, then training.json, the loss curve and the card."""
        out, config, model = self.out, self.config, self.model
        summary = _summary(
            config, self.history, self.elapsed, len(self.train_stream), len(self.held_out), model
        )
        weight_bytes = self._export()
        summary["weight_bytes"] = weight_bytes
        summary["sample"] = {
            "prompt": SAMPLE_PROMPT,
            "completion": greedy_sample(model, self.tokenizer),
        }
        (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        write_loss_curve(self.history, out / "loss_curve.png", config.preset)
        write_card(summary, out / "README.md")
        self.say(f"wrote {out} ({weight_bytes / 1e6:.1f} MB of weights)")
        return summary


def train(
    out_dir: str | Path,
    config: TrainConfig,
    *,
    resume: bool = False,
    until: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """Train `config.preset` into `out_dir` (module docstring); the summary `training.json`
    holds, or None when `until` stopped the run before its last step (`resume` continues it)."""
    return Trainer(out_dir, config, resume=resume, log=log).run(until)


def _summary(
    config: TrainConfig,
    history: dict[str, Any],
    elapsed: float,
    train_tokens: int,
    held_out_tokens: int,
    model: TrainingModel,
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
