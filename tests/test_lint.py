"""The repository stays ruff-formatted, ruff-clean and mypy-clean (strict where pyproject says).

Each test runs the tool from the repository root with the configuration in pyproject.toml, using the
executables next to this interpreter (the project's virtualenv); a missing tool skips its test.
Nothing is written into the tree: ruff runs without its cache, mypy's cache goes to a temp dir.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TIMEOUT_S = 600
OUTPUT_TAIL_CHARS = 6000
# The strict set of [tool.mypy] overrides: the service scaffolding and the pure cores.
MYPY_TARGETS = [
    "-p",
    "pdmesh_service",
    *("-m", "pdmesh_gateway.core"),
    *("-m", "pdmesh_gateway.router"),
    *("-m", "pdmesh_gateway.autoscale"),
    *("-m", "pdmesh_gateway.load_window"),
    *("-m", "pdmesh_kvstore.core"),
    *("-m", "pdmesh_decode.core"),
    *("-m", "pdmesh_prefill.core"),
    *("-m", "pdmesh_eplb.planner"),
    *("-m", "pdmesh_eplb.controller"),
]


def _tool(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable}")
    return path


def _run(args: list[str]) -> None:
    """Run `args` in the repository root; fail with the tail of its output unless it exits 0."""
    done = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    output = (done.stdout + done.stderr)[-OUTPUT_TAIL_CHARS:]
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{output}"


def test_ruff_format() -> None:
    _run([str(_tool("ruff")), "format", "--check", "--no-cache", "."])


def test_ruff_check() -> None:
    _run([str(_tool("ruff")), "check", "--no-cache", "."])


def test_mypy_strict_modules(tmp_path: Path) -> None:
    _run([str(_tool("mypy")), "--cache-dir", str(tmp_path / "mypy-cache"), *MYPY_TARGETS])
