"""The model families the engine serves, and the one place that tells them apart: a
checkpoint's config.json names its architecture; `family_of` gives the runner its family (load the
weights, size the KV, build the KV manager)."""

from __future__ import annotations

from pathlib import Path

from pdmesh_engine.config import ModelConfig, read_json
from pdmesh_engine.model.deepseek_v3.runtime import V3Family
from pdmesh_engine.model.deepseek_v4.config import V4Config
from pdmesh_engine.model.deepseek_v4.runtime import V4Family

Family = V3Family | V4Family


def read_model_config(model_dir: str | Path) -> ModelConfig | V4Config:
    """A checkpoint's config.json, parsed by its family (architectures, else model_type)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        return ModelConfig.from_dir(path)  # its errors name what is missing
    raw = read_json(path / "config.json")
    archs = raw.get("architectures") or []
    if "DeepseekV4ForCausalLM" in archs or (not archs and raw.get("model_type") == "deepseek_v4"):
        return V4Config.from_dict(raw)
    return ModelConfig.from_dict(raw)


def family_of(model_config: ModelConfig | V4Config) -> Family:
    """The model family of a parsed config (the one place that tells them apart)."""
    if isinstance(model_config, V4Config):
        return V4Family(model_config)
    return V3Family(model_config)
