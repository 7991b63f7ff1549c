"""The model runtime shared by prefill and decode instances.

Data flow of one step:
    prompt ids + SamplingParams → Request → Scheduler.schedule() → SchedulerOutput
    → ModelRunner: ForwardBatch → DeepseekV3ForCausalLM (paged MLA cache, MoE on expert slots) → logits
    → Sampler → SampledToken → Scheduler.update_from_output() → StepOutput → OutputProcessor → CompletionOutput

`LLM` is the offline front end; `EngineCore` is what services wrap.
"""
from __future__ import annotations

from pdmesh.engine.config import CheckpointError, EngineConfig, ModelConfig
from pdmesh.engine.engine_core import EngineCore
from pdmesh.engine.llm import LLM, CompletionOutput
from pdmesh.engine.sampling import SamplingParams

__all__ = ["CheckpointError", "CompletionOutput", "EngineConfig", "EngineCore", "LLM", "ModelConfig",
           "SamplingParams"]
