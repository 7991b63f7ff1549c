"""The model runtime shared by prefill and decode instances.

Data flow of one step:
    prompt ids + SamplingParams → Request → Scheduler.schedule() → SchedulerOutput
    → ModelRunner: ForwardBatch → DeepseekV3ForCausalLM (paged MLA cache, MoE on expert slots) →
      logits
    → Sampler → SampledToken → Scheduler.update_from_output() → StepOutput → OutputProcessor →
      CompletionOutput
With speculative decoding on (`EngineConfig.speculative_method`), the runner's `SpecDecoder`
verifies each decoding request's drafts in the same forward and proposes the next ones (MTP layer or
draft model): SchedulerOutput (+ drafts) → ForwardBatch → logits → acceptance → SpecTokens.

`LLM` is the offline front end; `EngineCore` is what services wrap. Exports load on first use, so
light users (the gateway's tokenizer, sampling validation) do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "pdmesh_engine.config",
    "EngineConfig": "pdmesh_engine.config",
    "ModelConfig": "pdmesh_engine.config",
    "EngineCore": "pdmesh_engine.engine_core",
    "LLM": "pdmesh_engine.llm",
    "CompletionOutput": "pdmesh_engine.llm",
    "SamplingParams": "pdmesh_engine.sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdmesh_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
