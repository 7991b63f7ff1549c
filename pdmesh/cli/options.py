"""The `pdmesh` command's model default: the cached default checkpoint, generated on first use."""

from __future__ import annotations

from pathlib import Path


def resolve_model(model: Path | None) -> Path:
    """The given directory, or the cached default model (generated once)."""
    if model is not None:
        return model
    from pdmesh.tools.model_init import default_model_dir

    return default_model_dir()
