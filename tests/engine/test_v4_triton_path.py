"""The DeepSeek-V4 engine's CUDA path, walked on CPU: under `force_triton` the V4 modules call
the Triton kernels of `pdmesh_kernels` (mHC collapse/expand, compressor pooling, the indexer's
scores, the sparse attention) under the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py
before triton's first import), and the engine's greedy tokens equal the torch path's.

The model is the tiny random V4 preset; the prompts are short (the interpreter is slow), one of
them long enough (40 tokens: past the window of 16, 10 CSA entries for a top-k of 8) for the
indexer to leave entries out.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from pdmesh.tools.model_init import init_model  # noqa: E402
from pdmesh_engine import EngineConfig, EngineCore, SamplingParams  # noqa: E402
from pdmesh_engine.model.deepseek_v4 import attention, blocks  # noqa: E402
from pdmesh_kernels import force_triton  # noqa: E402

SETTINGS = dict(device="cpu", dtype="float32", num_threads=1, num_blocks=24)
NUM_NEW = 3
# the kernels the V4 modules call on the Triton path, by module
KERNELS = {
    blocks: ("mhc_collapse_triton", "mhc_expand_triton"),
    attention: ("compressor_pool_triton", "indexer_topk_triton", "v4_attention_triton"),
}


def _require_interpreter() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from pdmesh_kernels import v4_mhc

    if not isinstance(v4_mhc._mhc_collapse_kernel, InterpretedFunction):
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set: set it in a conftest "
            "(tests/conftest.py does) before anything imports pdmesh_kernels"
        )


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v4-triton")
    return init_model(root / "tiny", "tiny", seed=1, arch="deepseek_v4", verbose=False)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    return {
        f"p{i}": torch.randint(2, 1000, (n,), generator=g).tolist() for i, n in enumerate((3, 40))
    }


def _generate(path: Path) -> dict[str, list[int]]:
    eng = EngineCore(path, EngineConfig(**SETTINGS))
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
    tokens: dict[str, list[int]] = {}
    for request_id, prompt in _prompts().items():
        eng.add_request(prompt, params, request_id=request_id)
        tokens[request_id] = []
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id].extend(out.new_token_ids)
    eng.check_integrity()
    return tokens


def _count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    for module, names in KERNELS.items():
        for name in names:
            kernel = getattr(module, name)

            def counting(*args: Any, _kernel: Any = kernel, _name: str = name, **kw: Any) -> Any:
                calls[_name] += 1
                return _kernel(*args, **kw)

            monkeypatch.setattr(module, name, counting)
    return calls


def test_triton_path_gives_the_torch_tokens(tiny_v4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _require_interpreter()
    calls = _count_kernel_calls(monkeypatch)
    expected = _generate(tiny_v4)
    assert not calls, "the torch path called a Triton kernel"
    with force_triton():
        got = _generate(tiny_v4)
    assert got == expected
    assert all(len(t) == NUM_NEW for t in got.values())
    for names in KERNELS.values():
        for name in names:
            assert calls[name] > 0, f"{name} was never called on the Triton path"
