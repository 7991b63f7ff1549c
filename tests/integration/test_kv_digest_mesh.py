"""Fail-closed KV integrity on a real mesh: the prefill rank's fault hook flips one byte of its
first hand-offs' WRITEs in flight (`--fault-corrupt-kv 1 --fault-corrupt-kv-limit N`).

With `--kv-digest all` decode catches every corrupted hand-off before admission: each is counted,
fails (NOT_FOUND, which the gateway retries from the start on a new hand-off), and every greedy
output still equals the offline engine's; once idle no block is held. With `--kv-digest off` the
same corruptions land unnoticed (the hook works; nothing counts them)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from meshlib import WORKER_ARGS, http_url, start_mesh, wait_idle, worker_status

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, again and again",
    "def main():\n    return sum(x * x for x in range(10))",
    "Return the number of items in a container.",
    "Return the number of items in a container. Raise an error when",
    "A long time ago in a galaxy far, far away",
    "x = [1, 2, 3]; print(len(x))",
]
MAX_TOKENS = 10
NUM_CORRUPTED = 2  # the fault hook's limit: the first hand-offs' WRITEs, then clean ones


def _mesh(model: Path, log_dir: Path, name: str, digest: str):
    args = (
        *WORKER_ARGS,
        *("--kv-digest", digest),
        *("--fault-corrupt-kv", "1", "--fault-corrupt-kv-limit", str(NUM_CORRUPTED)),
    )
    return start_mesh(
        model,
        log_dir,
        name,
        worker_args=args,
        gateway_args=("--local-prefill-tokens", "off"),  # every prompt is handed off
    )


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> dict[str, str]:
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(tiny_model, num_blocks=256, block_size=8)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


def _complete(mesh, prompt: str) -> httpx.Response:
    body = {
        "model": mesh.options.model_dir.name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{http_url(mesh)}/v1/completions", json=body, timeout=120)


def _counts(mesh) -> tuple[int, int]:
    """(corruptions the prefill ranks injected, digest mismatches the decode ranks counted)."""
    injected = sum(s.kv_corruptions_injected for s in worker_status(mesh, "prefill"))
    caught = sum(s.kv_digest_mismatches for s in worker_status(mesh, "decode"))
    return injected, caught


def test_corrupted_handoffs_fail_closed_and_outputs_stay_correct(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, offline: dict[str, str]
) -> None:
    mesh = _mesh(tiny_model, tmp_path_factory.mktemp("logs-digest"), "test-digest", "all")
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: _complete(mesh, p), PROMPTS))
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == offline[prompt], prompt
        assert _counts(mesh) == (NUM_CORRUPTED, NUM_CORRUPTED)
        statuses = wait_idle(mesh)
        for status in (s for group in statuses.values() for s in group):
            assert status.kv_blocks_used == 0, status
            assert status.integrity_checked and not status.integrity_error, status
        # once the hook is spent every hand-off is clean: nothing more is rejected
        assert _complete(mesh, PROMPTS[0]).json()["choices"][0]["text"] == offline[PROMPTS[0]]
        assert _counts(mesh) == (NUM_CORRUPTED, NUM_CORRUPTED)
    finally:
        mesh.stop()


def test_without_the_digest_corruption_goes_unnoticed(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    mesh = _mesh(tiny_model, tmp_path_factory.mktemp("logs-nodigest"), "test-nodigest", "off")
    try:
        for prompt in PROMPTS[:3]:
            assert _complete(mesh, prompt).status_code == 200
        assert _counts(mesh) == (NUM_CORRUPTED, 0)
        statuses = wait_idle(mesh)
        assert all(s.kv_blocks_used == 0 for group in statuses.values() for s in group)
    finally:
        mesh.stop()
