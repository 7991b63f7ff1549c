"""`pdmesh model train --arch deepseek_v4`: the training model against transformers, its export
(transformers and the engine load it, the MTP module in the release's names), a short real run
(loss falls, resume is exact, the checkpoint is written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdmesh.tools.model_init_v4 import hf_name, mtp_specs, v4_weight_specs
from pdmesh.tools.tokenizer_train import train_tokenizer
from pdmesh.train.export import export_v4_checkpoint
from pdmesh.train.model_v4 import DeepseekV4ForTraining, indexer_kl
from pdmesh.train.trainer import TrainConfig, train, v4_config_json
from pdmesh_engine.model.deepseek_v4.config import V4Config

transformers = pytest.importorskip("transformers")

# tiny: window 16, CSA every 4 tokens (index_topk 8 of up to 24 entries), HCA every 16, 16
# indexer heads; 96 tokens cross 6 windows and 6 HCA windows
SEQ = 96


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[DeepseekV4ForTraining, Path]:
    """A tiny training model with every parameter drawn at random (sinks, position biases, mHC
    biases, norms and correction biases too, so that each shows in the output) and its float32
    export."""
    torch.set_num_threads(1)
    config = v4_config_json("tiny", "float32")
    model = DeepseekV4ForTraining(V4Config.from_dict(config))
    model.init_weights(3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("attn_sink", "ape", "base"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("norm.weight") or leaf == "scale":
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        for router in model.routers(hashed=False):
            router.bias.copy_(torch.randn(router.bias.shape, generator=gen) * 0.1)
    out = tmp_path_factory.mktemp("v4export")
    export_v4_checkpoint(model, config, train_tokenizer(1024), out, "float32")
    return model, out


def test_training_model_matches_transformers(
    tiny_export: tuple[DeepseekV4ForTraining, Path],
) -> None:
    model, out = tiny_export
    reference, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, 1024, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.logits(ids), reference(ids).logits.float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_export_names_and_the_engine_greedy_equals_transformers(
    tiny_export: tuple[DeepseekV4ForTraining, Path],
) -> None:
    from pdmesh_engine import LLM, SamplingParams

    model, out = tiny_export
    config = model.config
    tensors = load_file(str(out / "model.safetensors"))
    main = {hf_name(s.name) for s in v4_weight_specs(config)}
    assert set(tensors) == main | {s.name for s in mtp_specs(config)}  # mtp.0.* as released
    assert tensors["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1

    prompt = torch.randint(2, 1024, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = LLM(out, dtype="float32")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = llm.generate({"prompt_ids": prompt}, greedy)[0].token_ids
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(prompt) :]


def test_hash_tables_hold_distinct_experts_and_balancing_moves_the_bias(
    tiny_export: tuple[DeepseekV4ForTraining, Path],
) -> None:
    model, _ = tiny_export
    (hashed,) = model.routers(hashed=True)
    table = hashed.tid2eid
    assert all(len(set(row)) == len(row) for row in table.tolist())
    assert not any(p is hashed.tid2eid for p in model.parameters())
    with torch.no_grad():
        losses = model(torch.randint(0, 1024, (2, 33), generator=torch.Generator().manual_seed(5)))
    topk = model.routers(hashed=False)
    assert len(losses.routing) == len(topk) == 4  # 3 top-k layers + the MTP module's
    before = topk[0].bias.clone()
    model.update_balance_bias(losses.routing, 0.01)
    load = losses.routing[0].load.float()
    moved = topk[0].bias - before
    assert torch.allclose(moved, 0.01 * torch.sign(load.mean() - load))
    topk[0].bias.copy_(before)


def test_indexer_kl_is_zero_when_the_indexer_agrees_and_skips_blind_queries() -> None:
    logits = torch.randn(1, 3, 5, 4)  # [B, H, T, E]
    visible = torch.arange(4)[None, :] < (torch.arange(1, 6)[:, None] // 2)  # rate 2
    target = logits.masked_fill(~visible, float("-inf")).softmax(-1).mean(1)
    agreeing = target.clamp_min(1e-30).log()  # the softmax of log p is p
    assert float(indexer_kl(agreeing, logits, visible)) == pytest.approx(0.0, abs=1e-6)
    assert float(indexer_kl(torch.zeros(1, 5, 4), logits, visible)) > 0.0


def _run(out: Path, **kw: object) -> dict | None:
    config = TrainConfig(
        arch="deepseek_v4",
        preset="tiny",
        steps=5,
        batch_size=4,
        seq_len=64,
        warmup_steps=1,
        lr=1e-2,
        eval_every=5,
        eval_tokens=1024,
        save_every=100,
        autocast="off",
        dtype="float32",
        threads=1,
    )
    return train(out, config, log=lambda _msg: None, **kw)


def test_a_short_run_learns_resumes_exactly_and_exports(tmp_path: Path) -> None:
    assert _run(tmp_path / "split", until=3) is None
    assert not (tmp_path / "split" / "model.safetensors").exists()
    summary = _run(tmp_path / "split", resume=True)
    assert summary is not None
    assert summary["held_out_loss"] < summary["random_init_held_out_loss"] - 0.2
    train_records = summary["history"]["train"]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5]
    assert train_records[-1]["indexer_loss"] < train_records[0]["indexer_loss"]
    assert [r["start_step"] for r in summary["runs"]] == [0, 3]
    out = tmp_path / "split"
    for name in ("config.json", "tokenizer.json", "README.md", "loss_curve.png"):
        assert (out / name).is_file()
    assert "--arch deepseek_v4" in (out / "README.md").read_text()
    tensors = load_file(str(out / "model.safetensors"))
    assert any(k.startswith("mtp.0.") for k in tensors)

    whole = _run(tmp_path / "whole")
    assert whole is not None
    reference = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert all(torch.equal(reference[k], tensors[k]) for k in reference)
