"""Expert parallelism over torch.distributed: `AllToAllDispatcher` sends tokens to the ranks owning
their slots.

Physical slots are split evenly and contiguously: with n ranks and P_local = P / n slots each, rank
r owns global slots [r * P_local, (r + 1) * P_local) (its `w13`/`w2` hold exactly those, in order).
Every rank of the group calls the dispatcher once per MoE layer per forward pass, with T >= 0
tokens.

Data chain (one MoE layer call, on every rank):
  x [T, D], weights [T, K], slot_ids [T, K] (global slots)
  -> plan: one row per (token, destination rank) with >= 1 of its slots there (deduplicated),
     destination-major then token order: token_of_row [S], meta [S, 2K] (per k: the local slot or
     -1, then the fp32 routing weight's bits as int64), send_counts [n]
  -> counts exchange   all_to_all_single(send_counts [n]) -> recv_counts [n]
  -> rows exchange     x[token_of_row] [S, D] -> received [R, D];  meta [S, 2K] -> [R, 2K]
  -> expert compute    (owner) valid pairs sorted by local slot -> expert_rows -> * weight
                       -> index_add per received row -> partial [R, D] fp32
  -> reverse exchange  partial [R, D] -> back [S, D] fp32 (each row to the rank it came from)
  -> combine           (source) index_add of back into token_of_row -> [T, D] fp32 -> x's dtype

Expert outputs are summed per token in slot order (slots ascend with ranks, pairs of a rank ascend
by slot), so fp32 results agree with the single-process path up to rounding.

Legend: T tokens on this rank, D hidden, K experts per token, n ranks, P_local slots per rank,
S rows sent, R rows received, N (row, slot) pairs received.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pdmesh_engine.model.experts import expert_rows
from pdmesh_engine.model.moe import ExpertDispatcher


@dataclass
class DispatchStats:
    """Host wall time per phase, accumulated over calls (cheap `perf_counter`; a GPU backend must
    sync first).

    `dispatch_s` includes waiting for slower ranks at the first collective, so imbalance shows up
    there.
    """

    calls: int = 0
    dispatch_s: float = 0.0  # plan + counts, rows and pairs exchanges
    compute_s: float = 0.0  # this rank's experts on the received rows
    combine_s: float = 0.0  # reverse exchange + per-token sum
    rows_sent: int = 0
    rows_received: int = 0

    @property
    def total_s(self) -> float:
        return self.dispatch_s + self.compute_s + self.combine_s

    def reset(self) -> None:
        for name, value in asdict(DispatchStats()).items():
            setattr(self, name, value)

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total_s": self.total_s}


@dataclass(frozen=True)
class SendPlan:
    # [S] int64, source token of each row (destination-major, then token order)
    token_of_row: torch.Tensor
    meta: torch.Tensor  # [S, 2K] int64: local slot at the destination or -1, then fp32 weight bits
    send_counts: torch.Tensor  # [n] int64, rows per destination rank


def plan_rows(
    weights: torch.Tensor, slot_ids: torch.Tensor, slots_per_rank: int, world: int
) -> SendPlan:
    """Rows to send: each token once per destination rank owning at least one of its slots."""
    dest = torch.div(slot_ids, slots_per_rank, rounding_mode="floor")  # [T, K]
    present = F.one_hot(dest, world).any(dim=1)  # [T, n]
    rank_of_row, token_of_row = present.t().nonzero(as_tuple=True)  # [S], [S]
    mine = dest[token_of_row] == rank_of_row[:, None]  # [S, K]
    local = torch.where(mine, slot_ids[token_of_row] - rank_of_row[:, None] * slots_per_rank, -1)
    row_weights = torch.where(mine, weights[token_of_row].float(), 0.0)
    bits = row_weights.contiguous().view(torch.int32).long()  # exact round trip
    return SendPlan(token_of_row, torch.cat((local, bits), dim=1), present.sum(dim=0))


def run_local_experts(
    received: torch.Tensor,
    meta: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """received [R, D], meta [R, 2K] -> partial [R, D] fp32: each row's weighted sum over its local
    slots (their SwiGLU clamped at `swiglu_limit` when set)."""
    top_k = meta.shape[1] // 2
    local = meta[:, :top_k]
    weights = meta[:, top_k:].to(torch.int32).view(torch.float32)  # [R, K]
    row, k = (local >= 0).nonzero(as_tuple=True)  # [N] pairs
    slots, order = torch.sort(local[row, k], stable=True)
    row_sorted = row[order]
    expert_out = expert_rows(received[row_sorted], slots, w13, w2, swiglu_limit)  # [N, D]
    weighted = expert_out.float() * weights[row, k][order][:, None]
    partial = torch.zeros(
        received.shape[0], received.shape[1], dtype=torch.float32, device=received.device
    )
    return partial.index_add_(0, row_sorted, weighted)


def _exchange(
    send: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """all_to_all_single of rows: send [sum(send_counts), ...] -> [sum(recv_counts), ...]."""
    out = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=group)
    return out


class AllToAllDispatcher(ExpertDispatcher):
    """Expert parallelism with `all_to_all_single` on a torch.distributed group (gloo on CPU
    tensors).

    Contract: every rank of `group` calls it for the same MoE layers in the same order (the DEP
    lockstep guarantees it); `w13`/`w2` are this rank's P_local slots; `slot_ids` are global slots
    in [0, n * P_local).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.stats = DispatchStats()
        self.rebind(group)

    def rebind(self, group: dist.ProcessGroup | None) -> None:
        """Run on `group` from the next call (an elastic DEP instance re-formed its group; the MoE
        layers keep this object, their `w13`/`w2` are re-split to the new size separately)."""
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slot_ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        start = time.perf_counter()
        plan = plan_rows(weights, slot_ids.long(), w13.shape[0], self.world)
        recv_counts = torch.empty_like(plan.send_counts)
        dist.all_to_all_single(recv_counts, plan.send_counts, group=self.group)
        sends, recvs = plan.send_counts.tolist(), recv_counts.tolist()
        received = _exchange(x[plan.token_of_row], sends, recvs, self.group)  # [R, D]
        meta = _exchange(plan.meta, sends, recvs, self.group)  # [R, 2K]
        dispatched = time.perf_counter()
        partial = run_local_experts(received, meta, w13, w2, swiglu_limit)  # [R, D] fp32
        computed = time.perf_counter()
        back = _exchange(partial, recvs, sends, self.group)  # [S, D] fp32
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, plan.token_of_row, back)
        self._account(start, dispatched, computed, sum(sends), sum(recvs))
        return out.to(x.dtype)

    def _account(
        self, start: float, dispatched: float, computed: float, sent: int, received: int
    ) -> None:
        stats = self.stats
        stats.calls += 1
        stats.dispatch_s += dispatched - start
        stats.compute_s += computed - dispatched
        stats.combine_s += time.perf_counter() - computed
        stats.rows_sent += sent
        stats.rows_received += received


# Registry of expert-parallel backends (name -> constructor taking the group); a GPU all-to-all
# (NCCL / DeepEP-style) registers here too.
DISPATCHERS: dict[str, Callable[[dist.ProcessGroup | None], ExpertDispatcher]] = {
    "all_to_all": AllToAllDispatcher
}


def make_dispatcher(name: str, group: dist.ProcessGroup | None = None) -> ExpertDispatcher:
    """The expert dispatcher called `name` on `group` (default: the world)."""
    try:
        impl = DISPATCHERS[name]
    except KeyError:
        raise ValueError(
            f"unknown expert dispatcher {name!r}; choose from {sorted(DISPATCHERS)}"
        ) from None
    return impl(group)
