"""Swapping the logical→physical expert placement of a running model, at a step boundary.

    new placements (one per MoE layer)
      -> per layer: the local slots whose logical expert changes
      -> their weights from `load_tensor(checkpoint name)` (the checkpoint via `CheckpointTensors`, or memory)
      -> copied into w13 [P_local, 2I, D] / w2 [P_local, D, I]; then `MoE.set_placement`

Contract: every DEP rank applies the same placements between the same two steps (no forward in flight);
each rank loads only the experts entering its own slots. The MTP layer follows the last MoE layer.

Legend: P_local slots on this rank, I expert width, D hidden.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
import torch
from safetensors import SafetensorError, safe_open

from pdmesh_engine.checkpoint import tensor_names
from pdmesh_engine.config import CheckpointError
from pdmesh_engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from pdmesh_engine.model.moe import EXPERT_PARTS, ExpertPlacement, MoE

TensorSource = Callable[[str], torch.Tensor]     # checkpoint tensor name -> tensor


def expert_tensor_name(checkpoint_layer: int, logical: int, part: str) -> str:
    return f"model.layers.{checkpoint_layer}.mlp.experts.{logical}.{part}.weight"


def moe_layers_by_checkpoint_index(model: DeepseekV3ForCausalLM) -> list[tuple[int, MoE]]:
    """(checkpoint layer index, MoE) for the decoder's MoE layers, then the MTP layers' (index L + j)."""
    out = [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
    base = model.config.num_hidden_layers
    out += [(base + j, mtp.block.mlp) for j, mtp in enumerate(model.mtp) if isinstance(mtp.block.mlp, MoE)]
    return out


class CheckpointTensors:
    """Reads single tensors by name from a safetensors checkpoint (header index built once)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.files = tensor_names(model_dir)

    def __call__(self, name: str) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                return handle.get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"{file}: cannot read {name!r} ({e})") from e


def _write_slot(moe: MoE, local: int, checkpoint_layer: int, logical: int, load_tensor: TensorSource) -> None:
    for part in EXPERT_PARTS:
        moe.write_slot(local, part, load_tensor(expert_tensor_name(checkpoint_layer, logical, part)))


def apply_placement(model: DeepseekV3ForCausalLM, new_placements: Sequence[ExpertPlacement],
                    load_tensor: TensorSource) -> int:
    """Adopt one placement per MoE layer (in `model.moe_layers` order); returns the local slots reloaded."""
    layers = moe_layers_by_checkpoint_index(model)
    num_decoder = len(model.moe_layers)
    if len(new_placements) != num_decoder:
        raise ValueError(f"need one placement per MoE layer ({num_decoder}), got {len(new_placements)}")
    reloaded = 0
    for index, (checkpoint_layer, moe) in enumerate(layers):
        placement = new_placements[min(index, num_decoder - 1)]
        if placement.num_physical != moe.placement.num_physical:
            raise ValueError(f"layer {checkpoint_layer}: placement has {placement.num_physical} slots, "
                             f"the model {moe.placement.num_physical}")
        old = moe.placement.physical_to_logical.tolist()
        new = placement.physical_to_logical.tolist()
        for slot in moe.local_slots:
            if old[slot] != new[slot]:
                _write_slot(moe, slot - moe.local_slots.start, checkpoint_layer, new[slot], load_tensor)
                reloaded += 1
        moe.set_placement(placement)
    return reloaded
