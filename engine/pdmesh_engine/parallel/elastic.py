"""Elastic DEP: the survivors of a dead rank re-form the group without it and keep serving; a
restarted rank joins again.

    step k on every rank: schedule -> DP sync -> forward (MoE all-to-alls) -> update
      a collective raises (a peer died: its connection is reset; or the group's timeout)
        Every collective of an elastic group is an all-to-all (the DP sync is `AllToAllReduce`,
        the MoE layers' dispatch too), so every survivor talks to the dead rank in the very
        collective where it fails, or in the next one: all of them detect it within milliseconds.
        (A ring or recursive doubling would leave ranks not paired with it blocked on the ones
        that failed until the timeout: gloo's `abort()`, called too, does not unblock peers.)
        -> gather the survivors in the next epoch (`membership`; a store no rank hosts)
        -> destroy the old group, `init_process_group` on the epoch's TCPStore (served by its
           lowest member, on a free port), new dispatch group, DP sync, dispatcher rebound
        -> re-split the routed experts over the members (`reform_placement`: every member keeps
           the experts it holds, experts left without a replica go to the members with free
           slots; P' = the smallest multiple of the new size >= E + redundant slots), each
           member filling its new slots from its own memory or the checkpoint
        -> redo step k's forward with the SAME scheduler output (nothing of a failed step reached
           the scheduler: `update_from_output` runs only after the forward; the KV a partial
           forward wrote is rewritten at the same positions)
    A rank whose step k completed before the failure reached it fails in step k + 1's DP sync and
    redoes that one: ranks own their requests, so each redoes its own step; the lockstep only
    needs the same collective sequence from the re-form on, which every member starts afresh.

    growth: a restarted rank builds its engine, then asks to join; the group's first rank polls
    the store (every `join_poll_s`) and says so in the DP sync (`LockstepRecord.regroup`): every
    member re-forms after that step, with the joiner, and the experts are re-split again.

Limits: ranks may be lost one failure at a time down to one rank (each re-form needs a live
group; the records live in a store no rank hosts, so the first rank may be lost too). Each
survivor then holds P'/n' slots (more memory: 4 -> 3 ranks with 8 experts: 3 slots instead of 2).
The pause is detection (milliseconds for a dead process, `timeout_s` for a hung one) + gathering
(closed at once when all but one member of the old epoch arrived, else after `settle_s`) + the new
group's connect + loading the experts that had no live replica (measured: ~40 ms on the tiny model,
DEP4 -> DEP3 on 2 CPU cores; streams paused < 0.75 s end to end). A restarted rank's join pauses
the group for its connect and expert re-split, plus the joiner's start between its admission and
its first step. The re-split assumes eager CPU/gloo execution (no
CUDA graphs capturing the expert weights). A speculating rank redoes its step with fresh drafts
(greedy output is unchanged; a seeded sampled request may draw differently).
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pdmesh_engine.model.experts import to_row_tables
from pdmesh_engine.model.moe import EXPERT_PARTS, ExpertPlacement, PlacedExperts, write_expert_part
from pdmesh_engine.parallel.allreduce import make_dp_sync
from pdmesh_engine.parallel.dep import DEPConfig, DEPContext, _backend_name
from pdmesh_engine.parallel.membership import Gather, Membership, MembershipStore, Plan
from pdmesh_engine.parallel.placement import ExpertModel, moe_layers_by_checkpoint_index

if TYPE_CHECKING:
    from pdmesh_engine.engine_core import EngineCore

ELASTIC_DP_SYNC = "all_to_all"  # pdmesh_engine.parallel.allreduce.AllToAllReduce


@dataclass(frozen=True)
class ElasticConfig:
    """How a rank re-forms its group. `member`: its stable id (its rank at start); `size`: the
    ranks the instance started with; `addr`: where it serves an epoch's TCPStore when it leads."""

    member: int
    size: int
    store: MembershipStore
    addr: str = "127.0.0.1"
    settle_s: float = 1.0
    wait_s: float = 60.0
    join_poll_s: float = 1.0


def num_physical_for(num_logical_plus_redundant: int, size: int) -> int:
    """P' for `size` ranks: the smallest multiple of `size` >= E + redundant slots."""
    return -(-num_logical_plus_redundant // size) * size


def reform_placement(
    row: Sequence[int],
    old_members: Sequence[int],
    new_members: Sequence[int],
    num_logical: int,
    num_physical: int,
) -> list[int]:
    """One MoE layer's placement over `new_members` (pure, the same on every member).

    row [P]: the running placement, split contiguously over `old_members`. Each new member keeps
    the experts of its old slots (in order, up to its P'/n' slots; a joiner holds none), experts
    with no kept replica fill the free slots (the member with the most free slots first), then
    free slots take replicas of the experts with the fewest (ties: the lowest id). -> [P'].
    """
    size = len(new_members)
    if num_physical % size:
        raise ValueError(f"{num_physical} slots do not split over {size} ranks")
    per_old, per_new = len(row) // len(old_members), num_physical // size
    held = {m: list(row[i * per_old : (i + 1) * per_old]) for i, m in enumerate(old_members)}
    slots = [list(dict.fromkeys(held.get(m, [])))[:per_new] for m in new_members]
    kept = {e for member_slots in slots for e in member_slots}
    for expert in (e for e in range(num_logical) if e not in kept):
        rank = max(range(size), key=lambda r: (per_new - len(slots[r]), -r))
        if len(slots[rank]) >= per_new:
            raise ValueError(f"{num_physical} slots cannot hold {num_logical} experts")
        slots[rank].append(expert)
    counts = Counter(e for member_slots in slots for e in member_slots)
    for member_slots in slots:
        while len(member_slots) < per_new:
            expert = min(range(num_logical), key=lambda e: (counts[e], e))
            member_slots.append(expert)
            counts[expert] += 1
    return [e for member_slots in slots for e in member_slots]


def plan_placements(
    expert_models: dict[str, ExpertModel],
    old_members: Sequence[int],
    new_members: Sequence[int],
    num_redundant: int,
) -> Plan:
    """{model name: [L'][P'] rows} for every placed MoE layer (V3's MTP layers included)."""
    plan: Plan = {}
    for name, expert_model in expert_models.items():
        layers = moe_layers_by_checkpoint_index(expert_model.model)
        if not layers:
            continue
        num_logical = expert_model.num_logical
        # the target's redundant slots stay; a draft model's only pad to a multiple of the ranks
        total = num_logical + (num_redundant if name == "target" else 0)
        num_physical = num_physical_for(total, len(new_members))
        plan[name] = [
            reform_placement(moe.slot_experts, old_members, new_members, num_logical, num_physical)
            for _, moe in layers
        ]
    return plan


@torch.no_grad()
def resplit_experts(
    expert_model: ExpertModel, rows: Sequence[Sequence[int]], rank: int, size: int
) -> tuple[int, int]:
    """Give this rank's MoE layers their new slots [rank * P'/n, (rank + 1) * P'/n) of `rows`:
    weights from its own old slots where it holds the expert, else from the checkpoint. Returns
    (slots copied, slots read from the checkpoint)."""
    layers = moe_layers_by_checkpoint_index(expert_model.model)
    if len(rows) != len(layers):
        raise ValueError(f"plan has {len(rows)} rows for {len(layers)} MoE layers")
    source = expert_model.stager.expert_source
    copied = loaded = 0
    for (checkpoint_layer, moe), row in zip(layers, rows, strict=True):
        per_rank = len(row) // size
        local = range(rank * per_rank, (rank + 1) * per_rank)
        c, n = _resplit_layer(moe, checkpoint_layer, list(row), local, source)
        copied, loaded = copied + c, loaded + n
    if expert_model.expert_load is not None:
        expert_model.expert_load.resize(len(rows[0]))
    return copied, loaded


def _resplit_layer(
    moe: PlacedExperts, checkpoint_layer: int, row: list[int], local: range, source: Any
) -> tuple[int, int]:
    old_experts = moe.slot_experts
    held = {}
    for slot in moe.local_slots:
        held.setdefault(old_experts[slot], slot - moe.local_slots.start)
    w13 = _like(moe.w13.data, len(local))
    w2 = _like(moe.w2.data, len(local))
    copied = loaded = 0
    for index, slot in enumerate(local):
        expert = row[slot]
        if expert in held:
            w13[index].copy_(moe.w13.data[held[expert]])
            w2[index].copy_(moe.w2.data[held[expert]])
            copied += 1
        else:
            for part in EXPERT_PARTS:
                write_expert_part(w13, w2, index, part, source(checkpoint_layer, expert, part))
            loaded += 1
    moe.w13 = nn.Parameter(w13, requires_grad=False)
    moe.w2 = nn.Parameter(w2, requires_grad=False)
    moe.local_slots = local
    num_logical = int(moe.placement.replica_counts.shape[0])
    moe.set_placement(ExpertPlacement.from_slots(row, num_logical))
    return copied, loaded


def _like(weight: torch.Tensor, num_slots: int) -> torch.Tensor:
    """An empty [num_slots, A, B] in `weight`'s dtype, device and layout (row tables or not)."""
    out = torch.zeros((num_slots, *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
    _, rows, cols = weight.shape
    return to_row_tables(out) if weight.stride() == (rows * cols, 1, rows) else out


def serve_store(addr: str, size: int, timeout: timedelta) -> tuple[dist.TCPStore, int]:
    """A TCPStore served by this process on a free port of `addr` (an epoch's rendezvous)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((addr, 0))
        listener.listen(size * 4)
        port = listener.getsockname()[1]
        store = dist.TCPStore(
            addr,
            port,
            size,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()
    return store, port


class ElasticGroup:
    """A rank's side of an elastic group: its epoch and members, and the re-form (module
    docstring). Engine thread only."""

    def __init__(self, config: ElasticConfig, context: DEPContext) -> None:
        if context.config.dp_sync != ELASTIC_DP_SYNC:
            raise ValueError(
                f"an elastic DEP group needs dp_sync={ELASTIC_DP_SYNC!r} (every rank talks to "
                f"every rank, so a dead one fails every survivor's sync), got "
                f"{context.config.dp_sync!r}"
            )
        self.config, self.context = config, context
        self.epoch = 0
        self.members: tuple[int, ...] = tuple(range(config.size))
        self.num_reforms = 0
        self.last_pause_s = 0.0  # wall time of the last re-form (gather, group, experts)
        self._served: dict[int, dist.TCPStore] = {}  # port -> the epoch store this rank serves
        self._next_poll = 0.0

    @property
    def rank(self) -> int:
        return self.members.index(self.config.member)

    @property
    def size(self) -> int:
        return len(self.members)

    def abort(self) -> None:
        """Abort this rank's groups: peers blocked on it fail now (their sockets close)."""
        for group in (self.context.dispatch_group, dist.group.WORLD):
            if group is not None:
                try:
                    group.abort()
                except RuntimeError:
                    pass

    def gather(self, epoch: int, plan: Any, num_lost: int) -> Membership:
        """Agree on `epoch` (`plan(old_members, new_members)` -> the record's plan, on the rank
        that closes it)."""
        config = self.config

        def serve(members: list[int]) -> tuple[str, int, Plan]:
            timeout = timedelta(seconds=self.context.config.timeout_s)
            store, port = serve_store(config.addr, len(members), timeout)
            self._served = {port: store}  # an older epoch's store is not needed any more
            return config.addr, port, plan(self.members, members)

        return config.store.gather(
            Gather(epoch, config.member, self.members, config.settle_s, config.wait_s, num_lost),
            serve,
        )

    def bind(self, record: Membership) -> None:
        """Leave the old group and join `record`'s (collective over its members)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        context = self.context
        timeout = timedelta(seconds=context.config.timeout_s)
        rank, size = record.rank_of(self.config.member), len(record.members)
        store = self._served.get(record.port) or dist.TCPStore(
            record.addr, record.port, size, False, timeout
        )
        backend = context.backend_name()
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        context.dispatch_group = dist.new_group(backend=backend)
        context.dispatcher.rebind(context.dispatch_group)  # type: ignore[attr-defined]
        context.dp_sync = make_dp_sync(context.config.dp_sync)
        self.epoch, self.members = record.epoch, record.members

    def reform(
        self, expert_models: dict[str, ExpertModel], num_redundant: int, failed: bool
    ) -> None:
        """Gather the next epoch, join its group and re-split every model's experts over it
        (after `abort` when a collective failed; at a step boundary when a rank joins)."""
        start = time.perf_counter()
        record = self.gather(
            self.epoch + 1,
            lambda old, new: plan_placements(expert_models, old, new, num_redundant),
            int(failed),
        )
        self.bind(record)
        for name, expert_model in expert_models.items():
            expert_model.stager.reset()  # staged buffers fit the old slots
            if name in record.plan:
                resplit_experts(expert_model, record.plan[name], self.rank, self.size)
        self.num_reforms += 1
        self.last_pause_s = time.perf_counter() - start

    def join_pending(self) -> bool:
        """The first rank, at most every `join_poll_s`: whether a rank asked to join."""
        if self.rank != 0 or time.monotonic() < self._next_poll:
            return False
        self._next_poll = time.monotonic() + self.config.join_poll_s
        return bool(self.config.store.pending_joins(self.members))


def join_elastic(
    config: DEPConfig, elastic: ElasticConfig
) -> tuple[DEPContext, Callable[[EngineCore], None]]:
    """A restarted rank: a `DEPContext` on a one-rank group to build its `EngineCore` with, and
    `finish(engine)`, which asks to join, waits until the group admits it (the members re-form at
    a step boundary), joins the group and takes its experts under the record's plan."""
    if dist.is_initialized():
        raise ValueError("a joining rank must not be in a process group yet")
    backend = _backend_name(config)
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=config.timeout_s),
    )
    context = DEPContext(config, dist.new_group(backend=backend), make_dp_sync(config.dp_sync))
    group = context.elastic = ElasticGroup(elastic, context)
    seen = elastic.store.current()

    def finish(engine: EngineCore) -> None:
        elastic.store.ask_to_join(elastic.member)
        record = elastic.store.wait_admitted(
            elastic.member, seen.epoch if seen is not None else 0, elastic.wait_s
        )
        group.bind(record)
        for name, expert_model in engine.expert_models.items():
            expert_model.stager.reset()
            if name in record.plan:
                resplit_experts(expert_model, record.plan[name], group.rank, group.size)
        if engine.lockstep is not None:
            engine.lockstep.rebind(context.dp_sync, group.size)

    return context, finish
