"""Recursive-doubling all-reduce over torch.distributed point-to-point, and the per-step DP sync.

A DEP instance's ranks run, every step, a tiny all-reduce of integers (`[has_work, num_tokens,
...]`, int64, at most 8 elements) so that they all run the same number of forward passes. gloo's
`all_reduce` is a ring whose latency grows linearly with the ranks; recursive doubling needs about
log2(p) message rounds.

Schedule (`recursive_doubling_schedule`, pure): p ranks, q = the largest power of two <= p, r = p -
q.
  - fold (only when r > 0): rank q + i sends its data to rank i (i < r), which combines it; ranks
    q..p-1 then sit out;
  - log2(q) exchange rounds among ranks 0..q-1: in round k, rank j and j XOR 2^k swap their partial
    results and both combine (after round k every rank holds the reduction of its aligned 2^(k+1)
    block);
  - unfold (only when r > 0): rank i sends the result back to rank q + i, which takes it as is.
Every rank's schedule lists every round (an idle step where it has nothing to do), so its length is
`num_rounds(p)` = log2(p) for a power of two, floor(log2(p)) + 2 otherwise, and 0 for p = 1.

Contracts of `recursive_doubling_all_reduce(tensor, group, op)`:
  - in place on `tensor` (any layout; CPU tensors for gloo); every rank of `group` must call it with
    the same shape, dtype and op, and no other point-to-point traffic on the same tags (0..rounds-1)
    may be in flight on that group;
  - ops: "sum", "max", "min"; integer sums are exact (int64 adds, wrapping only where int64 wraps);
  - every rank ends with bitwise the same values (each combine is commutative on equal operands,
    and the unfold copies), floats included;
  - returns the rounds of the schedule it went through (= `num_rounds(world)` on every rank).

`DPSync` is what the engine calls every step: `make_dp_sync("gloo" | "recursive_doubling" |
"all_to_all", group)`; "all_to_all" (every rank to every rank) is the one an elastic DEP group uses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
import torch.distributed as dist

Phase = Literal["fold", "exchange", "unfold"]
OPS = ("sum", "max", "min")


@dataclass(frozen=True)
class Step:
    """What one rank does in one round. `peer is None` ⇔ idle (then send = recv = combine = False).

    recv and combine: the received data is reduced into the local data; recv and not combine: it
    replaces the local data (the unfold). In an exchange both send and recv are set.
    """

    round: int
    phase: Phase
    peer: int | None
    send: bool
    recv: bool
    combine: bool


def _floor_pow2(world: int) -> int:
    return 1 << (world.bit_length() - 1)


def num_rounds(world: int) -> int:
    """Message rounds of the schedule: log2(p) for powers of two, floor(log2(p)) + 2 otherwise."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    q = _floor_pow2(world)
    return q.bit_length() - 1 + (2 if world > q else 0)


@lru_cache(maxsize=1024)
def _schedule(rank: int, world: int) -> tuple[Step, ...]:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank {rank}, world {world}")
    q = _floor_pow2(world)
    r = world - q
    idle = lambda n, phase: Step(n, phase, None, False, False, False)  # noqa: E731
    steps: list[Step] = []
    if r:  # fold: q + i -> i for i < r
        if rank >= q:
            steps.append(Step(0, "fold", rank - q, True, False, False))
        elif rank < r:
            steps.append(Step(0, "fold", rank + q, False, True, True))
        else:
            steps.append(idle(0, "fold"))
    first = len(steps)
    for k in range(q.bit_length() - 1):  # exchanges among 0..q-1
        if rank < q:
            steps.append(Step(first + k, "exchange", rank ^ (1 << k), True, True, True))
        else:
            steps.append(idle(first + k, "exchange"))
    if r:  # unfold: i -> q + i for i < r
        n = len(steps)
        if rank >= q:
            steps.append(Step(n, "unfold", rank - q, False, True, False))
        elif rank < r:
            steps.append(Step(n, "unfold", rank + q, True, False, False))
        else:
            steps.append(idle(n, "unfold"))
    return tuple(steps)


def recursive_doubling_schedule(rank: int, world: int) -> list[Step]:
    """This rank's steps, one per round (idle rounds included): `len(...) == num_rounds(world)`."""
    return list(_schedule(rank, world))


def _combiner(op: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if op == "sum":
        return lambda acc, other: acc.add_(other)
    if op == "max":
        return lambda acc, other: torch.maximum(acc, other, out=acc)
    if op == "min":
        return lambda acc, other: torch.minimum(acc, other, out=acc)
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _global_steps(group: dist.ProcessGroup | None) -> list[tuple[Step, int]]:
    """This rank's active steps in `group`, each with its peer as a global rank (what send/recv
    take)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group")
    steps = [s for s in _schedule(rank, world) if s.peer is not None]
    to_global = (lambda g: g) if group is None else (lambda g: dist.get_global_rank(group, g))
    return [(s, to_global(s.peer)) for s in steps]


def _run_steps(
    work: torch.Tensor,
    buf: torch.Tensor,
    steps: list[tuple[Step, int]],
    group: dist.ProcessGroup | None,
    combine: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Execute the active steps in order. `work` is contiguous; `buf` has its shape and dtype."""
    for step, peer in steps:
        if step.send and step.recv:
            # Both posted before either wait: the peer does the same, so neither blocks the other.
            requests = [
                dist.isend(work, peer, group=group, tag=step.round),
                dist.irecv(buf, peer, group=group, tag=step.round),
            ]
            for request in requests:
                request.wait()  # the send too: `work` must not change while it is read
        elif step.send:
            dist.send(work, peer, group=group, tag=step.round)
        else:
            dist.recv(buf, peer, group=group, tag=step.round)
        if step.recv:
            if step.combine:
                combine(work, buf)
            else:
                work.copy_(buf)


def recursive_doubling_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: str = "sum"
) -> int:
    """Reduce `tensor` in place across `group` (default: the world); returns the schedule's
    rounds."""
    combine = _combiner(op)
    steps = _global_steps(group)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    if steps:
        _run_steps(work, torch.empty_like(work), steps, group, combine)
    if work is not tensor:
        tensor.copy_(work)
    return num_rounds(dist.get_world_size(group))


class DPSync(ABC):
    """Per-step DP sync of an instance: every rank calls `all_reduce` with the same shape and
    dtype."""

    def __init__(self, group: dist.ProcessGroup | None = None, op: str = "sum") -> None:
        _combiner(op)  # validates op
        self.group, self.op = group, op

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Reduce `tensor` (CPU, at most a few elements) in place across the group."""


class GlooAllReduce(DPSync):
    """torch.distributed's own `all_reduce` (gloo: a ring)."""

    _OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=self._OPS[self.op], group=self.group)


class RecursiveDoublingAllReduce(DPSync):
    """`recursive_doubling_all_reduce` with the peers resolved once and the receive buffer
    reused."""

    def __init__(self, group: dist.ProcessGroup | None = None, op: str = "sum") -> None:
        super().__init__(group, op)
        self.rounds = num_rounds(dist.get_world_size(group))
        self._steps = _global_steps(group)
        self._combine = _combiner(op)
        self._buf: torch.Tensor | None = None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if not self._steps:
            return
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        buf = self._buf
        if (
            buf is None
            or buf.shape != work.shape
            or buf.dtype != work.dtype
            or buf.device != work.device
        ):
            buf = self._buf = torch.empty_like(work)
        _run_steps(work, buf, self._steps, self.group, self._combine)
        if work is not tensor:
            tensor.copy_(work)


class AllToAllReduce(DPSync):
    """Every rank sends its tensor to every other one (`all_to_all_single`) and reduces the p
    copies. p - 1 messages per rank instead of log2(p), but every rank talks to every rank in
    every sync: a dead peer fails the sync on every survivor at once (its connection is reset),
    which an elastic DEP group needs (a ring or recursive doubling would leave the ranks not paired
    with it waiting on the ones that failed, until the group's timeout)."""

    def __init__(self, group: dist.ProcessGroup | None = None, op: str = "sum") -> None:
        super().__init__(group, op)
        self.world = dist.get_world_size(group)
        self._combine = _combiner(op)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.world == 1:
            return
        flat = tensor.reshape(-1)
        send = flat.repeat(self.world)  # [p * k]: the same row to every rank
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        rows = recv.view(self.world, -1)
        result = rows[0].clone()
        for row in rows[1:]:  # rank order on every rank: the same bits everywhere
            self._combine(result, row)
        tensor.copy_(result.view_as(tensor))


DP_SYNC_IMPLS: dict[str, type[DPSync]] = {
    "gloo": GlooAllReduce,
    "recursive_doubling": RecursiveDoublingAllReduce,
    "all_to_all": AllToAllReduce,
}


def make_dp_sync(name: str, group: dist.ProcessGroup | None = None, op: str = "sum") -> DPSync:
    """The DP sync called `name` ("gloo" or "recursive_doubling") on `group` (default: the
    world)."""
    try:
        impl = DP_SYNC_IMPLS[name]
    except KeyError:
        raise ValueError(f"unknown DP sync {name!r}; choose from {sorted(DP_SYNC_IMPLS)}") from None
    return impl(group, op)
