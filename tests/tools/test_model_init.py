"""`pdmesh model init`: the random checkpoint loads in transformers, is seeded, sized and laid out
as DeepSeek-V3."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pdmesh.tools import model_init
from pdmesh.tools.model_init import count_mtp_parameters, count_parameters, init_model
from pdmesh.tools.presets import PRESETS, preset_config, preset_model_config
from pdmesh_engine.config import ModelConfig

transformers = pytest.importorskip("transformers")


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("init") / "tiny", "tiny", seed=0, verbose=False)


@pytest.fixture(scope="module")
def hf_model(tiny_dir: Path):
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(tiny_dir), output_loading_info=True
    )
    return model.eval(), info


def test_transformers_loads_without_missing_keys(hf_model) -> None:
    _, info = hf_model
    assert not info["missing_keys"] and not info["mismatched_keys"]
    mtp_prefix = f"model.layers.{PRESETS['tiny']['num_hidden_layers']}."
    assert info["unexpected_keys"] and all(
        k.startswith(mtp_prefix) for k in info["unexpected_keys"]
    )


def test_names_and_shapes_match_save_pretrained(tiny_dir: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(str(tiny_dir))
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.rope_parameters["rope_theta"] == PRESETS["tiny"]["rope_theta"]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as ref_dir:
        transformers.DeepseekV3ForCausalLM(config).save_pretrained(ref_dir)
        with safe_open(str(Path(ref_dir) / "model.safetensors"), framework="pt") as f:
            ref = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    ours = {k: tuple(t.shape) for k, t in _tensors(tiny_dir).items()}
    mtp = f"model.layers.{config.num_hidden_layers}."
    assert {k: v for k, v in ours.items() if not k.startswith(mtp)} == ref


def test_loaded_values_and_spread(tiny_dir: Path, hf_model) -> None:
    model, _ = hf_model
    ours = _tensors(tiny_dir)
    state = model.state_dict()
    shared = [k for k in ours if k in state]
    assert len(shared) > 50 and all(torch.equal(state[k], ours[k]) for k in shared)
    ids = torch.tensor([[0, 5, 17, 99, 300, 7, 512, 42]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.std() > 1.0
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.05  # no near-ties at the argmax
    bias = ours["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0 and 0.01 < bias.std() < 0.2
    gate = ours["model.layers.1.mlp.gate.weight"]
    scores = torch.sigmoid(
        torch.randn(256, gate.shape[1], generator=torch.Generator().manual_seed(0)) @ gate.T
    )
    assert scores.std() > 0.1  # router scores well spread


def test_model_config_parses(tiny_dir: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_dir)
    assert cfg.num_hidden_layers == 4 and cfg.moe_layer_ids == [1, 2, 3]
    assert cfg.rope_interleave and cfg.num_nextn_predict_layers == 1 and cfg.eos_token_ids == (1,)
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"] and raw["model_type"] == "deepseek_v3"
    assert raw["tie_word_embeddings"] is False and raw["torch_dtype"] == "float32"


def test_mtp_layer(tiny_dir: Path) -> None:
    t = _tensors(tiny_dir)
    c = preset_model_config("tiny")
    h, v, p = c.hidden_size, c.vocab_size, f"model.layers.{c.num_hidden_layers}"
    assert t[f"{p}.eh_proj.weight"].shape == (h, 2 * h)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        assert t[f"{p}.{norm}.weight"].shape == (h,)
    assert t[f"{p}.shared_head.head.weight"].shape == (v, h)
    assert torch.equal(t[f"{p}.shared_head.head.weight"], t["lm_head.weight"])
    assert torch.equal(t[f"{p}.embed_tokens.weight"], t["model.embed_tokens.weight"])
    for name in (
        "self_attn.kv_b_proj.weight",
        "mlp.gate.weight",
        "mlp.experts.7.down_proj.weight",
        "mlp.shared_experts.up_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ):
        assert t[f"{p}.{name}"].shape == t[f"model.layers.1.{name}"].shape


def test_seeding(tiny_dir: Path, tmp_path: Path) -> None:
    again = init_model(tmp_path / "again", "tiny", seed=0, verbose=False)
    other = init_model(tmp_path / "other", "tiny", seed=1, verbose=False)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    a, b = _tensors(tiny_dir), _tensors(other)
    assert all(not torch.equal(a[k], b[k]) for k in a)


def test_bfloat16_keeps_router_fp32(tmp_path: Path) -> None:
    t = _tensors(init_model(tmp_path / "bf16", "tiny", dtype="bfloat16", verbose=False))
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_parameter_counts() -> None:
    total, active = count_parameters(preset_model_config("small"))
    assert 100e6 <= total <= 200e6 and 20e6 <= active <= 30e6
    small = PRESETS["small"]
    assert small["n_routed_experts"] >= 16 and small["vocab_size"] == 8192
    assert (
        small["max_position_embeddings"] == 4096
        and count_mtp_parameters(preset_model_config("small")) > 0
    )
    t_total, t_active = count_parameters(preset_model_config("tiny"))
    assert t_total < 3e6 and t_active < t_total


def test_counts_match_the_checkpoint(tiny_dir: Path) -> None:
    c = preset_model_config("tiny")
    tensors = _tensors(tiny_dir)
    mtp = f"model.layers.{c.num_hidden_layers}."
    total = sum(t.numel() for k, t in tensors.items() if not k.startswith(mtp))
    assert count_parameters(c)[0] == total
    assert count_mtp_parameters(c) == sum(
        t.numel() for k, t in tensors.items() if k.startswith(mtp)
    )
    expert = sum(
        t.numel() for k, t in tensors.items() if ".mlp.experts.0." in k and not k.startswith(mtp)
    )
    assert count_parameters(c)[1] == total - expert * (c.n_routed_experts - c.num_experts_per_tok)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        init_model(tmp_path / "x", "huge")
    with pytest.raises(ValueError, match="unknown dtype"):
        preset_config("tiny", "int8")


def test_no_overwrite_and_atomic(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FileExistsError):
        init_model(tiny_dir, "tiny", verbose=False)

    def boom(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(model_init, "write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        init_model(tmp_path / "half", "tiny", verbose=False)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp dir is left


def test_cli_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model_init.main([str(tmp_path / "cli"), "--preset", "tiny", "--seed", "3"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str((tmp_path / "cli").resolve())
    assert "pdmesh:" in out.err and len(out.err.splitlines()) <= 4
    assert json.loads((tmp_path / "cli" / "pdmesh_init.json").read_text())["seed"] == 3


@pytest.mark.parametrize(
    ("preset", "arch"), [("coder-draft", "deepseek_v3"), ("coder-v4", "deepseek_v4")]
)
def test_a_trained_preset_is_a_copy_of_its_embedded_checkpoint(
    tmp_path: Path, preset: str, arch: str
) -> None:
    from pdmesh_engine.checkpoint import embedded_model_dir

    out = init_model(tmp_path / "copy", preset, arch=arch, verbose=False)
    source = embedded_model_dir(preset)
    for name in ("config.json", "tokenizer.json", "model.safetensors", "README.md"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    with pytest.raises(ValueError, match="trained preset"):
        init_model(tmp_path / "seeded", preset, seed=3, arch=arch, verbose=False)
