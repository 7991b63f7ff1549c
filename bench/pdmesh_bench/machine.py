"""What the machine can do, and what a decode step asks of it: shared by the `pdmesh bench`
commands.

Machine peaks, measured in the same process as the benchmark (median of repeats):

    matmul FLOP/s    = 2 * n^3 / time of one fp32 `torch.mm` of two n x n matrices (n = 2048)
    memory bytes/s   = 3 * nbytes / time of `torch.add(a, b, out=c)` over fp32 arrays of `mib`
                       MiB each (a and b read, c written; write-allocate traffic not counted)

Decode cost model (`DecodeCostModel`), for one step of T single-token decodes whose sequences hold
ctx_1..ctx_T tokens (the new one included). Parameters are split as the forward pass reads them:
embedding (one row per token), lm_head (always read whole), routed experts (per MoE layer, each a
SwiGLU of 3 matrices), and everything else ("dense": attention projections, norms, router, dense
MLP layers, shared experts). MTP layers are not counted (the plain forward does not run them).

    active params per token = dense + lm_head + num_moe_layers * top_k * params_per_expert
    FLOPs per step          = 2 * active * T + attention
    attention FLOPs         = sum_t 2 * num_layers * heads * (2 * kv_lora_rank + rope_dim) * ctx_t
                              (absorbed MLA: scores over latent + rope key, values over the latent)
    expected experts used   = E * (1 - (1 - k / E)^T)  per MoE layer (uniform, independent routing)
    weight bytes per step   = (dense + lm_head + T * hidden + num_moe_layers * experts_used
                               * params_per_expert) * bytes_per_param
    KV bytes per step       = sum_t ctx_t * kv_bytes_per_token
    bytes per step          = weight bytes + KV bytes (activations are not counted)

Absorbed decode multiplies queries by W_UK and outputs by W_UV, which together are kv_b_proj, so
counting kv_b_proj once as a matmul is exact. The fractions reported are achieved / measured peak,
where achieved = sum of the modelled FLOPs (or bytes) over decode-only steps / their total time.

The memory peak of a shared machine moves from minute to minute (on the 2-core VM these figures
come from, the same 2-thread read ran at 28 GB/s and at 60 GB/s ten minutes apart), so a peak
measured once at the start of a run may not be the one the decode steps met minutes later. The
engine bench therefore also measures it just before and just after each of its engine runs
(`memory_beside`) and reports the bandwidth fraction against those too: each run's peak the mean of
its two measures, the runs weighted by their decode seconds.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MachinePeaks:
    matmul_flops_per_s: float
    memory_bytes_per_s: float
    matmul_size: int
    memory_mib: int
    threads: int
    repeats: int

    def to_dict(self) -> dict:
        return asdict(self)

    def measure_memory_again(self) -> float:
        """The memory peak measured now as it was for these peaks (same arrays, same repeats)."""
        return measure_memory_bandwidth(self.memory_mib, self.repeats)


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    return statistics.median(time_calls(fn, repeats, warmup))


def measure_matmul_flops(n: int = 2048, repeats: int = 7) -> float:
    """Peak fp32 matmul rate: 2 n^3 / median time of `torch.mm` of two n x n matrices."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    out = torch.empty(n, n)
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b, out=out), repeats)


def measure_memory_bandwidth(mib: int = 256, repeats: int = 7) -> float:
    """Streaming bandwidth: 3 arrays' bytes (2 read, 1 written) / median time of `torch.add`."""
    numel = (mib << 20) // 4
    a = torch.ones(numel)
    b = torch.ones(numel)
    c = torch.empty(numel)
    return 3 * a.nbytes / _median_seconds(lambda: torch.add(a, b, out=c), repeats)


def measure_peaks(quick: bool = False) -> MachinePeaks:
    size, mib = (512, 32) if quick else (2048, 256)
    repeats = 3 if quick else 7
    return MachinePeaks(
        measure_matmul_flops(size, repeats),
        measure_memory_bandwidth(mib, repeats),
        size,
        mib,
        torch.get_num_threads(),
        repeats,
    )


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op threads (None: leave torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--torch-threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc); falls back to the peak elsewhere."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def rss_snapshot() -> dict[str, int]:
    return {"rss_bytes": current_rss_bytes(), "peak_rss_bytes": peak_rss_bytes()}


@dataclass(frozen=True)
class DecodeCostModel:
    """Parameter counts of a loaded engine model and the formulas of the module docstring."""

    dense_params: int  # attention, norms, router, dense MLPs, shared experts (read every step)
    lm_head_params: int
    hidden_size: int
    params_per_expert: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    bytes_per_param: int
    kv_bytes_per_token: int

    @classmethod
    def from_model(cls, model: nn.Module, kv_bytes_per_token: int) -> DecodeCostModel:
        """`model` is the engine's DeepseekV3ForCausalLM (MTP layers and the embedding are left
        out)."""
        c = model.config
        dense = experts = 0
        for name, param in model.named_parameters():
            if (
                name.startswith("mtp.")
                or name.startswith("embed_tokens.")
                or name.startswith("lm_head.")
            ):
                continue
            if name.endswith(".mlp.w13") or name.endswith(".mlp.w2"):
                experts += param.numel()
            else:
                dense += param.numel()
        num_moe = len(model.moe_layers)
        per_expert = experts // max(num_moe * c.n_routed_experts, 1)
        return cls(
            dense,
            model.lm_head.weight.numel(),
            c.hidden_size,
            per_expert,
            num_moe,
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.kv_lora_rank,
            c.qk_rope_head_dim,
            model.lm_head.weight.element_size(),
            kv_bytes_per_token,
        )

    @property
    def active_params(self) -> int:
        """Matmul parameters one token uses (embedding lookup excluded)."""
        return (
            self.dense_params
            + self.lm_head_params
            + self.num_moe_layers * self.top_k * self.params_per_expert
        )

    def experts_used(self, num_tokens: int) -> float:
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)

    def flops(self, contexts: Iterable[int]) -> float:
        ctx = list(contexts)
        per_ctx = 2 * self.num_layers * self.num_heads * (2 * self.kv_lora_rank + self.rope_dim)
        return 2.0 * self.active_params * len(ctx) + per_ctx * sum(ctx)

    def bytes(self, contexts: Iterable[int]) -> float:
        ctx = list(contexts)
        params = (
            self.dense_params
            + self.lm_head_params
            + len(ctx) * self.hidden_size
            + self.num_moe_layers * self.experts_used(len(ctx)) * self.params_per_expert
        )
        return params * self.bytes_per_param + sum(ctx) * self.kv_bytes_per_token

    def to_dict(self) -> dict:
        return {**asdict(self), "active_params_per_token": self.active_params}


def roofline(
    cost: DecodeCostModel,
    steps: list[tuple[float, list[int]]],
    peaks: MachinePeaks,
    memory_beside: float | None = None,
) -> dict:
    """Achieved FLOP/s and bytes/s over decode steps [(seconds, contexts)], and their fraction of
    the peaks (and of `memory_beside`, the memory peak measured beside the steps, when given)."""
    seconds = sum(s for s, _ in steps)
    if not steps or seconds <= 0:
        return {}
    flops = sum(cost.flops(ctx) for _, ctx in steps) / seconds
    traffic = sum(cost.bytes(ctx) for _, ctx in steps) / seconds
    return {
        "decode_flops_per_s": flops,
        "decode_bytes_per_s": traffic,
        "flops_fraction_of_peak": flops / peaks.matmul_flops_per_s,
        "bandwidth_fraction_of_peak": traffic / peaks.memory_bytes_per_s,
        **(
            {
                "memory_bytes_per_s_beside": memory_beside,
                "bandwidth_fraction_beside": traffic / memory_beside,
            }
            if memory_beside
            else {}
        ),
    }


def memory_beside(runs: list[tuple[float, float, float]]) -> float | None:
    """The memory peak beside runs [(decode seconds, bytes/s measured just before the run, just
    after it)]: each run's mean of the two, weighted by its seconds (None without seconds)."""
    seconds = sum(s for s, _, _ in runs)
    if seconds <= 0:
        return None
    return sum(s * (before + after) / 2 for s, before, after in runs) / seconds


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]
