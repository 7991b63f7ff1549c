"""`pdmesh bench grammar` on a tiny setting: positive llguidance timings, and every walked path is
JSON that its schema validates (the walk really follows the grammars)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdmesh.cli.main import main
from pdmesh_bench.grammar import SCHEMAS, format_report, run_bench, xgrammar_available

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = "order"


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_grammar_bench_walks_valid_paths() -> None:
    report = run_bench(
        schemas={SCHEMA: SCHEMAS[SCHEMA]},
        batch_sizes=(2,),
        steps=2,
        compile_repeats=1,
        import_repeats=1,
    )
    libs = ["llguidance"] + (["xgrammar"] if xgrammar_available() else [])
    assert report["config"]["libraries"] == libs

    (imp,) = [r for r in report["imports"] if r["library"] == "llguidance"]
    assert _positive(imp["import_ms"])
    assert "transformers" not in imp["heavy_modules"]
    (comp,) = [r for r in report["compile"] if r["library"] == "llguidance"]
    assert comp["schema"] == SCHEMA
    assert _positive(comp["compile_ms"]) and _positive(comp["first_mask_ms"])
    (step,) = [r for r in report["steps"] if r["library"] == "llguidance"]
    assert step["batch"] == 2 and step["steps"] == 2
    assert all(_positive(step["mask_ms"][k]) for k in ("p50", "p90", "mean"))
    assert all(_positive(step["accept_ms"][k]) for k in ("p50", "p90"))
    if "xgrammar" in libs:
        assert {r["library"] for r in report["steps"]} == {
            "llguidance",
            "xgrammar",
            "xgrammar-batch",
        }
        assert _positive(report["ratios"]["mask_p50"]["xgrammar@2"])

    paths = report["paths"]
    assert len(paths) >= 2  # two rows, each finished after its timed steps
    for path in paths:
        assert path["schema"] == SCHEMA and path["finished"], path
        jsonschema.validate(json.loads(path["text"]), SCHEMAS[SCHEMA])
    assert "llguidance" in format_report(report)


def test_grammar_bench_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grammar.json"
    args = ["bench", "grammar", "--schemas", "tool_call", "--batch-sizes", "1", "--steps", "2"]
    args += ["--compile-repeats", "1", "--import-repeats", "0", "--no-xgrammar", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["config"]["libraries"] == ["llguidance"] and report["imports"] == []
    assert "mask p50" in capsys.readouterr().out
