"""The CUDA-graph decode path (pdmesh_engine.cuda_graphs), walked without a GPU.

`force_triton` runs the engine's CUDA path on CPU: plain weight layouts, no C path, the Triton
kernels under the interpreter. Graphs are "captured" by `capture_eager`, which replays a step by
running it again over the same static inputs; so these tests check everything but the capture
itself: bucketing, padding into the scratch block, the static inputs, expert loads without the
padding rows, recapture at a placement switch, and that a step does nothing a CUDA capture forbids
(host syncs, tensors made from host data, data-dependent shapes).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
pytest.importorskip("transformers")

from test_reference import make_engine, random_ids, reference_generate, run_engine  # noqa: E402

from pdmesh_engine import SamplingParams  # noqa: E402
from pdmesh_engine.config import ModelConfig  # noqa: E402
from pdmesh_engine.cuda_graphs import DecodeGraphs, buckets, capture_eager  # noqa: E402
from pdmesh_engine.forward_batch import ForwardBatch  # noqa: E402
from pdmesh_engine.model.deepseek_v3.runtime import load_model  # noqa: E402
from pdmesh_engine.model.moe import ExpertLoadRecorder, ExpertPlacement  # noqa: E402
from pdmesh_kernels import force_triton  # noqa: E402
from pdmesh_service.worker.engine_options import (  # noqa: E402
    add_engine_options,
    engine_argv,
    engine_config,
)

BLOCK = 4
# ops a CUDA capture cannot hold: a read back to the host, a tensor made from host data, a shape
# that depends on the data
FORBIDDEN = {"_local_scalar_dense", "lift_fresh", "nonzero", "masked_select", "unique_dim"}


class _NoHostSync(TorchDispatchMode):
    """Fails on the ops of FORBIDDEN and on boolean-mask indexing."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in FORBIDDEN:
            raise AssertionError(f"{func} in a graphed step")
        if name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
        ):
            raise AssertionError(f"{func} with a boolean mask in a graphed step")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_sync() -> Iterator[None]:
    """`_NoHostSync`, and `Tensor.tolist` (which dispatches no op) refused too."""
    tolist = torch.Tensor.tolist

    def refuse(self: torch.Tensor) -> Any:
        raise AssertionError("Tensor.tolist in a graphed step")

    torch.Tensor.tolist = refuse  # type: ignore[method-assign]
    try:
        with _NoHostSync():
            yield
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]


def test_the_host_sync_check_can_fail() -> None:
    for op in (
        lambda: torch.ones(2).sum().item(),
        lambda: torch.ones(2).tolist(),
        lambda: torch.tensor([1, 2]),
        lambda: torch.arange(4)[torch.arange(4) > 1],
    ):
        with pytest.raises(AssertionError), no_host_sync():
            op()


def test_buckets() -> None:
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]


def test_graphed_engine_matches_transformers(reference_models) -> None:
    """Three requests decode in bucket 4 (one padding row) on the CUDA path, token-exact against
    transformers; every expert load counted is a real token's."""
    ref = reference_models["base"]
    prompts = {f"p{i}": random_ids(300 + i, n, ref.vocab_size) for i, n in enumerate((3, 9, 5))}
    num_new = 4
    params = SamplingParams(max_tokens=num_new, min_tokens=num_new, temperature=0)
    with force_triton():
        eng = make_engine(ref, cuda_graph_max_batch=8, max_model_len=32, block_size=BLOCK)
        graphs = eng.runner.graphs
        assert graphs is not None and eng.runner.model.cpu_layers is None
        assert eng.runner.scratch_block == eng.runner.kv_layout.num_blocks - 1
        assert eng.kv_stats().num_free == eng.runner.scratch_block  # never handed out
        replays = _count_calls(graphs, "run")
        results = run_engine(eng, prompts, params)
    for rid, prompt in prompts.items():
        expected, _ = reference_generate(ref, prompt, num_new)
        assert results[rid].tokens == expected, rid
    assert replays[0] == num_new - 1  # every decode step, none of the prefill
    assert list(graphs._graphs) == [(4, True)]
    loads = eng.runner.expert_load
    assert loads is not None
    top_k = ref.model.config.num_experts_per_tok
    tokens = sum(len(p) for p in prompts.values()) + len(prompts) * (num_new - 1)
    assert loads.window_totals().sum(1).tolist() == [tokens * top_k] * loads.counts.shape[1]


def _count_calls(obj: Any, name: str) -> list[int]:
    count = [0]
    method = getattr(obj, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return method(*args, **kwargs)

    setattr(obj, name, counting)
    return count


def _decode_batch(lens: list[int], num_blocks: int, device: torch.device) -> ForwardBatch:
    """Decodes at context `lens` (the new token included) over distinct, shuffled blocks."""
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // BLOCK)
        tables.append(order[used : used + need])
        used += need
    ids = [[7 + i] for i in range(len(lens))]
    return ForwardBatch.build(ids, [n - 1 for n in lens], tables, BLOCK, [True] * len(lens), device)


def test_padding_static_inputs_and_recapture(reference_models) -> None:
    """A graphed step equals the eager forward and writes no cache row but its own and the
    scratch block's, with no host sync inside; a placement switch recaptures."""
    ref = reference_models["base"]
    config = ModelConfig.from_dir(Path(ref.path))
    device, num_blocks = torch.device("cpu"), 24
    with force_triton(), torch.inference_mode():
        model = load_model(Path(ref.path), config, device, torch.float32)
        assert model.cpu_layers is None
        entry = config.kv_cache_dim
        caches = torch.randn(config.num_hidden_layers, num_blocks, BLOCK, entry)
        captures = [0]

        def counting_capture(step: Any) -> Any:
            captures[0] += 1
            return capture_eager(step)

        graphs = DecodeGraphs(model, caches, num_blocks - 1, 8, 6, counting_capture)
        recorder = ExpertLoadRecorder(len(model.moe_layers), config.n_routed_experts)
        lens = [9, 1, 12, 20, 3]  # bucket 8: three padding rows
        batch = _decode_batch(lens, num_blocks, device)
        assert graphs.takes(batch)
        eager_caches = caches.clone()
        expected = model(batch, eager_caches)
        with no_host_sync():
            got = graphs.run(batch, recorder)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        rows, eager_rows = (c.view(c.shape[0], -1, entry) for c in (caches, eager_caches))
        written = batch.slot_mapping
        torch.testing.assert_close(rows[:, written], eager_rows[:, written])
        untouched = torch.ones(rows.shape[1], dtype=torch.bool)
        untouched[written] = False
        untouched[(num_blocks - 1) * BLOCK :] = False  # the scratch block
        assert torch.equal(rows[:, untouched], eager_rows[:, untouched])
        assert recorder.current.sum().item() == len(lens) * config.num_experts_per_tok * 2
        graphs.run(batch, recorder)
        assert captures[0] == 1  # replayed
        moe = model.moe_layers[0]
        swapped = list(range(config.n_routed_experts))
        swapped[0], swapped[1] = 1, 0
        moe.set_placement(ExpertPlacement.from_slots(swapped, config.n_routed_experts))
        moe.w13.data[[0, 1]] = moe.w13.data[[1, 0]]
        moe.w2.data[[0, 1]] = moe.w2.data[[1, 0]]
        expected = model(batch, caches.clone())
        got = graphs.run(batch, recorder)
        assert captures[0] == 2  # the new placement's graph
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        wide = _decode_batch([4 * BLOCK * 2], num_blocks, device)  # 8 blocks > 6
        assert not graphs.takes(wide)
        chunk = ForwardBatch.build([[1, 2]], [0], [[0]], BLOCK, [True], device)
        assert not graphs.takes(chunk)


def test_the_option_and_the_cpu_engine(reference_models) -> None:
    """--cuda-graph-max-batch reaches the config and the workers' argv; the CPU path (the C layers)
    neither builds graphs nor keeps a scratch block."""
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_config(parser.parse_args([])).cuda_graph_max_batch == 64
    args = parser.parse_args(["--cuda-graph-max-batch", "0"])
    assert engine_config(args).cuda_graph_max_batch == 0
    assert engine_argv(args) == ["--cuda-graph-max-batch", "0"]
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        engine_config(parser.parse_args(["--cuda-graph-max-batch", "-1"]))
    eng = make_engine(reference_models["base"])
    assert eng.runner.graphs is None and eng.runner.scratch_block is None
    assert eng.kv_stats().num_free == eng.runner.kv_layout.num_blocks
