"""The contract: generated code matches the protos, every RPC and field is documented, and the
services' pure cores import no transport."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "protos").rglob("*.proto"))
_FIELD = re.compile(r"^\s*(optional |repeated )?[\w.]+ \w+ = \d+;")
_RPC = re.compile(r"^\s*rpc \w+\(")
_ENUM_VALUE = re.compile(r"^\s*[A-Z_0-9]+ = \d+;")


def test_committed_generated_code_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", PROTOS, ids=lambda p: p.name)
def test_every_rpc_field_and_enum_value_has_a_doc_comment(path: Path) -> None:
    lines = path.read_text().splitlines()
    undocumented = [
        line.strip()
        for number, line in enumerate(lines)
        if (_FIELD.match(line) or _RPC.match(line) or _ENUM_VALUE.match(line))
        and not lines[number - 1].strip().startswith("//")
    ]
    assert not undocumented, undocumented


def test_protos_are_versioned_packages() -> None:
    assert PROTOS
    for path in PROTOS:
        package = re.search(r"^package ([\w.]+);", path.read_text(), re.M).group(1)
        assert re.fullmatch(r"pdmesh\.\w+\.v\d+", package), (path.name, package)


@pytest.mark.parametrize(
    "module",
    [
        "pdmesh_gateway.core",
        "pdmesh_gateway.router",
        "pdmesh_kvstore.core",
        "pdmesh_decode.core",
        "pdmesh_prefill.core",
        "pdmesh_engine.scheduler",
        "pdmesh_eplb.controller",
        "pdmesh_eplb.planner",
        "pdmesh_service.eplb_protocol",
        "pdmesh_service.handoff",
    ],
)
def test_pure_cores_import_no_transport(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in ('grpc', 'redis', 'nixl') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", (module, result.stdout)
