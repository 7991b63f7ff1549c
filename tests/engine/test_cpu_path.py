"""The small-batch CPU path (`pdmesh_engine.model.deepseek_v3.cpu_path`, the C kernel of
`pdmesh_kernels.cpu_layers`) against the engine's torch path on the same weights:

- for the three reference configs (q-LoRA or not, interleaved or not, yarn, attention biases,
  dense and MoE layers, 1 or 2 shared experts) and batches of decodes, prefill chunks and both
  mixed, the hidden states, the cache entries written and the expert loads recorded agree;
- a placement with replicas (slots chosen by token index) and a switch to another placement
  between steps are followed, with the same recorded slots as the torch path;
- the MTP block agrees too, and so do the heads' logits;
- a row's hidden state, cache entry and logits are bit-identical alone or beside other rows (one
  decode against the same decode in a batch with a long chunk), which greedy speculative
  decoding's equality with plain decoding rests on;
- a forward on the C path runs a handful of aten ops whatever the layer count; batches above
  and every batch takes the C path; DEP (experts on other ranks) and
  `PDMESH_CPU_LAYERS=0` keep the torch path;
- the library is compiled once into the kernel cache and loaded from there afterwards;
- a MoE layer's expert table starts on a huge page and lies in huge pages, and every copy of the
  weights the path reads is listed for the loader to advise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from memory_maps import expect_huge, huge_pages_available
from small_models import small_config
from torch.utils._python_dispatch import TorchDispatchMode

from pdmesh_engine.config import ModelConfig
from pdmesh_engine.forward_batch import ForwardBatch
from pdmesh_engine.model.deepseek_v3 import cpu_path
from pdmesh_engine.model.deepseek_v3.model import DeepseekV3ForCausalLM
from pdmesh_engine.model.deepseek_v3.runtime import load_model
from pdmesh_engine.model.moe import ExpertDispatcher, ExpertLoadRecorder, ExpertPlacement, MoE
from pdmesh_kernels import cpu_layers

pytestmark = pytest.mark.skipif(
    cpu_layers.library() is None, reason="no C compiler: the CPU layer path is off"
)

BLOCK = 4


def _prefill(
    model: DeepseekV3ForCausalLM, caches: torch.Tensor, lens: list[int], seed: int, room: int = 8
):
    """Fill the caches of len(lens) sequences through the torch path; returns their tokens and
    block lists (scattered blocks, with room for `room` more tokens each)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
    free = torch.randperm(caches.shape[1] - 1, generator=gen).add(1).tolist()
    blocks = []
    for n in lens:
        count = -(-(n + room) // BLOCK)
        blocks.append([free.pop() for _ in range(count)])
    batch = ForwardBatch.build(tokens, [0] * len(lens), blocks, BLOCK, [True] * len(lens), "cpu")
    path, model.cpu_layers = model.cpu_layers, None
    model(batch, caches)
    model.cpu_layers = path
    return tokens, blocks


def _both_paths(
    model: DeepseekV3ForCausalLM,
    batch: ForwardBatch,
    caches: torch.Tensor,
    num_physical: int | None = None,
) -> dict[str, Any]:
    """Run `batch` on the torch path and the C path from the same caches."""
    results: dict[str, Any] = {}
    path = model.cpu_layers
    assert path is not None and path.takes(batch, caches)
    for name, use in (("torch", None), ("c", path)):
        model.cpu_layers = use
        kv = caches.clone()
        load = None
        if num_physical is not None:
            load = ExpertLoadRecorder(len(model.moe_layers), num_physical, window=2)
        results[name] = (model(batch, kv, load), kv, load)
    model.cpu_layers = path
    return results


def _assert_agree(results: dict[str, Any]) -> None:
    (hidden, kv, load), (c_hidden, c_kv, c_load) = results["torch"], results["c"]
    scale = hidden.abs().max().item()
    torch.testing.assert_close(c_hidden, hidden, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(c_kv, kv, rtol=1e-5, atol=1e-5)
    if load is not None:
        assert torch.equal(c_load._current, load._current)
        assert load._current.sum() > 0


@pytest.mark.parametrize("name", ["base", "yarn_noqlora", "yarn_dense2"])
@pytest.mark.parametrize("kind", ["decodes", "chunks", "mixed", "long"])
@torch.inference_mode()
def test_c_path_matches_the_torch_path(reference_models: dict, name: str, kind: str) -> None:
    ref = reference_models[name]
    config = ModelConfig.from_dir(ref.path)
    model = load_model(ref.path, config, torch.device("cpu"), torch.float32)
    assert model.cpu_layers is not None
    caches = torch.zeros(config.num_hidden_layers, 64, BLOCK, config.kv_cache_dim)
    lens = [23, 9, 1, 14]
    tokens, blocks = _prefill(model, caches, lens, seed=len(kind), room=40)
    new = {
        "decodes": [[5], [6], [7], [8]],
        "chunks": [[5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6, 7], [3]],
        "mixed": [[5], [6], [7, 8, 9, 10], [11, 12]],
        "long": [[5], list(range(1, 41)), [7, 8], [9]],  # 43 tokens: the many-token products
    }[kind]
    batch = ForwardBatch.build(new, lens, blocks, BLOCK, [True] * 4, "cpu")
    moe = model.moe_layers
    _assert_agree(_both_paths(model, batch, caches, moe[0].placement.num_physical if moe else None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_two_threads_give_the_one_thread_result(dtype: torch.dtype) -> None:
    # wide enough that every parallel region of the kernel runs threaded (PAR_MIN_MACS); the
    # 1,100-token prefill also threads the loops over rows (norms, routing, the experts' sums,
    # bf16's fp32 router: PAR_MIN_ROW_WORK); the one decode hands products out whole and splits
    # its 4 heads 2 + 2 between the threads (a score must not depend on its tile's other heads)
    wide = dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        max_position_embeddings=256,
    )
    model = _random_model(
        dtype=dtype, num_attention_heads=4, kv_lora_rank=64, q_lora_rank=64, **wide
    )
    config = model.config
    caches = torch.zeros(config.num_hidden_layers, 480, BLOCK, config.kv_cache_dim, dtype=dtype)
    lens = [97, 3, 130, 8, 72, 45]
    _, blocks = _prefill(model, caches, lens, seed=4)
    one = ForwardBatch.build([[1]], lens[:1], blocks[:1], BLOCK, [True], "cpu")
    decodes = ForwardBatch.build(
        [[1], [2, 3, 4], [5], [6, 7], [8], [9]], lens, blocks, BLOCK, [True] * 6, "cpu"
    )
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(0, config.vocab_size, (220,), generator=gen).tolist() for _ in range(5)
    ]
    used = {block for table in blocks for block in table}
    fresh = [block for block in range(1, 480) if block not in used]
    prompt_blocks = [fresh[i * 56 : (i + 1) * 56] for i in range(5)]
    prefill = ForwardBatch.build(prompts, [0] * 5, prompt_blocks, BLOCK, [True] * 5, "cpu")
    assert prefill.num_tokens * config.hidden_size >= 1 << 17
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            kv = caches.clone()
            outputs.append((model(one, kv), model(decodes, kv), model(prefill, kv), kv))
    finally:
        torch.set_num_threads(threads)
    # threads split columns, (token, head) pairs and rows, never a sum: bit-identical results
    for one, two in zip(*outputs, strict=True):
        assert torch.equal(one, two)


def _random_model(
    placement: ExpertPlacement | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    bf16_values: bool = False,
    **overrides: Any,
) -> DeepseekV3ForCausalLM:
    """Random weights (by `seed`) in `dtype` (the routers fp32, as `load_model` keeps them); with
    `bf16_values` fp32 weights that bf16 holds exactly (those of the bf16 model of the seed)."""
    config = small_config(
        **{
            "num_hidden_layers": 3,
            "num_experts_per_tok": 3,
            "n_group": 4,
            "topk_group": 2,
            "num_nextn_predict_layers": 1,
            **overrides,
        }
    )
    placements = None if placement is None else [placement] * len(config.moe_layer_ids)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config, placements)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
            if bf16_values or dtype == torch.bfloat16:
                param.copy_(param.bfloat16())
        for moe in model.moe_layers:  # replicas hold their expert's weights (its first slot's)
            for slot, expert in enumerate(moe.slot_experts):
                first = int(moe.placement.replicas[expert, 0])
                moe.w13.data[slot], moe.w2.data[slot] = moe.w13[first], moe.w2[first]
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, MoE):
            module.gate.float()
    model.rope.materialize(config)
    for layer in list(model.layers) + [m.block for m in model.mtp]:
        layer.self_attn.process_weights()
    cpu_path.use_cpu_layouts(model)
    return model.eval()


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages here")
def test_expert_tables_lie_in_huge_pages_and_every_copy_is_listed() -> None:
    # 64 experts of 3 x 128 x 128 fp32 weights: a 12 MiB table a MoE layer, streamed every step
    model = _random_model(hidden_size=128, moe_intermediate_size=128, n_routed_experts=64)
    path = model.cpu_layers
    assert path is not None
    listed = {t.untyped_storage().data_ptr() for t in path.tensors()}
    for w13, w2, _ in path._expert_copies.values():
        assert w13.data_ptr() % (2 << 20) == 0  # the layer's table starts on a huge page
        assert w2.data_ptr() == w13.data_ptr() + w13.nbytes  # and its w2 slots follow
        end = w2.data_ptr() + w2.nbytes
        expect_huge(w13.data_ptr(), end, at_least=end - w13.data_ptr() - (2 << 20))
        assert w13.untyped_storage().data_ptr() in listed
    for packed in path._packed.values():
        assert packed.data.untyped_storage().data_ptr() in listed


@torch.inference_mode()
def test_replicas_and_a_placement_switch_are_followed() -> None:
    # 8 experts on 12 slots: experts 0-3 have two replicas each
    placement = ExpertPlacement.initial(8, num_redundant=4)
    model = _random_model(placement)
    assert model.cpu_layers is not None
    config = model.config
    caches = torch.zeros(config.num_hidden_layers, 40, BLOCK, config.kv_cache_dim)
    lens = [11, 7, 19, 3, 5]
    _, blocks = _prefill(model, caches, lens, seed=3)
    batch = ForwardBatch.build([[1], [2], [3], [4], [5]], lens, blocks, BLOCK, [True] * 5, "cpu")
    first = _both_paths(model, batch, caches, placement.num_physical)
    _assert_agree(first)
    # another placement: the slots of experts 0 and 7 swapped, expert 5 in three slots, expert 1
    # in one
    moved = ExpertPlacement.from_slots([7, 1, 2, 3, 4, 5, 6, 0, 5, 5, 2, 3], 8)
    for moe in model.moe_layers:
        w13, w2 = moe.w13.data.clone(), moe.w2.data.clone()
        moe.w13.data[0], moe.w13.data[7] = w13[7], w13[0]
        moe.w2.data[0], moe.w2.data[7] = w2[7], w2[0]
        for slot in (8, 9):  # held expert 0 and 1 (the initial replicas), now expert 5
            moe.w13.data[slot], moe.w2.data[slot] = w13[5], w2[5]
        moe.set_placement(moved)
    results = _both_paths(model, batch, caches, moved.num_physical)
    _assert_agree(results)
    # the same tokens land on other slots now (and the outputs stay those of the same experts)
    assert not torch.equal(results["c"][2]._current, first["c"][2]._current)
    torch.testing.assert_close(results["c"][0], first["c"][0], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_mtp_block_matches_the_torch_path() -> None:
    model = _random_model()
    config = model.config
    caches = torch.zeros(1, 24, BLOCK, config.kv_cache_dim)
    gen = torch.Generator().manual_seed(2)
    batch = ForwardBatch.build([[3, 4, 5], [6]], [0, 0], [[1, 2], [3]], BLOCK, [True] * 2, "cpu")
    prev = torch.randn(batch.num_tokens, config.hidden_size, generator=gen)
    next_ids = torch.tensor([9, 10, 11, 12])
    path = model.cpu_layers
    model.cpu_layers = None
    expected_kv = caches.clone()
    expected = model.forward_mtp(next_ids, prev, batch, expected_kv)
    model.cpu_layers = path
    out = model.forward_mtp(next_ids, prev, batch, caches)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches, expected_kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 7, 40, 300])
@torch.inference_mode()
def test_the_heads_match_torch_and_a_row_is_the_same_in_any_batch(rows: int) -> None:
    # 1100 columns = 68 panels of 16 and a cut one; 1 row sweeps 4 panels at once, 300 rows pass
    # more than one token block
    model = _random_model(vocab_size=1100)
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    path = model.cpu_layers
    assert path is not None
    expected = model.lm_head(x)
    expected_mtp = model.mtp[0].shared_head(model.mtp[0].shared_head_norm(x))
    by_c = path.linear(x, model.lm_head)
    assert by_c is not None
    torch.testing.assert_close(by_c, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.compute_logits(x[-1:]), by_c[-1:])
    torch.testing.assert_close(model.compute_logits(x), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.compute_mtp_logits(x), expected_mtp, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_odd_expert_widths_are_packed_and_read_whole() -> None:
    """Experts 9 wide: w13's 18 columns fill a panel and cut the next, w2's 9 rows end in half a
    pair (the bf16 dot products' layout); 40 tokens of one sequence are a prefill chunk, so every
    expert sees several tokens at once."""
    model = _random_model(moe_intermediate_size=9)
    config = model.config
    caches = torch.zeros(config.num_hidden_layers, 40, BLOCK, config.kv_cache_dim)
    lens = [5, 9]
    _, blocks = _prefill(model, caches, lens, seed=2, room=48)
    chunk = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    batch = ForwardBatch.build([chunk.tolist(), [7]], lens, blocks, BLOCK, [True] * 2, "cpu")
    _assert_agree(_both_paths(model, batch, caches))


@pytest.mark.parametrize("expert_width", [16, 9])
@torch.inference_mode()
def test_bf16_weights_and_cache_follow_the_fp32_path(expert_width: int) -> None:
    """A bf16 model on the C path (bf16 weights and cache, fp32 arithmetic) against the torch path
    in fp32 on the same weight values and the same context, rounded as the bf16 cache holds it (9:
    odd expert widths, as in the fp32 test above)."""
    ref = _random_model(bf16_values=True, moe_intermediate_size=expert_width)
    model = _random_model(dtype=torch.bfloat16, moe_intermediate_size=expert_width)
    path = model.cpu_layers
    assert path is not None and path.dtype == torch.bfloat16
    config = model.config
    caches = torch.zeros(config.num_hidden_layers, 40, BLOCK, config.kv_cache_dim)
    lens = [13, 7, 22]
    _, blocks = _prefill(ref, caches, lens, seed=5)
    caches = caches.bfloat16().float()  # the context both paths read
    batch = ForwardBatch.build([[1], [2, 3, 4], [5]], lens, blocks, BLOCK, [True] * 3, "cpu")
    assert path.takes(batch, caches.bfloat16()) and not path.takes(batch, caches)
    ref.cpu_layers = None
    expected_kv = caches.clone()
    expected = ref(batch, expected_kv)
    kv = caches.bfloat16()
    hidden = model(batch, kv)
    assert hidden.dtype == torch.bfloat16
    scale = expected.abs().max().item()
    torch.testing.assert_close(hidden.float(), expected, rtol=2e-2, atol=2e-2 * scale)
    # the entries written are the fp32 path's, rounded to bf16
    torch.testing.assert_close(kv.float(), expected_kv, rtol=1e-2, atol=1e-2)
    assert not torch.equal(kv.float(), caches)
    logits, expected_logits = model.compute_logits(hidden), ref.compute_logits(expected)
    torch.testing.assert_close(logits, expected_logits, rtol=5e-2, atol=5e-2 * scale)
    assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_a_forward_is_a_few_ops_and_every_batch_takes_the_c_path() -> None:
    model = _random_model()
    config = model.config
    caches = torch.zeros(config.num_hidden_layers, 40, BLOCK, config.kv_cache_dim)
    small = ForwardBatch.build([[1], [2]], [0, 0], [[1], [2]], BLOCK, [True, True], "cpu")
    with _OpCount() as c_ops:
        model(small, caches)
    path, model.cpu_layers = model.cpu_layers, None
    with _OpCount() as torch_ops:
        model(small, caches)
    model.cpu_layers = path
    assert c_ops.count <= 12 < torch_ops.count  # embedding, the kernel's inputs, the final norm
    n = 100  # chunks of 3 tokens, 300 in all
    big = ForwardBatch.build([[1, 2, 3]] * n, [0] * n, [[1]] * n, BLOCK, [True] * n, "cpu")
    assert path is not None and path.takes(big, caches)
    assert path.takes(small, caches) and not path.takes(small, caches.double())


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_row_computes_the_same_alone_and_beside_other_rows(dtype: torch.dtype) -> None:
    # bf16: on a CPU with bf16 dot products, a few tokens' products stream W a pair of rows at a
    # time and many tokens' go by register blocks; each column's sum is the same chain either way
    model = _random_model(
        dtype=dtype, hidden_size=64, intermediate_size=96, moe_intermediate_size=40
    )
    config = model.config
    caches = torch.zeros(config.num_hidden_layers, 48, BLOCK, config.kv_cache_dim, dtype=dtype)
    lens = [11, 5, 17]
    _, blocks = _prefill(model, caches, lens, seed=7, room=40)
    alone = ForwardBatch.build([[3]], lens[:1], blocks[:1], BLOCK, [True], "cpu")
    last_alone = ForwardBatch.build([[4]], lens[2:], blocks[2:], BLOCK, [True], "cpu")
    crowd = ForwardBatch.build(
        [[3], list(range(2, 39)), [4]], lens, blocks, BLOCK, [True] * 3, "cpu"
    )  # a decode, a 37-token chunk (many-token products, the expanded attention), a decode
    kv_alone, kv_crowd = caches.clone(), caches.clone()
    hidden_alone, hidden_crowd = model(alone, kv_alone), model(crowd, kv_crowd)
    assert torch.equal(hidden_alone[0], hidden_crowd[0])
    assert torch.equal(kv_alone[:, blocks[0]], kv_crowd[:, blocks[0]])
    # the decode after the chunk, too (the absorbed tokens are not a prefix of the batch)
    assert torch.equal(model(last_alone, caches.clone())[0], hidden_crowd[38])
    logits = model.compute_logits(hidden_crowd)  # 39 rows: the head by many tokens' kernel
    assert logits.dtype == torch.float32  # (the sums, not rounded to bf16 first)
    assert torch.equal(model.compute_logits(hidden_alone), logits[:1])


class _RemoteExperts(ExpertDispatcher):
    def __call__(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
        raise AssertionError("not called")


def test_dep_and_the_switch_keep_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _random_model()
    for moe in model.moe_layers:
        moe.dispatcher = _RemoteExperts()
    assert cpu_path.CpuLayerPath.build(model) is None
    monkeypatch.setenv("PDMESH_CPU_LAYERS", "0")
    assert not cpu_layers.enabled()


def test_the_library_is_built_once_into_the_cache(tmp_path: Path) -> None:
    script = (
        "import torch; from pdmesh_kernels import cpu_layers as c; "
        "print(c.library() is not None, c.library(torch.bfloat16) is not None, "
        "c.library(torch.float16), sorted(p.name for p in c._cache_dir().iterdir()))"
    )
    env = {**os.environ, "PDMESH_KERNEL_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    built = sorted(tmp_path.glob("pdmesh_layers-*.so"))
    assert first.stdout.startswith("True True None") and len(built) == 2  # fp32, bf16; no fp16
    assert [p.name.split("-")[1] for p in built] == ["bfloat16", "float32"]
    stamps = [p.stat().st_mtime_ns for p in built]
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert second.stdout == first.stdout and [p.stat().st_mtime_ns for p in built] == stamps
    off = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "PDMESH_CPU_LAYERS": "0"},
        capture_output=True,
        text=True,
    )
    assert off.stdout.startswith("False")


def test_without_a_compiler_the_best_prebuilt_level_the_cpu_runs_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image's runtime stage has no compiler: `--prebuild` fills a folder at build time, and the
    library loads from it, at the best micro-architecture level this CPU's flags allow."""
    prebuilt = tmp_path / "prebuilt"
    made = subprocess.run(
        [sys.executable, "-m", "pdmesh_kernels.cpu_layers", "--prebuild", str(prebuilt)],
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    assert len(list(prebuilt.glob("*.so"))) == len(cpu_layers.DTYPE_FLAGS) * len(cpu_layers.LEVELS)
    bare = tmp_path / "bin"  # a PATH with no cc or gcc
    bare.mkdir()
    script = (
        "import torch; from pdmesh_kernels import cpu_layers as c; lib = c.library(); "
        "print(c._compiler(), lib.origin, c.library(torch.bfloat16) is not None)"
    )
    env = {
        **os.environ,
        "PATH": str(bare),
        "CC": "no-such-cc",
        "PDMESH_KERNEL_PREBUILT": str(prebuilt),
        "PDMESH_KERNEL_CACHE": str(tmp_path / "cache"),
    }
    loaded = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    monkeypatch.setenv("PDMESH_KERNEL_PREBUILT", str(prebuilt))
    best = cpu_layers.prebuilt(torch.float32)  # chosen from this CPU's flags
    assert best is not None
    assert loaded.stdout.split() == ["None", "prebuilt", best.name, "True"]
    assert not (tmp_path / "cache").exists()  # nothing was compiled at run time
    # the level follows the CPU's flags; a CPU below every level gets none
    v3 = " ".join(cpu_layers.LEVELS["x86-64-v3"] + cpu_layers.LEVELS["x86-64-v2"])
    v2 = " ".join(cpu_layers.LEVELS["x86-64-v2"])
    assert "-x86-64-v3-" in str(cpu_layers.prebuilt(torch.float32, flags=v3))
    assert "-x86-64-v2-" in str(cpu_layers.prebuilt(torch.bfloat16, flags=v2))
    assert cpu_layers.prebuilt(torch.float32, flags="sse2") is None
    # a library built from another source is not used
    for path in prebuilt.glob("*.so"):
        path.rename(path.with_name(path.name.replace(cpu_layers._source_key(), "0" * 16)))
    assert cpu_layers.prebuilt(torch.float32) is None
