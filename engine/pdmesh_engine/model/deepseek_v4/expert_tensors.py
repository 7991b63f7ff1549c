"""One routed expert's tensor from a DeepSeek-V4 checkpoint, in any of its layouts: what a placement
switch reads into the slots whose expert changes (pdmesh_engine.parallel.placement, through
`DeepseekV4ForCausalLM.expert_source`).

- per-expert tensors: the release's `layers.N.ffn.experts.E.w1.weight` (w1 gate, w3 up, w2 down),
  with or without transformers' `model.` prefix; an FP8 or MXFP4 weight comes back dequantised
  with its `.scale`, as `quant.iter_v4_tensors` gives it at load;
- transformers' fused `mlp.experts.gate_up_proj` [E, 2I, D] / `mlp.experts.down_proj` [E, D, I]:
  the expert's rows.

Only the decoder's layers are indexed (the MTP layer's experts are not placed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdmesh_engine.config import CheckpointError
from pdmesh_engine.model.deepseek_v4.checkpoint_names import canonical, expert_part
from pdmesh_engine.model.deepseek_v4.quant import _block_size, _dequantize

if TYPE_CHECKING:
    from pdmesh_engine.parallel.placement import CheckpointTensors


class V4ExpertTensors:
    """`(layer, logical expert, part) -> tensor` (part: gate_proj / up_proj / down_proj) over a
    checkpoint's `CheckpointTensors`; quantised weights dequantised to fp32 (the slot's copy casts
    them to the model's dtype, as loading does)."""

    def __init__(self, tensors: CheckpointTensors) -> None:
        self.tensors = tensors
        self.block = _block_size(tensors.model_dir)
        # (layer, expert, part) -> the checkpoint's name of a per-expert tensor
        self.names: dict[tuple[int, int, str], str] = {}
        # (layer, "w13" | "w2_all") -> the checkpoint's name of a fused tensor
        self.fused: dict[tuple[int, str], str] = {}
        for name in tensors.files:
            found = expert_part(canonical(name))
            if found is None or not found[0].startswith("layers."):
                continue
            module, expert, which = found
            layer = int(module.split(".")[1])
            if expert < 0:
                self.fused[layer, which] = name
            else:
                self.names[layer, expert, which] = name

    def __call__(self, layer: int, expert: int, part: str) -> torch.Tensor:
        name = self.names.get((layer, expert, part))
        if name is not None:
            return self._read(name)
        fused = self.fused.get((layer, "w2_all" if part == "down_proj" else "w13"))
        if fused is None:
            raise CheckpointError(
                f"the checkpoint has no {part} of routed expert {expert} in layer {layer}"
            )
        rows = self.tensors(fused)[expert]
        if part == "down_proj":
            return rows
        width = rows.shape[0] // 2
        return rows[:width] if part == "gate_proj" else rows[width:]

    def _read(self, name: str) -> torch.Tensor:
        tensor = self.tensors(name)
        if tensor.dtype in (torch.float8_e4m3fn, torch.int8):
            scale = self.tensors(name.removesuffix(".weight") + ".scale")
            tensor = _dequantize(name, tensor, scale, torch.float32, self.block)
        return tensor
