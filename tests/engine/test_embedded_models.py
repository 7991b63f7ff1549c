"""The embedded trained checkpoints: what their cards claim holds, transformers and the engine agree
on them, and the default model writes Python."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pdmesh_engine import LLM, SamplingParams
from pdmesh_engine.checkpoint import EMBEDDED_DIR, embedded_model_dir
from pdmesh_engine.config import ModelConfig

# no trailing newline: the tokenizer merges a newline with the next line's indent
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n\n\ndef"]


@pytest.fixture(scope="module")
def coder() -> LLM:
    return LLM(embedded_model_dir("coder"), dtype="float32", num_blocks=256)


def _summary(name: str) -> dict:
    return json.loads((embedded_model_dir(name) / "training.json").read_text())


def test_the_default_is_the_trained_v4() -> None:
    from pdmesh.cli.options import resolve_model
    from pdmesh_engine.model.configs import read_model_config
    from pdmesh_engine.model.deepseek_v4.config import V4Config

    assert embedded_model_dir() == EMBEDDED_DIR / "coder-v4" == resolve_model(None)
    assert isinstance(read_model_config(embedded_model_dir()), V4Config)
    assert LLM(dtype="float32", num_blocks=64).engine.runner.family.__class__.__name__ == "V4Family"


def test_the_trained_coder_and_its_draft_share_the_tokenizer() -> None:
    target, draft = embedded_model_dir("coder"), embedded_model_dir("coder-draft")
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    t, d = ModelConfig.from_dir(target), ModelConfig.from_dir(draft)
    assert t.vocab_size == d.vocab_size
    assert (t.n_routed_experts, t.num_experts_per_tok) != (
        d.n_routed_experts,
        d.num_experts_per_tok,
    )
    assert t.num_nextn_predict_layers == 1
    sizes = [f.stat().st_size for f in EMBEDDED_DIR.glob("*/*.safetensors")]
    assert max(sizes) <= 48e6 and sum(sizes) <= 60e6  # the repository stays small to clone
    assert not list(EMBEDDED_DIR.glob("*/.train"))  # no optimizer state committed


@pytest.mark.parametrize("name", ["coder", "coder-draft", "coder-v4"])
def test_held_out_perplexity_is_far_below_the_random_initialisation(name: str) -> None:
    s = _summary(name)
    assert s["held_out_perplexity"] < s["random_init_held_out_perplexity"] / 20
    assert math.isclose(s["held_out_perplexity"], math.exp(s["held_out_loss"]))
    card = (embedded_model_dir(name) / "README.md").read_text()
    assert f"{s['held_out_perplexity']:.1f}" in card and f"{s['steps']:,}" in card


def test_engine_greedy_equals_transformers_on_the_trained_coder(coder: LLM) -> None:
    transformers = pytest.importorskip("transformers")
    model_dir = embedded_model_dir("coder")
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, coder.generate(PROMPTS, params), strict=True):
        ids = coder.encode_prompt(prompt)
        theirs = reference.generate(
            torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
        assert out.token_ids == theirs[0, len(ids) :].tolist(), prompt


def test_greedy_completions_look_like_python(coder: LLM) -> None:
    params = SamplingParams(max_tokens=48, temperature=0)
    outs = coder.generate(PROMPTS[:2], params)
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        text = out.text
        assert "\n    " in text or "\n        " in text, text  # indented block lines
        keywords = ("return", "if ", "self", "for ", "raise", "=")
        assert any(k in text for k in keywords), text
        assert (prompt + text).count("(") >= 1


def test_the_trained_v4_is_deepseek_v4_with_its_mtp_layer_and_the_coder_tokenizer() -> None:
    from safetensors import safe_open

    from pdmesh_engine.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Config

    v4 = embedded_model_dir("coder-v4")
    config = V4Config.from_dir(v4)
    assert {SLIDING, CSA, HCA} <= set(config.layer_types) and "hash_moe" in config.mlp_layer_types
    assert config.num_nextn_predict_layers == 1
    with safe_open(str(v4 / "model.safetensors"), framework="pt") as f:
        assert any(name.startswith("mtp.0.") for name in f.keys())
    coder = embedded_model_dir("coder")
    assert (v4 / "tokenizer.json").read_bytes() == (coder / "tokenizer.json").read_bytes()


def test_engine_greedy_equals_transformers_on_the_trained_v4() -> None:
    transformers = pytest.importorskip("transformers")
    v4 = embedded_model_dir("coder-v4")
    llm = LLM(v4, dtype="float32", num_blocks=64)
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(v4, dtype=torch.float32)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        ids = llm.encode_prompt(prompt)
        expected = list(ids)
        with torch.no_grad():
            for _ in range(16):
                expected.append(int(reference(torch.tensor([expected])).logits[0, -1].argmax()))
        assert out.token_ids == expected[len(ids) :], prompt
