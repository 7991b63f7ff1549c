"""Reading checkpoints: safetensors discovery and streaming, config and generation defaults,
errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdmesh.tools.model_init import init_model, weight_specs
from pdmesh.tools.presets import preset_model_config
from pdmesh_engine.checkpoint import (
    DTYPES,
    expect_shape,
    find_safetensors,
    iter_tensors,
    load_generation_defaults,
    tensor_names,
)
from pdmesh_engine.config import DTYPE_NAMES, CheckpointError, EngineConfig, ModelConfig


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0, verbose=False)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("ckpt") / "sharded",
        "tiny",
        seed=0,
        max_shard_bytes=400_000,
        verbose=False,
    )


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_single_file_checkpoint(tiny_dir: Path) -> None:
    assert find_safetensors(tiny_dir) == [tiny_dir / "model.safetensors"]
    specs = {s.name: s.shape for s in weight_specs(preset_model_config("tiny"))}
    seen = {name: tuple(t.shape) for name, t in iter_tensors(tiny_dir)}
    assert seen == specs
    assert set(tensor_names(tiny_dir)) == set(specs)


def test_sharded_checkpoint_streams_the_same_tensors(tiny_dir: Path, sharded_dir: Path) -> None:
    files = find_safetensors(sharded_dir)
    assert len(files) > 2 and all(f.name.startswith("model-0") for f in files)
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for _, t in iter_tensors(sharded_dir)
    )
    single = dict(iter_tensors(tiny_dir))
    sharded = dict(iter_tensors(sharded_dir))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_iter_tensors_subset(tiny_dir: Path) -> None:
    got = dict(
        iter_tensors(tiny_dir, names=["lm_head.weight", "model.norm.weight", "no.such.tensor"])
    )
    assert set(got) == {"lm_head.weight", "model.norm.weight"}


def test_expect_shape() -> None:
    t = torch.zeros(3, 4)
    assert expect_shape("w", t, (3, 4)) is t
    with pytest.raises(
        CheckpointError, match=r"model.x.weight: expected shape \(4, 3\), got \(3, 4\)"
    ):
        expect_shape("model.x.weight", t, [4, 3])


def test_model_config_from_dir(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    assert isinstance(cfg, ModelConfig) and cfg == preset_model_config("tiny")


def test_generation_defaults(tiny_dir: Path, tmp_path: Path) -> None:
    gen = load_generation_defaults(tiny_dir)
    assert gen["eos_token_ids"] == (1,) and gen["bos_token_id"] == 0
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "generation_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [1, 2]}))
    assert load_generation_defaults(d) == {"eos_token_ids": (1, 2)}  # falls back to config.json


def test_missing_config(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        ModelConfig.from_dir(d)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        find_safetensors(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="not a directory"):
        ModelConfig.from_dir(tmp_path / "nope")


def test_missing_safetensors(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        find_safetensors(d)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        list(iter_tensors(d))


def test_wrong_architecture(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with pytest.raises(CheckpointError, match="unsupported architecture.*LlamaForCausalLM"):
        ModelConfig.from_dir(d)


def test_bad_json(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json: not valid JSON"):
        load_generation_defaults(d)


def test_index_names_missing_shard(sharded_dir: Path, tmp_path: Path) -> None:
    d = _copy(sharded_dir, tmp_path / "m")
    victim = find_safetensors(d)[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"names shard.*{victim.name}"):
        find_safetensors(d)


def test_index_without_weight_map(sharded_dir: Path, tmp_path: Path) -> None:
    d = _copy(sharded_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        find_safetensors(d)


def test_corrupt_safetensors(tiny_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        list(iter_tensors(d))


def test_one_dtype_table_serves_the_engine_config_and_the_loader() -> None:
    assert tuple(DTYPES) == DTYPE_NAMES and DTYPES["bfloat16"] is torch.bfloat16
    for name in DTYPE_NAMES:
        assert EngineConfig(dtype=name).dtype == name
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")
