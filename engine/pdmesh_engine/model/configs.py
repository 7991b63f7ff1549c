"""A checkpoint's family and hyper-parameters from its config.json alone (torch-free: the gateway
reads it too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdmesh_engine.config import ModelConfig, read_json
from pdmesh_engine.model.deepseek_v4.config import V4Config


def is_v4(raw: dict[str, Any]) -> bool:
    """Whether a parsed config.json is DeepSeek-V4's (architectures, else model_type)."""
    archs = raw.get("architectures") or []
    return "DeepseekV4ForCausalLM" in archs or (
        not archs and raw.get("model_type") == "deepseek_v4"
    )


def read_model_config(model_dir: str | Path) -> ModelConfig | V4Config:
    """A checkpoint's config.json, parsed by its family."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        return ModelConfig.from_dir(path)  # its errors name what is missing
    raw = read_json(path / "config.json")
    return V4Config.from_dict(raw) if is_v4(raw) else ModelConfig.from_dict(raw)


def check_mesh_model(model_dir: str | Path) -> None:
    """CheckpointError unless the mesh serves the checkpoint: its config.json parses as its
    family's (DeepSeek-V3 and V4 both run with one rank or under DEP), checked before any process
    starts. A directory without one is left to the loader's errors."""
    if (Path(model_dir) / "config.json").is_file():
        read_model_config(model_dir)
