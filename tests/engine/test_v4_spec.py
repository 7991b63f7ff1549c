"""Speculative decoding on DeepSeek-V4 by its MTP layer (`speculative_method="mtp"`,
pdmesh_engine.spec_proposer `V4MTPProposer`).

Checkpoints: tiny random V4 models with an MTP layer, in the release's layout
(`init_model(..., arch="deepseek_v4", format="official")`: FP8 / MXFP4 weights, HCA every 128
tokens, blocks of 128) and in transformers' layout (its tiny preset: HCA every 16 tokens, blocks of
16; that writer leaves the MTP layer out, as transformers does not hold it, so the test adds
`mtp.0.*` in the release's names, as the trained `coder-v4` stores it), and the trained `coder-v4`.

- Greedy output with K = 1, 2, 3 equals speculation off token for token: mixed prompt lengths
  (longer than the sliding window, crossing many compression windows, more CSA entries than
  index_topk), chunked prefill, prefix caching (a second round hits the cache).
- Random weights accept almost no drafts, so the engine's drafts are replaced by the reference
  continuation with some tokens wrong: steps accept 0..K drafts, and rejected drafts close
  compression windows; the output stays exact.
- At the model: a verify step whose rejected drafts closed CSA and HCA windows leaves a cache equal
  to one that never saw them, once the next step has computed the right tokens.
- The MTP layer's logits equal an independent re-implementation of its math (written here from
  pdmesh.train.model_v4 `MTPBlock`'s definition) on the checkpoint's tensors.
- `coder-v4`: exact greedy output and the acceptance rate per draft position at K = 1..3 (printed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from spec_checks import check_drafts_repeat

from pdmesh.tools.model_init import init_model
from pdmesh.tools.model_init_v4 import mtp_specs
from pdmesh.tools.weight_files import make_tensor
from pdmesh_engine import LLM, EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.checkpoint import embedded_model_dir
from pdmesh_engine.config import CheckpointError
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v4.config import V4Config
from pdmesh_engine.model.deepseek_v4.kv import V4Cache, default_block_size
from pdmesh_engine.model.deepseek_v4.quant import iter_v4_tensors
from pdmesh_engine.model.deepseek_v4.runtime import load_model

CPU = torch.device("cpu")
FP32_ATOL = 1e-4
BASE = dict(device="cpu", dtype="float32", num_threads=1, num_blocks=24)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CODER = embedded_model_dir("coder-v4")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("v4spec")
    official = init_model(
        root / "official", "tiny", seed=5, arch="deepseek_v4", verbose=False, format="official"
    )
    hf = with_mtp_layer(init_model(root / "hf", "tiny", seed=6, arch="deepseek_v4", verbose=False))
    return {"official": official, "hf": hf}


def with_mtp_layer(path: Path, tensors: bool = True) -> Path:
    """Declare one MTP layer in config.json and (with `tensors`) add its random `mtp.0.*`
    tensors in a file of their own."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    if tensors:
        gen = torch.Generator().manual_seed(7)
        specs = mtp_specs(V4Config.from_dir(path))
        save_file({s.name: make_tensor(s, gen, {}) for s in specs}, str(path / "mtp.safetensors"))
    return path


def prompts_for(path: Path) -> list[list[int]]:
    """3 tokens, 40 (past the window of 16, 10 CSA entries for a top-k of 8), 2 blocks + 21, and
    one sharing the first 2 blocks + 5 tokens of the previous (a prefix hit once it is cached)."""
    block = default_block_size(V4Config.from_dir(path))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in (3, 40, 2 * block + 21)]
    return [*prompts, prompts[2][: 2 * block + 5] + [7, 8, 9]]


def generate(
    path: Path, prompts: list[list[int]], rounds: int = 2, **config: Any
) -> tuple[list[list[int]], LLM]:
    """(greedy tokens, the LLM): `rounds` rounds of the prompts (the later ones hit the prefix
    cache), each giving the first's tokens; chunked prefill (16 tokens a step)."""
    llm = LLM(path, EngineConfig(**BASE, max_num_batched_tokens=16, **config))
    first: list[list[int]] = []
    for _ in range(rounds):
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert not first or tokens == first
        first = tokens
        llm.engine.check_integrity()
    assert llm.engine.kv_stats().num_used == 0
    return first, llm


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Greedy tokens with speculation off."""
    return {
        name: generate(path, prompts_for(path), rounds=1)[0] for name, path in checkpoints.items()
    }


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", ["official", "hf"])
def test_greedy_output_equals_speculation_off(
    checkpoints: dict[str, Path], reference: dict[str, list[list[int]]], name: str, k: int
) -> None:
    path = checkpoints[name]
    tokens, llm = generate(
        path, prompts_for(path), speculative_method="mtp", num_speculative_tokens=k
    )
    assert tokens == reference[name]
    assert llm.engine.kv_stats().prefix_hits > 0
    stats = llm.engine.spec_decode_stats()
    assert stats is not None and stats.num_drafts_per_position[k - 1] > 0


@pytest.mark.parametrize("warm", [False, True])
def test_drafts_equal_the_proposer_run_from_scratch(
    checkpoints: dict[str, Path], warm: bool
) -> None:
    """After every step the request's drafts equal those a fresh engine proposes from a prefill of
    the same tokens: the MTP layer's window entries (written over verify rows, rewritten after
    rejections, recursion positions, window tables) stay right. `warm`: the request's first 2
    blocks are in the prefix cache, computed by a request that continued differently right after
    them (the MTP entry at a block's last position depends on the next token: the last hit block
    is recomputed)."""
    path = checkpoints["hf"]
    config = EngineConfig(**BASE, speculative_method="mtp", num_speculative_tokens=3)
    engine = EngineCore(path, config)
    block = default_block_size(V4Config.from_dir(path))
    prompt = prompts_for(path)[1]
    if warm:
        first = prompts_for(path)[2]
        engine.add_request(first, SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished:
            engine.step()
        prompt = first[: 2 * block] + [7, 8, 9, 10, 11]
    request_id = engine.add_request(
        prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    )
    assert check_drafts_repeat(engine, request_id, lambda: EngineCore(path, config)) >= 5
    assert engine.kv_stats().prefix_hits == (block if warm else 0)  # 2 blocks hit, 1 dropped


class Oracle:
    """Makes an engine's MTP proposer draft the reference continuation instead (as many drafts as
    it proposed), wrong at every position p with p % 5 == 0: its steps accept 0..K drafts.
    `closing_rejections` counts proposals whose drafts past the first wrong one (rejected) include
    a position that closes a CSA window."""

    def __init__(self, llm: LLM, continuation: dict[tuple[int, ...], list[int]], rate: int) -> None:
        self.continuation, self.rate = continuation, rate
        self.closing_rejections = 0
        spec = llm.engine.runner.spec
        assert spec is not None
        owners: dict[int, list[int]] = {}
        propose_seq, propose = spec._propose_seq, spec.proposer._propose

        def seq(item, verdict):  # type: ignore[no-untyped-def]
            s = propose_seq(item, verdict)
            owners[id(s)] = item.request.prompt_token_ids
            return s

        def drafts(batch, hidden, next_ids, seqs, choose):  # type: ignore[no-untyped-def]
            out, passes = propose(batch, hidden, next_ids, seqs, choose)
            return [
                self._rewrite(owners.pop(id(s)), s.position, d)
                for s, d in zip(seqs, out, strict=True)
            ], passes

        spec._propose_seq = seq  # type: ignore[method-assign]
        spec.proposer._propose = drafts  # type: ignore[method-assign]

    def _rewrite(self, prompt: list[int], position: int, drafts: list[int]) -> list[int]:
        full = prompt + self.continuation[tuple(prompt)]
        positions = range(position + 1, position + 1 + len(drafts))
        wrong = [p for p in positions if p % 5 == 0]
        if wrong and any((p + 1) % self.rate == 0 for p in positions if p >= wrong[0]):
            self.closing_rejections += 1
        return [(full[p] + (p % 5 == 0)) % 1000 if p < len(full) else 0 for p in positions]


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", ["official", "hf"])
def test_partly_accepted_drafts_keep_the_output_exact(
    checkpoints: dict[str, Path], reference: dict[str, list[list[int]]], name: str, k: int
) -> None:
    path = checkpoints[name]
    prompts = prompts_for(path)
    continuation = {tuple(p): out for p, out in zip(prompts, reference[name], strict=True)}
    llm = LLM(
        path,
        EngineConfig(
            **BASE, max_num_batched_tokens=16, speculative_method="mtp", num_speculative_tokens=k
        ),
    )
    oracle = Oracle(llm, continuation, V4Config.from_dir(path).rate("compressed_sparse_attention"))
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference[name]
        llm.engine.check_integrity()
    stats = llm.engine.spec_decode_stats()
    assert stats is not None
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_per_position[k - 1] > 0  # some steps accept every draft
    assert oracle.closing_rejections > 0


def test_rejected_drafts_that_close_windows_leave_no_stale_state(
    checkpoints: dict[str, Path],
) -> None:
    """Official tiny (CSA every 4, HCA every 128 tokens): a verify step at positions 126..129
    whose drafts (127..129) are wrong; the draft at 127 closes CSA window 31 and HCA window 0 and
    writes their entries from wrong rows. The next step computes the right tokens at 127..130 as
    verify rows; its logits and the whole cache equal a run that never saw the drafts."""
    path = checkpoints["official"]
    config = V4Config.from_dir(path)
    model = load_model(path, config, CPU, torch.float32)
    block = default_block_size(config)
    assert block == config.rate("heavily_compressed_attention") == 128
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(2, 1000, (131,), generator=g).tolist()
    wrong = [(t + 1) % 1000 for t in tokens[127:130]]

    def step(cache: V4Cache, seqs: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One forward of (start position, token ids) sequences, blocks 1 and 2 -> logits."""
        batch = ForwardBatch.build(
            [ids for _, ids in seqs],
            [start for start, _ in seqs],
            [[1, 2]] * len(seqs),
            block,
            [False] * len(seqs),
            CPU,
        )
        with torch.no_grad():
            return model.compute_logits(model(batch, cache))

    def verify(start: int, ids: list[int]) -> list[tuple[int, list[int]]]:
        """One-token rows, as `SpecDecoder` lays out a verify step."""
        return [(start + i, [t]) for i, t in enumerate(ids)]

    prefill = [(0, tokens[:126])]
    dirty = V4Cache(config, 3, block, torch.float32, CPU)
    step(dirty, prefill)
    step(dirty, verify(126, [tokens[126], *wrong]))
    stale_hca = dirty.hca_kv[:, 1, 0].clone()
    stale_csa = dirty.csa_kv[:, 1, 31].clone()
    dirty_logits = step(dirty, verify(127, tokens[127:131]))
    clean = V4Cache(config, 3, block, torch.float32, CPU)
    step(clean, prefill)
    step(clean, verify(126, tokens[126:127]))
    clean_logits = step(clean, verify(127, tokens[127:131]))
    # the drafts did write entries from wrong rows, which the next step rewrote
    assert not torch.allclose(stale_hca, clean.hca_kv[:, 1, 0], atol=1e-3)
    assert not torch.allclose(stale_csa, clean.csa_kv[:, 1, 31], atol=1e-3)
    torch.testing.assert_close(dirty_logits, clean_logits, atol=FP32_ATOL, rtol=0)
    for mine, theirs in zip(dirty.tensors(), clean.tensors(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=FP32_ATOL, rtol=0)


# ----- the MTP layer's math, written out -----


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, c: V4Config, sign: float) -> torch.Tensor:
    """Rotate the last qk_rope_head_dim channels of x [T, ..., C] in interleaved pairs by
    sign * position * theta^(-2i/R) (the main rope: sliding layers)."""
    r = c.qk_rope_head_dim
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    angle = sign * positions.float()[:, None] * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    x0, x1 = x[..., -r::2], x[..., -r + 1 :: 2]
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], rotated), dim=-1)


def _mix(streams: torch.Tensor, w: dict[str, torch.Tensor], p: str, c: V4Config) -> tuple:
    """mHC: streams [T, N, D] -> (block input [T, D], post [T, N], comb [T, N, N])."""
    n = c.hc_mult
    mixes = _rms(streams.flatten(1), None, c.rms_norm_eps) @ w[f"{p}_fn"].T
    base, scale = w[f"{p}_base"], w[f"{p}_scale"]
    pre = torch.sigmoid(mixes[:, :n] * scale[0] + base[:n]) + c.hc_eps
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = (mixes[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n).softmax(-1) + c.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
    for _ in range(c.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + c.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
    return (pre[..., None] * streams).sum(1), post, comb


def _expand(streams, out, post, comb):  # type: ignore[no-untyped-def]
    """new stream j = post_j * out + sum_i comb[i, j] * stream i."""
    return post[..., None] * out[:, None] + torch.einsum("tij,tid->tjd", comb, streams)


def _attention(x: torch.Tensor, w: dict[str, torch.Tensor], c: V4Config) -> torch.Tensor:
    """Sliding-window attention of a whole sequence x [T, D] with sinks, K = V."""
    t, h, d = x.shape[0], c.num_attention_heads, c.head_dim
    eps, pos = c.rms_norm_eps, torch.arange(t)
    q_lora = _rms(x @ w["attn.wq_a.weight"].T, w["attn.q_norm.weight"], eps)
    q = _rope(_rms((q_lora @ w["attn.wq_b.weight"].T).view(t, h, d), None, eps), pos, c, 1.0)
    kv = _rope(_rms(x @ w["attn.wkv.weight"].T, w["attn.kv_norm.weight"], eps), pos, c, 1.0)
    logits = torch.einsum("thd,sd->hts", q, kv) * d**-0.5
    offset = pos[:, None] - pos[None, :]
    visible = (offset >= 0) & (offset < c.sliding_window)
    logits = logits.masked_fill(~visible, float("-inf"))
    sink = w["attn.attn_sink"].view(h, 1, 1).expand(h, t, 1)
    probs = torch.cat((logits, sink), dim=-1).softmax(-1)[..., :-1]
    out = _rope(torch.einsum("hts,sd->thd", probs, kv), pos, c, -1.0)
    g = c.o_groups
    wo_a = w["attn.wo_a.weight"].view(g, c.o_lora_rank, -1)
    mid = torch.einsum("tgi,gri->tgr", out.reshape(t, g, -1), wo_a).flatten(1)
    return mid @ w["attn.wo_b.weight"].T


def _swiglu(x: torch.Tensor, w: dict[str, torch.Tensor], p: str, limit: float) -> torch.Tensor:
    gate = (x @ w[f"{p}.w1.weight"].T).clamp(max=limit)
    up = (x @ w[f"{p}.w3.weight"].T).clamp(-limit, limit)
    return (F.silu(gate) * up) @ w[f"{p}.w2.weight"].T


def _moe(x: torch.Tensor, w: dict[str, torch.Tensor], c: V4Config) -> torch.Tensor:
    """Top-k routed experts (sqrt-softplus scores, correction bias) plus the shared expert."""
    assert c.scoring_func == "sqrtsoftplus" and c.norm_topk_prob
    scores = F.softplus(x @ w["ffn.gate.weight"].T).sqrt()
    ids = (scores + w["ffn.gate.bias"]).topk(c.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
    out = _swiglu(x, w, "ffn.shared_experts", c.swiglu_limit)
    for t in range(x.shape[0]):
        for e, weight in zip(ids[t].tolist(), weights[t], strict=True):
            out[t] += weight * _swiglu(x[t : t + 1], w, f"ffn.experts.{e}", c.swiglu_limit)[0]
    return out


def mtp_logits_reference(
    tensors: dict[str, torch.Tensor], c: V4Config, streams: torch.Tensor, next_ids: torch.Tensor
) -> torch.Tensor:
    """The MTP layer over a whole sequence: the main model's final streams [T, N, D] at t and
    token t + 1 -> logits [T, V] for token t + 2 (`mtp.0.*`, shared embedding and head)."""
    w = {k.removeprefix("mtp.0."): v for k, v in tensors.items() if k.startswith("mtp.0.")}
    embed = tensors.get("embed.weight", tensors.get("model.embed_tokens.weight"))
    assert embed is not None
    eps = c.rms_norm_eps
    x = _rms(streams, w["hnorm.weight"], eps) @ w["h_proj.weight"].T
    x = x + (_rms(embed[next_ids], w["enorm.weight"], eps) @ w["e_proj.weight"].T)[:, None]
    block_in, post, comb = _mix(x, w, "hc_attn", c)
    x = _expand(x, _attention(_rms(block_in, w["attn_norm.weight"], eps), w, c), post, comb)
    block_in, post, comb = _mix(x, w, "hc_ffn", c)
    x = _expand(x, _moe(_rms(block_in, w["ffn_norm.weight"], eps), w, c), post, comb)
    n = c.hc_mult
    flat = _rms(x.flatten(1), None, eps)
    pre = torch.sigmoid(flat @ w["hc_head_fn"].T * w["hc_head_scale"] + w["hc_head_base"])
    hidden = _rms(((pre + c.hc_eps)[..., None] * x[:, :n]).sum(1), w["norm.weight"], eps)
    return hidden @ tensors["head.weight"].T


@pytest.mark.parametrize("name", ["official", "coder-v4"])
def test_mtp_logits_equal_the_reference_math(checkpoints: dict[str, Path], name: str) -> None:
    """The engine's MTP layer over a 40-token prompt (past its window of 16 / 64), its cache
    filled in two chunks, against `mtp_logits_reference` on the dequantised checkpoint tensors;
    both read the same main-model streams."""
    path = CODER if name == "coder-v4" else checkpoints[name]
    config = V4Config.from_dir(path)
    model = load_model(path, config, CPU, torch.float32, load_mtp=True)
    block = default_block_size(config)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, min(config.vocab_size, 1000), (41,), generator=g).tolist()
    prompt, next_ids = ids[:40], torch.tensor(ids[1:])

    def batch(start: int, end: int) -> ForwardBatch:
        return ForwardBatch.build([prompt[start:end]], [start], [[1]], block, [False], CPU)

    with torch.no_grad():
        streams = model.forward_streams(batch(0, 40), V4Cache(config, 2, block, torch.float32, CPU))
        mtp_cache = torch.zeros(1, 2, block, config.head_dim)
        logits = torch.cat(
            [
                model.compute_mtp_logits(
                    model.forward_mtp(next_ids[a:b], streams[a:b], batch(a, b), mtp_cache)
                )
                for a, b in ((0, 23), (23, 40))
            ]
        )
        tensors = dict(iter_v4_tensors(path, torch.float32))
        tensors = {k: v.float() for k, v in tensors.items()}
        expected = mtp_logits_reference(tensors, config, streams, next_ids)
    torch.testing.assert_close(logits, expected, atol=FP32_ATOL, rtol=0)


# ----- the trained coder-v4 -----

CODER_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n"
    '        self.path = path\n        self.values = {}\n\n    def load(self):\n        """Read '
    'the file."""\n        with open(self.path) as f:\n            for line in f:\n'
    "                line = line.strip()\n                if not line or line.startswith('#'):\n"
    "                    continue\n                key, _, value = line.partition('=')\n",
]


def test_coder_v4_greedy_output_equals_speculation_off() -> None:
    """Two prompts (one past the window of 64 and HCA's 64-token windows), 48 tokens each;
    prints the acceptance rate per draft position at K = 1, 2, 3."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    config = dict(BASE, max_num_batched_tokens=32)
    off = LLM(CODER, EngineConfig(**config)).generate(CODER_PROMPTS, params)
    assert len(off[1].prompt_token_ids) > 64
    for k in (1, 2, 3):
        llm = LLM(CODER, EngineConfig(**config, speculative_method="mtp", num_speculative_tokens=k))
        on = llm.generate(CODER_PROMPTS, params)
        assert [o.token_ids for o in on] == [o.token_ids for o in off]
        stats = llm.engine.spec_decode_stats()
        assert stats is not None and stats.num_accepted_tokens > 0
        rates = ", ".join(f"{r:.3f}" for r in stats.acceptance_rate_per_position)
        print(
            f"coder-v4 K={k}: acceptance per position [{rates}], "
            f"mean accepted length {stats.mean_accepted_length:.2f}"
        )


# ----- configuration -----


def test_v4_refuses_a_draft_model(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="draft_model' is not available for DeepSeek-V4"):
        LLM(
            checkpoints["hf"],
            EngineConfig(
                **BASE,
                speculative_method="draft_model",
                num_speculative_tokens=1,
                draft_model=str(checkpoints["official"]),
            ),
        )


def test_mtp_needs_the_checkpoint_mtp_layer(tmp_path: Path) -> None:
    """transformers' layout as the tiny preset writes it declares no MTP layer and holds no
    `mtp.0.*`; declaring one without its tensors fails at loading."""
    path = init_model(tmp_path / "plain", "tiny", seed=6, arch="deepseek_v4", verbose=False)
    spec = EngineConfig(**BASE, speculative_method="mtp", num_speculative_tokens=1)
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP layer"):
        LLM(path, spec)
    with pytest.raises(CheckpointError, match="no MTP layer"):
        LLM(with_mtp_layer(path, tensors=False), spec)


def test_kv_memory_carries_the_mtp_window(checkpoints: dict[str, Path]) -> None:
    """The hand-off's KV groups: V4's `full` and `window`, and the MTP layer's window entries as
    `draft` on the window table, over the same span."""
    llm = LLM(
        checkpoints["hf"], EngineConfig(**BASE, speculative_method="mtp", num_speculative_tokens=2)
    )
    groups = {m.name: m for m in llm.engine.kv_memory()}
    assert list(groups) == ["full", "window", "draft"]
    draft = groups["draft"]
    assert draft.table == "window" and draft.span == groups["window"].span
    assert draft.tensors[0].shape[1] == llm.engine.runner.kv_layout.num_window_blocks
    request_id = llm.engine.add_request([5, 6, 7], GREEDY)
    llm.engine.step()
    tables = llm.engine.kv_tables(request_id)
    assert set(tables) == {"full", "window", "draft"} and tables["draft"] == tables["window"]
