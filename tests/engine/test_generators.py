"""Seeded requests' generators live in the model runner, keyed by request id; `Request` stays pure
data.

- made on a request's first sample, dropped once the scheduler reports it finished or aborted;
- a request whose first token was sampled by another engine (prefill → decode hand-off) continues
  the very stream one engine alone would have drawn;
- request.py, scheduler.py and kv_cache.py import no torch.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh.tools.model_init import init_model
from pdmesh_engine import EngineConfig, EngineCore, SamplingParams
from pdmesh_engine.request import Request

CONFIG = EngineConfig(num_blocks=64, block_size=16, device="cpu", num_threads=1)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=77, ignore_eos=True)
PROMPT = [(5 + 11 * i) % 1000 + 4 for i in range(21)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("gen") / "tiny", preset="tiny", seed=0, verbose=False)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> EngineCore:
    return EngineCore(model_dir, CONFIG)


def run(engine: EngineCore, max_steps: int = 200) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_the_request_holds_no_generator_and_the_pure_modules_import_no_torch() -> None:
    names = {f.name for f in dataclasses.fields(Request)}
    assert "generator" not in names and "device" not in names
    code = (
        "import sys, pdmesh_engine.request, pdmesh_engine.scheduler, pdmesh_engine.kv_cache; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_generator_is_made_on_the_first_sample_and_dropped_when_the_request_ends(
    engine: EngineCore,
) -> None:
    runner = engine.runner
    engine.add_request(PROMPT, SEEDED, "seeded")
    engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=1.0), "unseeded")
    engine.add_request(PROMPT, SEEDED, "aborted")
    assert runner.generators == {}
    engine.step()  # the prompts fit one step: every request samples
    assert set(runner.generators) == {"seeded", "aborted"}
    engine.abort("aborted")
    engine.step()
    assert set(runner.generators) == {"seeded"}
    run(engine)
    engine.step()  # the finish is reported with the next schedule
    assert runner.generators == {}


def test_a_first_token_sampled_elsewhere_continues_the_one_engine_stream(model_dir: Path) -> None:
    alone = EngineCore(model_dir, CONFIG)
    alone.add_request(PROMPT, SEEDED, "r")
    expected = run(alone)["r"]
    assert len(expected) == SEEDED.max_tokens

    prefill, decode = EngineCore(model_dir, CONFIG), EngineCore(model_dir, CONFIG)
    prefill.add_request(PROMPT, dataclasses.replace(SEEDED, max_tokens=1), "r", hold_blocks=True)
    first = run(prefill)["r"]
    targets = decode.reserve(PROMPT, SEEDED, "r")
    assert targets is not None
    num_blocks = math.ceil(len(PROMPT) / CONFIG.block_size)
    sources = prefill.blocks_of("r")[:num_blocks]
    decode.runner.kv_caches[:, targets["kv"][:num_blocks]] = prefill.runner.kv_caches[:, sources]
    assert decode.kv_arrived("r", first[0]) is None
    assert first + run(decode)["r"] == expected


@pytest.mark.parametrize("k", [1, 5])
def test_a_migrated_request_continues_the_seeded_stream(engine: EngineCore, k: int) -> None:
    """A request continued elsewhere after k tokens (prompt + those tokens, `prior_output_tokens`
    k, the budget left) draws what the uninterrupted request would have drawn."""
    engine.add_request(PROMPT, SEEDED, request_id=f"whole-{k}")
    whole = run(engine)[f"whole-{k}"]
    rest = dataclasses.replace(SEEDED, max_tokens=SEEDED.max_tokens - k, prior_output_tokens=k)
    engine.add_request(PROMPT + whole[:k], rest, request_id=f"rest-{k}")
    assert run(engine)[f"rest-{k}"] == whole[k:]
    naive = dataclasses.replace(rest, prior_output_tokens=0)  # without it the stream restarts
    engine.add_request(PROMPT + whole[:k], naive, request_id=f"naive-{k}")
    assert run(engine)[f"naive-{k}"] != whole[k:]
