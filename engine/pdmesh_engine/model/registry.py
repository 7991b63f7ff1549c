"""The model families the engine serves, and the one place that tells them apart: a
checkpoint's config.json names its architecture; `family_of` gives the runner its family (load the
weights, size the KV, build the KV manager)."""

from __future__ import annotations

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.model.configs import read_model_config
from pdmesh_engine.model.deepseek_v3.runtime import V3Family
from pdmesh_engine.model.deepseek_v4.config import V4Config
from pdmesh_engine.model.deepseek_v4.runtime import V4Family

Family = V3Family | V4Family
__all__ = ["Family", "family_of", "read_model_config"]


def family_of(model_config: ModelConfig | V4Config) -> Family:
    """The model family of a parsed config (the one place that tells them apart)."""
    if isinstance(model_config, V4Config):
        return V4Family(model_config)
    return V3Family(model_config)
