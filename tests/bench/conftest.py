"""Shared fixtures of the benchmark tests: a tiny checkpoint, and torch's thread count restored
after each test (benchmarks set it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdmesh.tools.model_init import init_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("bench") / "tiny", "tiny")


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
