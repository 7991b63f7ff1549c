"""The `pdmesh` command's model default: the embedded trained checkpoint (`coder-v4`)."""

from __future__ import annotations

from pathlib import Path


def resolve_model(model: Path | None) -> Path:
    """The given directory, or the embedded default model."""
    if model is not None:
        return model
    from pdmesh_engine.checkpoint import embedded_model_dir

    return embedded_model_dir()
