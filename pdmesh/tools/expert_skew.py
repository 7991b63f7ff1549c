"""Expert skew for seeded checkpoints: Zipf-law expert popularity, its own ranking per MoE layer.

`apply_expert_skew(model_dir, zipf_s, seed)` rewrites, in a freshly written checkpoint, every MoE
layer's `e_score_correction_bias` (the routing-only term the router adds to the sigmoid scores
before its group-limited top-k; the combine weights do not see it), so the engine routes exactly as
it always does and the skew comes from the weights. Nothing else changes (gate weights included).

Construction, per MoE layer l (MTP included):
  * a ranking, drawn from (seed, l) alone (each layer has its own hottest expert; the checkpoint's
    generator stream is untouched): the router's groups in a random order, each taking the next E/G
    ranks, its experts in a random order. Routing picks whole groups first, so a Zipf head is only
    reachable when the hot experts share groups (the tiny preset picks 2 experts from 1 of 2 groups:
    an expert can be picked at most as often as the rest of its group together);
  * target pick frequencies f_r = min(c·r^-s, SKEW_MAX_FREQUENCY) for rank r = 1..E, with c such
    that they sum to top-k (a token picks an expert at most once, so the head saturates first);
  * the bias is fitted to those targets on the router's real inputs: the model runs prefill over
    calibration text (standard-library docstrings, the tokenizer's corpus) in the engine, a hook
    captures each router's input [N, D], and the bias takes SKEW_STEPS steps of
    SKEW_RATE·log(target / measured) on that layer's own router. Refitting a layer changes the
    inputs of the layers after it, so capture-and-fit repeats SKEW_ROUNDS times (SKEW_REFIT_STEPS
    steps after the first). The engine does not run the MTP layers in prefill: theirs is fitted on
    unit-RMS Gaussian inputs scaled by the layer's post-attention norm weight.
Fitting on real inputs matters: a random-weight model's hidden states share a strong common
direction, so a fit on isotropic Gaussian inputs misses the per-expert offsets it adds (measured:
fitted exponents 0.8-1.7 for s = 1.2 on the tiny preset, against 1.10-1.32 fitted on real inputs).
Where group limiting still makes a target unreachable the fit gets as close as it can: with the
tiny preset on held-out English text, s = 1.2 puts 3.1-3.3x the uniform share on each layer's
hottest expert (unskewed: 1.6-2.4x), with log-log slopes of the sorted shares of 1.10-1.32.

Legend: E routed experts, G router groups, D hidden size, N captured router inputs (tokens).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from pdmesh_engine.config import ModelConfig
    from pdmesh_engine.llm import LLM
    from pdmesh_engine.tokenizer import Tokenizer

SKEW_STEPS = 150  # bias updates of a layer's first fit
SKEW_REFIT_STEPS = 50  # bias updates of each later fit (it starts from the previous bias)
SKEW_RATE = 0.05  # bias step per unit of log(target / measured) pick frequency
SKEW_ROUNDS = 2  # capture-and-fit passes over all layers
SKEW_MAX_FREQUENCY = 0.97  # the most often one expert may be picked
SKEW_MAX_BIAS = 1.0  # |bias| bound: sigmoid scores lie in (0, 1), so more is never needed
CALIBRATION_PROMPTS = 32  # calibration texts (every k-th corpus docstring, in corpus order)
CALIBRATION_TOKENS = 64  # tokens kept of each
_BIAS = ".mlp.gate.e_score_correction_bias"


def zipf_frequencies(num_experts: int, top_k: int, zipf_s: float) -> torch.Tensor:
    """[E] float64: target pick frequency of rank r = 1..E, min(c·r^-s, SKEW_MAX_FREQUENCY),
    summing to top_k."""
    if not 0 < top_k <= num_experts * SKEW_MAX_FREQUENCY or zipf_s < 0:
        raise ValueError(f"cannot skew top-{top_k} of {num_experts} experts with exponent {zipf_s}")
    weights = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -zipf_s
    lo, hi = 0.0, top_k / float(weights.min())
    for _ in range(100):  # bisection on c: the capped sum grows with it
        mid = (lo + hi) / 2
        capped_sum = float((weights * mid).clamp(max=SKEW_MAX_FREQUENCY).sum())
        lo, hi = (mid, hi) if capped_sum < top_k else (lo, mid)
    return (weights * hi).clamp(max=SKEW_MAX_FREQUENCY)


def layer_generator(seed: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed % (1 << 40)) * 4096 + layer)


def expert_ranking(seed: int, layer: int, num_experts: int, num_groups: int) -> torch.Tensor:
    """[E] int64: the expert of rank r + 1 in `layer` (groups of E/G consecutive expert ids take
    consecutive ranks); a function of (seed, layer) only."""
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups")
    gen, per_group = layer_generator(seed, layer), num_experts // num_groups
    group_order = torch.randperm(num_groups, generator=gen)  # [G]
    # [G, E/G]
    within = torch.stack([torch.randperm(per_group, generator=gen) for _ in range(num_groups)])
    return (group_order[:, None] * per_group + within).flatten()


def layer_targets(config: ModelConfig, seed: int, layer: int, zipf_s: float) -> torch.Tensor:
    """[E] float64: target pick frequency of each expert id in `layer`."""
    num_experts = config.n_routed_experts
    target = torch.empty(num_experts, dtype=torch.float64)
    ranking = expert_ranking(seed, layer, num_experts, config.n_group)
    target[ranking] = zipf_frequencies(num_experts, config.num_experts_per_tok, zipf_s)
    return target


@torch.no_grad()
def fit_bias(
    router: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, num_steps: int = SKEW_STEPS
) -> torch.Tensor:
    """Fits `router.e_score_correction_bias` [E] in place so router(x [N, D]) picks each expert
    with frequency `target` [E]; starts from the router's current bias; returns it (float32).

    The logits x·Wᵀ [N, E] do not depend on the bias: they are computed once and routed by a copy
    of the router whose gate is the identity, so every step runs the engine's own selection.
    """
    num_tokens, num_experts = x.shape[0], target.shape[0]
    proxy = copy.deepcopy(router).float()
    logits = torch.nn.functional.linear(x.float(), proxy.weight)  # [N, E]
    proxy.weight = torch.nn.Parameter(torch.eye(num_experts))
    bias = router.e_score_correction_bias.detach().double().clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steps on [N, E] are too small to split: threads only contend
    try:
        for _ in range(num_steps):
            proxy.e_score_correction_bias.data.copy_(bias)
            ids = proxy(logits)[1].flatten()
            picks = torch.bincount(ids, minlength=num_experts).double() / num_tokens
            step = SKEW_RATE * (target / (picks + 0.5 / num_tokens)).log()
            bias = (bias + step).clamp(-SKEW_MAX_BIAS, SKEW_MAX_BIAS)
    finally:
        torch.set_num_threads(threads)
    router.e_score_correction_bias.data.copy_(bias)
    return bias.float()


def calibration_prompts(tokenizer: Tokenizer) -> list[list[int]]:
    from pdmesh.tools.tokenizer_train import stdlib_corpus

    texts = stdlib_corpus()
    stride = max(len(texts) // CALIBRATION_PROMPTS, 1)
    ids = [tokenizer.encode(t)[:CALIBRATION_TOKENS] for t in texts[::stride][:CALIBRATION_PROMPTS]]
    return [p for p in ids if len(p) >= 2]


def _capture_router_inputs(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Runs prefill over `prompts`; returns each main-model MoE layer's router inputs [N, D]."""
    from pdmesh_engine.sampling import SamplingParams

    model = llm.engine.runner.model
    moe = model.moe_layers
    captured: list[list[torch.Tensor]] = [[] for _ in moe]
    hooks = [
        m.gate.register_forward_pre_hook(
            lambda _m, args, i=i: captured[i].append(args[0].detach().float())
        )
        for i, m in enumerate(moe)
    ]
    cpu_layers, model.cpu_layers = model.cpu_layers, None  # the hooks see the torch path only
    try:
        llm.generate(
            [{"prompt_ids": p} for p in prompts], SamplingParams(max_tokens=1, temperature=0.0)
        )
    finally:
        model.cpu_layers = cpu_layers
        for h in hooks:
            h.remove()
    return [torch.cat(c) for c in captured]


def _fit_main_layers(
    llm: LLM, seed: int, zipf_s: float, log: Callable[[str], None]
) -> dict[int, torch.Tensor]:
    """{layer id: fitted bias [E]} of the main model's MoE layers (see the module docstring)."""
    config = llm.engine.model_config
    moe, layer_ids = llm.engine.runner.model.moe_layers, config.moe_layer_ids
    targets = [layer_targets(config, seed, i, zipf_s) for i in layer_ids]
    prompts = calibration_prompts(llm.tokenizer)
    biases: dict[int, torch.Tensor] = {}
    for round_index in range(SKEW_ROUNDS):
        inputs = _capture_router_inputs(llm, prompts)
        steps = SKEW_REFIT_STEPS if round_index else SKEW_STEPS
        for layer_id, m, x, target in zip(layer_ids, moe, inputs, targets, strict=True):
            biases[layer_id] = fit_bias(m.gate, x, target, steps)
    log(
        f"fitted expert skew {zipf_s} on {inputs[0].shape[0]} calibration tokens, "
        f"{len(layer_ids)} MoE layers"
    )
    return biases


def _fit_mtp_layers(llm: LLM, seed: int, zipf_s: float) -> dict[int, torch.Tensor]:
    """{layer id: fitted bias [E]} of the MTP layers' routers, on Gaussian inputs."""
    config = llm.engine.model_config
    biases: dict[int, torch.Tensor] = {}
    for k, mtp in enumerate(llm.engine.runner.model.mtp):
        layer_id = config.num_hidden_layers + k
        x = torch.randn(
            CALIBRATION_PROMPTS * CALIBRATION_TOKENS,
            config.hidden_size,
            generator=layer_generator(seed + 1, layer_id),
        )
        x = x * mtp.block.post_attention_layernorm.weight.detach().float()
        target = layer_targets(config, seed, layer_id, zipf_s)
        biases[layer_id] = fit_bias(mtp.block.mlp.gate.float(), x, target)
    return biases


def apply_expert_skew(
    model_dir: str | Path, zipf_s: float, seed: int, log: Callable[[str], None] = lambda _msg: None
) -> None:
    """Refits every MoE router bias of the checkpoint in `model_dir` (written, not yet in use) so
    expert popularity follows Zipf(zipf_s) with a per-layer ranking; rewrites the files holding
    them. ValueError when a router is missing from the engine or from the files."""
    from pdmesh_engine.llm import LLM

    model_dir = Path(model_dir)
    # Prefix-cache hits would skip the prefill the capture needs.
    llm = LLM(model_dir, device="cpu", enable_prefix_caching=False)
    fitted = {**_fit_main_layers(llm, seed, zipf_s, log), **_fit_mtp_layers(llm, seed, zipf_s)}
    biases = {f"model.layers.{i}{_BIAS}": b for i, b in fitted.items()}
    written: set[str] = set()
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(file))
        hits = [n for n in tensors if n.endswith(_BIAS)]
        unfitted = sorted(set(hits) - set(biases))
        if unfitted:
            raise ValueError(f"routers {unfitted[:3]} were not loaded by the engine")
        if hits:
            tensors.update({n: biases[n].to(tensors[n].dtype) for n in hits})
            save_file(tensors, str(file), metadata={"format": "pt"})
            written.update(hits)
    if written != set(biases):
        missing = sorted(set(biases) - written)
        raise ValueError(f"router biases {missing[:3]} are not in {model_dir}'s files")
