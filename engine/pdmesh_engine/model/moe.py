"""DeepSeekMoE: group-limited sigmoid routing over logical experts, executed on physical slots.

Logical experts (what the router picks) map to physical slots (where weights live) through an
`ExpertPlacement`: a slot holds one logical expert, a logical expert has one or more replicas.
The placement is data: an `ExpertDispatcher` sends each (token, expert) pair to the slot chosen for
it and combines the weighted results, so expert parallelism and EPLB change data, not code.

Legend: T tokens, D hidden, K experts per token, E logical experts, P physical slots, I expert
width.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.model.deepseek_v3.layers import DenseMLP
from pdmesh_engine.model.experts import routed_experts, to_row_tables


@dataclass(frozen=True)
class ExpertPlacement:
    """Which logical expert each physical slot of one MoE layer holds.

    Invariant: every logical expert has at least one slot. Replicas of expert e are
    `replicas[e, :replica_counts[e]]`, in slot order.
    """

    physical_to_logical: torch.Tensor  # [P] int64
    replicas: torch.Tensor  # [E, max_replicas] int64 (rows padded by repeating the first slot)
    replica_counts: torch.Tensor  # [E] int64, >= 1

    @classmethod
    def from_slots(cls, physical_to_logical: list[int], num_logical: int) -> ExpertPlacement:
        slots_of: list[list[int]] = [[] for _ in range(num_logical)]
        for slot, expert in enumerate(physical_to_logical):
            if not 0 <= expert < num_logical:
                raise ValueError(f"slot {slot} holds expert {expert}, outside [0, {num_logical})")
            slots_of[expert].append(slot)
        missing = [e for e, s in enumerate(slots_of) if not s]
        if missing:
            raise ValueError(f"experts {missing[:8]} have no slot")
        width = max(len(s) for s in slots_of)
        cpu = torch.device("cpu")
        replicas = torch.tensor(
            [s + [s[0]] * (width - len(s)) for s in slots_of], dtype=torch.int64, device=cpu
        )
        return cls(
            torch.tensor(physical_to_logical, dtype=torch.int64, device=cpu),
            replicas,
            torch.tensor([len(s) for s in slots_of], dtype=torch.int64, device=cpu),
        )

    def to(self, device: torch.device) -> ExpertPlacement:
        return ExpertPlacement(
            self.physical_to_logical.to(device),
            self.replicas.to(device),
            self.replica_counts.to(device),
        )

    @classmethod
    def initial(cls, num_logical: int, num_redundant: int = 0) -> ExpertPlacement:
        """Static layout: slot i holds expert i; redundant slots repeat experts 0, 1, 2, ..."""
        return cls.from_slots(
            [i % num_logical for i in range(num_logical + num_redundant)], num_logical
        )

    @property
    def num_physical(self) -> int:
        return int(self.physical_to_logical.shape[0])

    @cached_property
    def is_identity(self) -> bool:
        """Slot i holds expert i and nothing is replicated: slots are the logical ids."""
        return bool(
            torch.equal(self.physical_to_logical.cpu(), torch.arange(self.replicas.shape[0]))
        )

    def choose_slots(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Map logical ids [T, K] to slots [T, K]; the replica is chosen by token index
        (deterministic)."""
        if self.is_identity:
            return expert_ids
        token_index = torch.arange(expert_ids.shape[0], device=expert_ids.device)[:, None]
        replica = token_index % self.replica_counts[expert_ids]
        return self.replicas[expert_ids, replica]


class Router(nn.Module):
    """Sigmoid scores, corrected by a bias for the choice only; top-k within the best groups."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))
        self.top_k, self.n_group, self.topk_group = (
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
        )
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, K] fp32, logical expert ids [T, K] int64)."""
        weight, bias = self.weight, self.e_score_correction_bias  # fp32 (the runner keeps them so)
        if weight.dtype != torch.float32:
            weight, bias = weight.float(), bias.float()
        scores = F.linear(x if x.dtype == torch.float32 else x.float(), weight).sigmoid()  # [T, E]
        choice = scores + bias
        if self.topk_group < self.n_group:  # keep the experts of the best topk_group groups
            grouped = choice.view(x.shape[0], self.n_group, -1)  # [T, G, E / G]
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, G]
            group_ids = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, False)
            choice = grouped.masked_fill(dropped[:, :, None], float("-inf")).view_as(choice)
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, expert_ids


class ExpertDispatcher(ABC):
    """Runs the routed experts for a batch: send tokens to their slots, compute, combine."""

    @abstractmethod
    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slot_ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        """x [T, D], weights [T, K], slot_ids [T, K] (global slots) -> [T, D] weighted sum.
        `swiglu_limit`: the experts' SwiGLU clamp (DeepSeek-V4; `experts.swiglu`)."""


class LocalDispatcher(ExpertDispatcher):
    """All slots live in this process (DEP 1): `routed_experts`."""

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slot_ids: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        return routed_experts(x, weights, slot_ids, w13, w2, swiglu_limit)


class ExpertLoadRecorder:
    """Tokens routed to each physical slot, per MoE layer, for the last `window` steps (a ring).

    `restart()` (at a placement switch) empties the ring: counts recorded under one placement are
    never summed with counts under another (slot ids mean different experts). `step` keeps counting
    globally (DEP ranks restart at the same step, so their rings stay aligned); `restart_step` is
    its value then.
    """

    def __init__(
        self,
        num_layers: int,
        num_physical: int,
        window: int = 1000,
        device: torch.device | str = "cpu",
    ) -> None:
        if window < 1:
            raise ValueError(f"expert load window must be >= 1, got {window}")
        # Kept on the model's device: recording is a scatter-add there, with no host sync in the
        # step.
        self.counts = torch.zeros(
            window, num_layers, num_physical, dtype=torch.int64, device=device
        )
        self.step = 0  # steps recorded so far; the current row is step % window
        self.restart_step = 0  # `step` at the last restart
        self._current = torch.zeros(num_layers, num_physical, dtype=torch.int64, device=device)

    def record(self, layer: int, slot_ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Count slot_ids [T, K]; `valid` [T] int64 0/1: count only rows with 1 (the padding rows of
        a CUDA-graph bucket have 0)."""
        ids = slot_ids.flatten()
        if valid is None:
            counts = torch.ones_like(ids)
        else:
            counts = valid[:, None].expand_as(slot_ids).flatten()
        self._current[layer].scatter_add_(0, ids, counts)

    @property
    def current(self) -> torch.Tensor:
        """[num_layers, P] the counts of the step being recorded (kernels may add to it in
        place)."""
        return self._current

    def end_step(self) -> None:
        self.counts[self.step % self.counts.shape[0]] = self._current
        self._current.zero_()
        self.step += 1

    def restart(self) -> None:
        """Forget every recorded step (a new placement starts its own window)."""
        self.counts.zero_()
        self._current.zero_()
        self.restart_step = self.step

    def resize(self, num_physical: int) -> None:
        """Count `num_physical` slots per layer from now on (an elastic DEP instance re-split its
        slots); restarts the ring."""
        num_layers, device = self._current.shape[0], self._current.device
        self.counts = torch.zeros(
            self.window, num_layers, num_physical, dtype=torch.int64, device=device
        )
        self._current = torch.zeros(num_layers, num_physical, dtype=torch.int64, device=device)
        self.restart()

    @property
    def steps_since_restart(self) -> int:
        return self.step - self.restart_step

    @property
    def window(self) -> int:
        return int(self.counts.shape[0])

    def window_totals(self) -> torch.Tensor:
        """[num_layers, P] tokens per slot over the recorded window."""
        return self.counts.sum(0)


EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")  # one expert's checkpoint tensors


class PlacedExperts(nn.Module):
    """One MoE layer's routed experts on this process's physical slots: their weights, the
    placement that maps logical experts to slots, and the dispatcher that runs them. What the MoE
    layers of DeepSeek-V3 (`MoE`) and V4 (`deepseek_v4.blocks.MoE`) share; placement switches
    (pdmesh_engine.parallel.placement) work on it.

    `moe_index`: this layer's index among the model's MoE layers (its row in an
    `ExpertLoadRecorder`).
    """

    def __init__(
        self,
        hidden: int,
        width: int,
        placement: ExpertPlacement,
        dispatcher: ExpertDispatcher,
        local_slots: range,
        moe_index: int,
    ) -> None:
        super().__init__()
        # [P_local, 2I, D]
        self.w13 = nn.Parameter(torch.zeros(len(local_slots), 2 * width, hidden))
        # [P_local, D, I]
        self.w2 = nn.Parameter(torch.zeros(len(local_slots), hidden, width))
        self.dispatcher, self.local_slots, self.moe_index = dispatcher, local_slots, moe_index
        self.placement = placement
        self._slot_experts: list[int] = placement.physical_to_logical.tolist()

    def use_row_tables(self) -> None:
        """Store w13/w2 in the row-table layout of the CPU expert path (`experts.to_row_tables`):
        same shapes and values (copied), transposed in memory. Slot writes keep the layout."""
        for name in ("w13", "w2"):
            param = getattr(self, name)
            setattr(self, name, nn.Parameter(to_row_tables(param.data), param.requires_grad))

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Adopt a new logical→physical map (at a step boundary; moved weights are copied
        separately)."""
        self.placement = placement.to(self.w13.device)
        self._slot_experts = placement.physical_to_logical.tolist()

    def load_expert(self, logical: int, part: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (gate_proj / up_proj / down_proj of `logical`) into its local
        slots."""
        for slot in self.local_slots:
            if self._slot_experts[slot] == logical:
                self.write_slot(slot - self.local_slots.start, part, tensor)

    @property
    def slot_experts(self) -> list[int]:
        """The logical expert of every physical slot under the running placement (a host copy)."""
        return list(self._slot_experts)

    def write_slot(self, local: int, part: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into local slot `local` (see `write_expert_part`)."""
        write_expert_part(self.w13.data, self.w2.data, local, part, tensor)


class MoE(PlacedExperts):
    """DeepSeek-V3's MoE layer: routed experts (on this process's slots) plus always-on shared
    experts."""

    def __init__(
        self,
        config: ModelConfig,
        placement: ExpertPlacement,
        dispatcher: ExpertDispatcher,
        local_slots: range,
        moe_index: int,
    ) -> None:
        width = config.moe_intermediate_size
        super().__init__(config.hidden_size, width, placement, dispatcher, local_slots, moe_index)
        self.gate = Router(config)
        self.shared_experts = (
            DenseMLP(config.hidden_size, width * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def forward(
        self, x: torch.Tensor, expert_load: ExpertLoadRecorder | None = None
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]; with `expert_load`, the tokens routed to each slot are recorded
        there."""
        weights, expert_ids = self.gate(x)
        slot_ids = self.placement.choose_slots(expert_ids)
        if expert_load is not None:
            expert_load.record(self.moe_index, slot_ids)
        out = self.dispatcher(x, weights, slot_ids, self.w13, self.w2)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


@torch.no_grad()
def write_expert_part(
    w13: torch.Tensor, w2: torch.Tensor, index: int, part: str, tensor: torch.Tensor
) -> None:
    """The one place that knows the slot layout: w13[index] = [gate_proj; up_proj] ([2I, D]),
    w2[index] = down_proj ([D, I]). `w13`/`w2` are a layer's weights or staging buffers of the same
    layout."""
    width = w2.shape[2]
    if part == "gate_proj":
        w13[index, :width].copy_(tensor)
    elif part == "up_proj":
        w13[index, width:].copy_(tensor)
    elif part == "down_proj":
        w2[index].copy_(tensor)
    else:
        raise ValueError(f"unknown expert tensor {part!r}; expected one of {EXPERT_PARTS}")
