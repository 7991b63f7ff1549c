"""The cost file `pdmesh sim` runs on (`pdmesh bench costs` measures one; a GPU rack's can be
written from published figures): what a step, a hand-off and a request's path cost.

The step model. A rank whose step computes T new tokens, which attend A context positions in all
(A = sum over the new tokens of the positions each attends), takes

    base(T) + attn_s_per_token_ctx * A_decode + prefill_attn_s_per_token_ctx * A_prefill

(base: piecewise linear over the measured points; a prefill token's attention may cost more per
position than a decode token's: V4's indexer scores every compressed entry of a chunk)

A DEP instance of D ranks steps in lockstep: rank i's dense part (attention and the rest) runs on
its own T_i tokens, the MoE layers on everyone's tokens spread over the D ranks, as unevenly as the
expert placement's balancedness b (mean rank load / max rank load) says, then the ranks sync:

    (1 - s) * max_i base(T_i) + max_i attention_i + s * base(sum T / D) / b + allreduce_s[D]

with s the MoE share of a step (`moe.share`); for D = 1 this is the single-rank formula. CPU
files (`hardware.kind` "cpu") also say how many cores the ranks share: the simulator slows a step
by (busy threads / cores) when more threads than cores are busy, and by `corun_slowdown` when
another rank computes beside it (measured: two busy processes on one host slow each other).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1


@dataclass(frozen=True)
class StepCurve:
    """One rank's step time by new tokens (`tokens` ascending), measured at short context."""

    dep: int
    threads: int | None
    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    attn_s_per_token_ctx: float = 0.0
    prefill_attn_s_per_token_ctx: float | None = None  # None: the decode slope

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.seconds) or not self.tokens:
            raise ValueError("a step curve needs as many `seconds` as `tokens` (at least one)")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise ValueError(f"step `tokens` must be ascending and >= 1, got {list(self.tokens)}")
        if min(self.seconds) <= 0 or min(self.attn_s_per_token_ctx, self.prefill_attn) < 0:
            raise ValueError("step `seconds` must be > 0 and the attention slopes >= 0")

    @property
    def prefill_attn(self) -> float:
        if self.prefill_attn_s_per_token_ctx is None:
            return self.attn_s_per_token_ctx
        return self.prefill_attn_s_per_token_ctx

    def attention(self, work: Sequence[int]) -> float:
        """Seconds of a rank's (tokens, decode A[, prefill A]) attention."""
        prefill = work[2] if len(work) > 2 else 0
        return self.attn_s_per_token_ctx * work[1] + self.prefill_attn * prefill

    def base(self, num_tokens: float) -> float:
        """Seconds of a step of `num_tokens` new tokens (linear between points, and past the ends
        along the nearest segment; never below the smallest point's time over 2)."""
        xs, ys = self.tokens, self.seconds
        if len(xs) == 1:
            return ys[0] * max(num_tokens, 1) / xs[0] if num_tokens > xs[0] else ys[0]
        i = min(max(bisect.bisect_left(xs, num_tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0), ys[0] / 2)


@dataclass(frozen=True)
class Overheads:
    request_s: float = 0.0  # client → a rank's queue, plus the last token → client
    handoff_s: float = 0.0  # a P→D hand-off besides moving its bytes (Reserve, Decode admission)
    # per decode-rank step, besides the engine step (the worker loop, streaming), by the rank's
    # torch threads (the nearest count measured; key 0 or a plain number: any)
    token_s: Mapping[int, float] = field(default_factory=lambda: {0: 0.0})
    # per sequence a decode-rank step streams (gRPC and the gateway's SSE per token), by threads
    sequence_s: Mapping[int, float] = field(default_factory=lambda: {0: 0.0})

    def token(self, threads: int | None) -> float:
        return _nearest(self.token_s, threads)

    def sequence(self, threads: int | None) -> float:
        return _nearest(self.sequence_s, threads)


def _nearest(by_threads: Mapping[int, float], threads: int | None) -> float:
    return by_threads[min(by_threads, key=lambda t: (abs(t - (threads or 0)), t))]


@dataclass(frozen=True)
class Costs:
    name: str
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    curves: tuple[StepCurve, ...]
    cores: int | None = None  # CPU: the cores every rank shares; None: a device per rank
    corun_slowdown: float = 1.0  # CPU: a step beside another busy rank takes this much longer
    allreduce_s: Mapping[int, float] = field(default_factory=dict)
    kv_latency_s: float = 0.0
    kv_bytes_per_s: float = float("inf")
    overheads: Overheads = Overheads()
    moe_share: float = 0.0
    # "eplb" / "none" → {DEP size: mean / max rank load}; the nearest size at or below is used
    balancedness: Mapping[str, Mapping[int, float]] = field(
        default_factory=lambda: {"eplb": {1: 1.0}, "none": {1: 1.0}}
    )
    source: str = ""

    def curve(self, dep: int, threads: int | None) -> StepCurve:
        """The curve measured at this DEP size and thread count, else the nearest: same DEP
        first, then DEP 1; among those the closest thread count."""
        for wanted in (dep, 1):
            found = [c for c in self.curves if c.dep == wanted]
            if found:
                return min(found, key=lambda c: abs((c.threads or 0) - (threads or 0)))
        return self.curves[0]

    def step_s(
        self,
        ranks: Sequence[Sequence[int]],
        threads: int | None = None,
        eplb: bool = True,
    ) -> float:
        """One lockstep step of an instance whose ranks compute (new tokens, positions their
        decode tokens attend[, positions their prefill tokens attend]) each (module docstring)."""
        dep = len(ranks)
        curve = self.curve(dep, threads)
        if dep == 1:
            return curve.base(ranks[0][0]) + curve.attention(ranks[0])
        share = self.moe_share
        balance = self.balance(dep, eplb)
        dense = max(curve.base(w[0]) for w in ranks) * (1 - share)
        attention = max(curve.attention(w) for w in ranks)
        moe = share * curve.base(sum(w[0] for w in ranks) / dep) / balance
        return dense + attention + moe + self.allreduce(dep)

    def balance(self, dep: int, eplb: bool = True) -> float:
        """Balancedness of the MoE load over `dep` ranks (1: even)."""
        by_dep = self.balancedness["eplb" if eplb else "none"]
        below = [d for d in by_dep if d <= dep]
        return by_dep[max(below)] if below else by_dep[min(by_dep)]

    def allreduce(self, dep: int) -> float:
        if dep <= 1:
            return 0.0
        if dep in self.allreduce_s:
            return self.allreduce_s[dep]
        known = sorted(self.allreduce_s.items())
        if not known:
            return 0.0
        below = [kv for kv in known if kv[0] < dep]
        size, seconds = below[-1] if below else known[0]
        return seconds * max(dep.bit_length() - 1, 1) / max(size.bit_length() - 1, 1)

    def transfer_s(self, num_tokens: int) -> float:
        """A hand-off of `num_tokens` tokens' KV: latency, bytes over bandwidth, fixed overhead."""
        moved = num_tokens * self.kv_bytes_per_token / self.kv_bytes_per_s
        return self.kv_latency_s + moved + self.overheads.handoff_s


def load_costs(path: str | Path) -> Costs:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    try:
        return parse_costs(data)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a cost file: missing or wrong {e}") from None


def parse_costs(data: Mapping[str, Any]) -> Costs:
    if data.get("version") != VERSION:
        raise ValueError(f"cost file version {data.get('version')!r}; this pdmesh reads {VERSION}")
    model, engine, hardware = data["model"], data["engine"], data.get("hardware", {})
    curves = tuple(
        StepCurve(
            int(s["dep"]),
            None if s.get("threads") is None else int(s["threads"]),
            tuple(int(t) for t in s["tokens"]),
            tuple(float(x) for x in s["seconds"]),
            float(s.get("attn_s_per_token_ctx", 0.0)),
            _optional_float(s.get("prefill_attn_s_per_token_ctx")),
        )
        for s in data["steps"]
    )
    if not curves:
        raise ValueError("the cost file has no `steps`")
    kv = data.get("kv_transfer", {})
    moe = data.get("moe", {})
    balance = {
        kind: _by_dep(moe.get("balancedness", {}).get(kind, 1.0)) for kind in ("eplb", "none")
    }
    if not 0 <= float(moe.get("share", 0.0)) <= 1:
        raise ValueError("moe.share must be in [0, 1]")
    if any(not 0 < b <= 1 for by_dep in balance.values() for b in by_dep.values()):
        raise ValueError("moe.balancedness values must be in (0, 1]")
    return Costs(
        name=str(model.get("name", "")),
        block_size=int(model["block_size"]),
        kv_bytes_per_token=int(model.get("kv_bytes_per_token", 0)),
        max_model_len=int(model["max_model_len"]),
        num_kv_blocks=int(model["num_kv_blocks"]),
        max_num_seqs=int(engine["max_num_seqs"]),
        max_num_batched_tokens=int(engine["max_num_batched_tokens"]),
        curves=curves,
        cores=int(hardware["cores"]) if hardware.get("kind", "cpu") == "cpu" else None,
        corun_slowdown=float(hardware.get("corun_slowdown", 1.0)),
        allreduce_s={int(k): float(v) for k, v in data.get("allreduce_s", {}).items()},
        kv_latency_s=float(kv.get("latency_s", 0.0)),
        kv_bytes_per_s=float(kv.get("bytes_per_s") or float("inf")),
        overheads=_overheads(data.get("overheads", {})),
        moe_share=float(moe.get("share", 0.0)),
        balancedness=balance,
        source=str(data.get("source", "")),
    )


def _by_dep(value: float | Mapping[str, float]) -> dict[int, float]:
    """A balancedness for every DEP size (a number), or per DEP size ({"4": 0.9, ...})."""
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("moe.balancedness: an empty mapping")
        return {int(k): float(v) for k, v in value.items()}
    return {1: float(value)}


def _overheads(data: Mapping[str, Any]) -> Overheads:
    by_threads = {key: _by_threads(data.get(key, 0.0), key) for key in ("token_s", "sequence_s")}
    return Overheads(
        float(data.get("request_s", 0.0)),
        float(data.get("handoff_s", 0.0)),
        by_threads["token_s"],
        by_threads["sequence_s"],
    )


def _by_threads(value: float | Mapping[str, float], key: str) -> dict[int, float]:
    """A number (any thread count) or {threads: seconds}."""
    found = (
        {int(k): float(v) for k, v in value.items()}
        if isinstance(value, Mapping)
        else {0: float(value)}
    )
    if not found or min(found.values()) < 0:
        raise ValueError(f"overheads.{key}: a number or {{threads: seconds}}, all >= 0")
    return found


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
