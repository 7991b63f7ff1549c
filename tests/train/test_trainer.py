"""`pdmesh model train`: the training model against transformers, the recipe's parts, a short
real run (loss falls, resume is exact), the exported checkpoint's layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdmesh.tools.model_init import weight_specs
from pdmesh.tools.presets import preset_model_config
from pdmesh.train.data import TokenStream, is_held_out, split, stdlib_sources
from pdmesh.train.export import checkpoint_tensors, export_checkpoint
from pdmesh.train.model import DeepseekV3ForTraining, MoE, RoutingStats
from pdmesh.train.trainer import TrainConfig, learning_rate, train

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[DeepseekV3ForTraining, Path]:
    """A tiny training model (seeded) and its float32 export."""
    from pdmesh.tools.tokenizer_train import train_tokenizer

    model = DeepseekV3ForTraining(preset_model_config("tiny"))
    model.init_weights(7)
    with torch.no_grad():  # a non-zero correction bias, so the export of the buffer shows
        for gate in model.moe_gates():
            gate.e_score_correction_bias.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("export")
    export_checkpoint(model, "tiny", train_tokenizer(1024), out, "float32")
    return model, out


def test_export_has_the_checkpoint_layout_of_the_preset(
    tiny_export: tuple[DeepseekV3ForTraining, Path],
) -> None:
    model, out = tiny_export
    tensors = load_file(str(out / "model.safetensors"))
    config = preset_model_config("tiny")
    assert set(tensors) == {s.name for s in weight_specs(config)}  # what `model init` writes
    mtp = f"model.layers.{config.num_hidden_layers}"
    assert torch.equal(tensors[f"{mtp}.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors[f"{mtp}.shared_head.head.weight"], tensors["lm_head.weight"])
    bf16 = checkpoint_tensors(model, "bfloat16")
    assert bf16["lm_head.weight"].dtype == torch.bfloat16
    assert bf16["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # routers stay fp32
    assert bf16["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_training_model_matches_transformers(
    tiny_export: tuple[DeepseekV3ForTraining, Path],
) -> None:
    model, out = tiny_export
    reference, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info.get("mismatched_keys")
    ids = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.logits(ids), reference(ids).logits.float()
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_engine_greedy_equals_transformers_on_the_export(
    tiny_export: tuple[DeepseekV3ForTraining, Path],
) -> None:
    from pdmesh_engine import LLM, SamplingParams

    _, out = tiny_export
    prompt = [0, 17, 300, 5, 901, 44]
    llm = LLM(out, dtype="float32", num_blocks=64)
    ours = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = reference.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
    )
    assert ours[0].token_ids == theirs[0, len(prompt) :].tolist()


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    config = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert learning_rate(config, 0) == pytest.approx(1e-4)
    assert learning_rate(config, 9) == pytest.approx(1e-3)
    assert learning_rate(config, 10) == pytest.approx(1e-3)
    assert learning_rate(config, 55) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert learning_rate(config, 100) == pytest.approx(1e-4)
    rates = [learning_rate(config, s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))


def test_balance_bias_moves_towards_equal_loads() -> None:
    model = DeepseekV3ForTraining(preset_model_config("tiny"))
    gates = model.moe_gates()
    loads = [torch.tensor([10, 0, 5, 5, 3, 7, 5, 5])] * len(gates)
    routing = [RoutingStats(load, torch.zeros(())) for load in loads]
    model.update_balance_bias(routing, 0.01)
    bias = gates[0].e_score_correction_bias
    assert bias[0] == pytest.approx(-0.01) and bias[1] == pytest.approx(0.01)  # over / under
    assert bias[2] == 0 and bias[4] == pytest.approx(0.01) and bias[5] == pytest.approx(-0.01)


def test_sequence_balance_loss_is_one_when_balanced_and_grows_with_skew() -> None:
    moe = MoE(preset_model_config("tiny"))  # 8 experts, top 2
    ids = torch.arange(8).repeat(4).view(16, 2)  # every expert chosen 4 times in 16 tokens
    uniform = torch.full((16, 8), 0.5)
    assert float(moe._balance_loss(ids, uniform, 1)) == pytest.approx(1.0)
    skewed_ids = torch.tensor([[0, 1]] * 16)
    skewed_scores = uniform.clone()
    skewed_scores[:, :2] = 0.9
    # f = 4 for experts 0 and 1 (all choices, uniform would be 1), P = 0.9 / 4.8 each
    assert float(moe._balance_loss(skewed_ids, skewed_scores, 1)) == pytest.approx(1.5)


def test_data_split_is_deterministic_and_disjoint() -> None:
    files = stdlib_sources()
    names = [f.name for f in files]
    assert names == sorted(names) and len(names) > 100
    assert not any(n.startswith(("test/", "idlelib/", "encodings/")) for n in names)
    train_files, held_out = split(files)
    assert {f.name for f in train_files}.isdisjoint(f.name for f in held_out)
    assert len(train_files) + len(held_out) == len(files)
    assert 0.02 < len(held_out) / len(files) < 0.1
    assert all(is_held_out(f.name) for f in held_out)


def test_batches_are_a_function_of_seed_and_step() -> None:
    from tokenizers import Tokenizer

    from pdmesh.tools.tokenizer_train import train_tokenizer

    files = stdlib_sources()[:20]
    stream = TokenStream(files, Tokenizer.from_str(train_tokenizer(1024)))
    a = stream.batch(4, 32, seed=1, step=5)
    assert a.shape == (4, 33)
    assert torch.equal(a, stream.batch(4, 32, seed=1, step=5))
    assert not torch.equal(a, stream.batch(4, 32, seed=1, step=6))
    assert stream.tokens[0] == 0 and int((stream.tokens == 1).sum()) == len(files)  # BOS/EOS


def _run(out: Path, **kw: object) -> dict | None:
    config = TrainConfig(
        preset="tiny",
        steps=10,
        batch_size=4,
        seq_len=32,
        warmup_steps=2,
        lr=1e-2,
        eval_every=5,
        eval_tokens=1024,
        save_every=100,
        autocast="off",
        dtype="float32",
    )
    return train(out, config, log=lambda _msg: None, **kw)


def test_a_short_run_learns_and_resumes_exactly(tmp_path: Path) -> None:
    summary = _run(tmp_path / "whole")
    assert summary is not None
    assert summary["held_out_loss"] < summary["random_init_held_out_loss"] - 0.2
    assert summary["steps"] == 10 and summary["tokens_seen"] == 10 * 4 * 32
    assert [e["step"] for e in summary["history"]["eval"]] == [0, 5, 10]
    assert len(summary["expert_load_skew"]) == 4  # 3 MoE layers + the MTP module's
    for name in ("config.json", "tokenizer.json", "model.safetensors", "README.md"):
        assert (tmp_path / "whole" / name).is_file()
    assert (tmp_path / "whole" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "whole" / "training.json").read_text())["steps"] == 10

    assert _run(tmp_path / "split", until=4) is None
    assert not (tmp_path / "split" / "model.safetensors").exists()
    resumed = _run(tmp_path / "split", resume=True)
    assert resumed is not None
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    split_run = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert all(torch.equal(whole[k], split_run[k]) for k in whole)
    assert math.isclose(resumed["held_out_loss"], summary["held_out_loss"])
    assert [r["start_step"] for r in resumed["runs"]] == [0, 4]

    with pytest.raises(FileExistsError):
        _run(tmp_path / "whole")


def test_engine_mtp_layer_computes_what_the_trainer_trained(
    tiny_export: tuple[DeepseekV3ForTraining, Path],
) -> None:
    """The engine's MTP path (forward_mtp + compute_mtp_logits, used by speculative decoding)
    gives the trainer's MTP logits: h_t after the final norm, token t + 1, rope at t."""
    from pdmesh_engine.config import EngineConfig
    from pdmesh_engine.engine_core import EngineCore
    from pdmesh_engine.forward_batch import ForwardBatch

    model, out = tiny_export
    ids = torch.randint(0, 1024, (1, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = model.hidden_states(ids[:, :-1], [])
        embeds = model.model.embed_tokens(ids[:, 1:])
        t = ids.shape[1] - 1
        theirs = model.lm_head(
            model.mtp[0](embeds, hidden, model.rope.cos[:t], model.rope.sin[:t], [])
        )[0]
    engine = EngineCore(
        out,
        EngineConfig(
            dtype="float32", num_blocks=8, speculative_method="mtp", num_speculative_tokens=1
        ),
    )
    runner = engine.runner
    batch = ForwardBatch.build(
        [ids[0, :-1].tolist()], [0], [[0, 1]], engine.config.block_size, [False], runner.device
    )
    with torch.no_grad():
        h = runner.model(batch, runner.kv_caches)
        mtp_kv = torch.zeros((1, *runner.kv_caches.shape[1:]), dtype=runner.kv_caches.dtype)
        x = runner.model.forward_mtp(ids[0, 1:], h, batch, mtp_kv)
        ours = runner.model.compute_mtp_logits(x)
    torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=1e-4)
