"""The control plane stays torch-free however it is started: `pdmesh serve <gateway|kvstore|eplb>`
goes through the `pdmesh` command, whose modules also serve the workers' options (import-linter
checks the packages; this checks the command's path, where a worker option module once pulled
torch into every control-plane process: ~200 MB each)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
sys.argv = ["pdmesh", "serve", {service!r}, "--help"]
import pdmesh.cli.main as cli
try:
    cli.main()
except SystemExit:
    pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH")
"""


@pytest.mark.parametrize("service", ["gateway", "kvstore", "eplb"])
def test_serving_a_control_plane_service_imports_no_torch(service: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(service=service)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1] == "NO-TORCH"
