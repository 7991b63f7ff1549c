"""Shared test setup: the Triton interpreter switch and tiny random DeepSeek-V3 reference
checkpoints.

TRITON_INTERPRET=1 must be set before triton is first imported (`@triton.jit` reads it when a kernel
is defined): the kernel tests run the Triton kernels on CPU tensors under the interpreter, and other
test folders import `pdmesh_kernels` (and so triton) before tests/kernels is collected. Checks of
the kernels on a real GPU are a separate script, run where a GPU is lent.

`reference_models` builds, once per session, a few small random `transformers.DeepseekV3ForCausalLM`
models that differ in every architectural knob the engine reads, saves each with
`save_pretrained`, and hands back the directory together with the fp32 model (the reference).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ["TRITON_INTERPRET"] = "1"
# As the service entry does for loopback services: NIXL agents built in this process listen on
# loopback.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _hold_grpc_aio() -> None:
    """Keep grpc.aio's process-wide state (its completion queue and poller thread) alive for the
    whole session, as a service process does: it starts it once and stops it at exit.

    Tests run one event loop after another in this process. grpc.aio counts its live channels and
    servers, and each time the count drops to 0 it shuts the poller down (joining it) and starts a
    new one with the next channel: several hundred cycles per run, a path with a history of
    shutdown races in grpc's tracker (grpc/grpc#40989, #43364, #43421). One reference held from here
    on means the count never reaches 0 and that path never runs."""
    import asyncio

    from grpc.experimental import aio

    async def hold() -> None:
        aio.init_grpc_aio()

    asyncio.run(hold())


_hold_grpc_aio()


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Test models are far too small for intra-op threads; on a busy 2-core machine they cost
    ~10x."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    max_position_embeddings=512,
    initializer_range=0.15,
    bos_token_id=0,
    eos_token_id=1,
)

# name -> DeepseekV3Config keyword arguments (on top of _COMMON).
REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    # q-LoRA, interleaved default rope, normalised top-k, one dense layer first.
    "base": dict(
        num_hidden_layers=3,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        rope_interleave=True,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    # No q-LoRA, non-interleaved yarn rope with mscale != mscale_all_dim, all layers MoE, 2 shared
    # experts.
    "yarn_noqlora": dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=0,
        n_shared_experts=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=8,
        v_head_dim=12,
        rope_interleave=False,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    # Two dense layers first, interleaved yarn rope with mscale == mscale_all_dim, attention biases.
    "yarn_dense2": dict(
        num_hidden_layers=4,
        num_attention_heads=2,
        n_routed_experts=6,
        num_experts_per_tok=3,
        n_group=3,
        topk_group=2,
        first_k_dense_replace=2,
        n_shared_experts=1,
        q_lora_rank=24,
        kv_lora_rank=24,
        qk_rope_head_dim=4,
        qk_nope_head_dim=12,
        v_head_dim=20,
        rope_interleave=True,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        attention_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}


@dataclass(frozen=True)
class ReferenceModel:
    name: str
    path: Path  # a save_pretrained directory the engine loads
    model: Any  # the fp32 transformers DeepseekV3ForCausalLM, in eval mode

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size


def build_reference_model(
    name: str, kwargs: dict[str, Any], directory: Path, seed: int
) -> ReferenceModel:
    """A seeded random model with spread-out routing and non-trivial norm weights and biases, saved
    to `directory`."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(**{**_COMMON, **kwargs})
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.05)
            # RMSNorms: weights away from 1 so a misplaced norm shows
            if module_name.endswith("norm"):
                module.weight.normal_(1.0, 0.2)
            if getattr(module, "bias", None) is not None:
                module.bias.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return ReferenceModel(name, directory, model)


@pytest.fixture(scope="session")
def reference_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ReferenceModel]:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("reference_models")
    return {
        name: build_reference_model(name, kwargs, root / name, seed)
        for seed, (name, kwargs) in enumerate(REFERENCE_CONFIGS.items())
    }


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A speculative-decoding pair: the random `tiny` target (with its MTP layer) and the random
    `tiny-draft` draft model (its tokenizer, another MoE shape), both seed 0."""
    from pdmesh.tools.model_init import init_model

    root = tmp_path_factory.mktemp("spec-models")
    return {
        "tiny": init_model(root / "tiny", "tiny", seed=0, verbose=False),
        "draft": init_model(root / "draft", "tiny-draft", seed=0, verbose=False),
    }
