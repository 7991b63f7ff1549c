"""`pdmesh model init --arch deepseek_v4`: the checkpoint transformers loads, and the engine's
logits and greedy tokens on it equal transformers'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("v4") / "tiny", "tiny", seed=3, arch="deepseek_v4", verbose=False
    )


def test_config_names_the_v4_architecture_and_every_layer_kind(tiny_v4: Path) -> None:
    config = json.loads((tiny_v4 / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"]
    kinds = set(config["layer_types"])
    assert kinds == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert "hash_moe" in config["mlp_layer_types"]


def test_transformers_loads_it_and_the_engine_matches(tiny_v4: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_v4, dtype=torch.float32).eval()
    llm = LLM(tiny_v4, dtype="float32")
    prompt = llm.tokenizer.encode("def main():\n    return sorted(items, key=len)\n")
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = llm.generate({"prompt_ids": prompt}, greedy)[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.token_ids == ids[len(prompt) :]


def test_same_seed_same_bytes_and_unknown_presets_refused(tiny_v4: Path, tmp_path: Path) -> None:
    again = init_model(tmp_path / "again", "tiny", seed=3, arch="deepseek_v4", verbose=False)
    assert (again / "model.safetensors").read_bytes() == (
        tiny_v4 / "model.safetensors"
    ).read_bytes()
    with pytest.raises(ValueError, match="unknown deepseek_v4 preset"):
        init_model(tmp_path / "x", "tiny-draft", arch="deepseek_v4", verbose=False)
    with pytest.raises(ValueError, match="'coder' is a trained deepseek_v3 checkpoint"):
        init_model(tmp_path / "x", "coder", arch="deepseek_v4", verbose=False)


def test_pdmesh_generate_runs_a_v4_checkpoint(tiny_v4: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pdmesh.cli.main import main; sys.exit(main())",
            "generate",
            "--model",
            str(tiny_v4),
            "--prompt",
            "import os",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "unsupported architecture" not in run.stderr


def test_the_mesh_takes_v4_with_one_rank_and_under_dep(tiny_v4: Path) -> None:
    from pdmesh.launcher import MeshOptions

    MeshOptions(model_dir=tiny_v4)
    options = MeshOptions(model_dir=tiny_v4, decode_dep=2)
    assert options.decode_dep == 2
