"""A checkpoint's family and hyper-parameters from its config.json alone (torch-free: the gateway
reads it too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdmesh_engine.config import CheckpointError, ModelConfig, read_json
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


def check_mesh_model(model_dir: str | Path, dep: int = 1) -> None:
    """CheckpointError unless the mesh serves the checkpoint's architecture with `dep` ranks per
    instance (read from config.json; a directory without one is left to the loader's errors)."""
    path = Path(model_dir) / "config.json"
    if dep > 1 and path.is_file() and is_v4(read_json(path)):
        raise CheckpointError(
            f"{model_dir}: DeepSeek-V4 does not run under DEP yet (data-parallel attention with "
            "expert parallelism); serve it with one rank per instance (no --dep)"
        )
