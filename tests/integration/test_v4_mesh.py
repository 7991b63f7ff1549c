"""DeepSeek-V4 through the mesh: real processes, Redis, NIXL and gRPC, a tiny seeded V4 checkpoint.

The hand-off moves V4's two KV groups in one WRITE (every block of compressed entries, and of the
per-token window state only the blocks the decode's next step reads); greedy outputs through the
openai SDK equal the offline engine's for disaggregated prefill, local prefill on the decode rank
and the aggregated mode; the bytes moved are what the V4 spec says, computed here from the
checkpoint's config alone; nothing leaks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
from meshlib import V4_WORKER_ARGS, http_url, start_mesh, wait_idle, worker_args, worker_status
from openai import OpenAI

BLOCK_SIZE = 16  # meshlib.V4_WORKER_ARGS
LOCAL_PREFILL_TOKENS = 12  # shorter prompts prefill on the decode rank
CODE = "def area(shape):\n    if shape.kind == 'circle':\n        return 3.14159 * shape.r ** 2\n"
PROMPTS = [
    "x = 1",  # local prefill
    "The quick brown fox jumps over the lazy dog, again and again",
    CODE * 6,  # hundreds of tokens: many windows, CSA entries past index_topk, several HCA ones
    CODE * 6 + "    return None",  # shares all of the above as a cached prefix on the prefill rank
    "import os\n" * 23,
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def offline(tiny_v4: Path) -> dict[str, tuple[str, int]]:
    """(text, prompt tokens) of every prompt's greedy completion by the offline engine."""
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(tiny_v4, dtype="float32", num_blocks=160, block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    return {p: (o.text, len(o.prompt_token_ids)) for p, o in zip(PROMPTS, outs, strict=True)}


def _expected_handoff_bytes(model: Path, num_tokens: int) -> int:
    """What one hand-off of a `num_tokens` prompt moves, from config.json (fp32 pools): every
    block of compressed entries (CSA: KV + indexer key per 4 tokens; HCA: KV per 16), and the
    window blocks holding the prompt's last `span` + 1 positions (per token: every layer's K=V,
    and each compressed layer's compressor rows)."""
    config = json.loads((model / "config.json").read_text())
    kinds = config["layer_types"]
    csa, hca = (
        kinds.count("compressed_sparse_attention"),
        kinds.count("heavily_compressed_attention"),
    )
    rates = config["compress_rates"]
    r_csa, r_hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
    hd, ihd = config["head_dim"], config["index_head_dim"]
    full_block = BLOCK_SIZE * (csa * (hd + ihd) // r_csa + hca * hd // r_hca)
    window_block = BLOCK_SIZE * (len(kinds) * hd + csa * 4 * (hd + ihd) + hca * 2 * hd)
    span = max(config["sliding_window"] - 1, 2 * r_csa - 1, r_hca - 1) + 1
    full_blocks = math.ceil(num_tokens / BLOCK_SIZE)
    window_blocks = full_blocks - max(0, num_tokens - span) // BLOCK_SIZE
    return 4 * (full_blocks * full_block + window_blocks * window_block)


def _assert_no_leaks(mesh) -> None:
    for role, group in wait_idle(mesh).items():
        for status in group:
            assert status.integrity_checked and status.integrity_error == "", (role, status)
            assert status.kv_blocks_used == 0, (role, status.instance_id, status.kv_blocks_used)


def _complete(mesh, prompt: str):
    client = OpenAI(base_url=f"{http_url(mesh)}/v1", api_key="unused", max_retries=0)
    return client.completions.create(
        model=mesh.options.model_dir.name,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_disaggregated_and_local_prefill_match_the_offline_engine(
    tiny_v4: Path, offline: dict[str, tuple[str, int]], tmp_path: Path
) -> None:
    mesh = start_mesh(
        tiny_v4,
        tmp_path / "logs",
        "test-v4-disagg",
        mode="disagg",
        worker_args=V4_WORKER_ARGS,
        gateway_args=("--local-prefill-tokens", str(LOCAL_PREFILL_TOKENS)),
    )
    try:
        before = {role: worker_status(mesh, role)[0] for role in ("prefill", "decode")}
        paths, moved = {}, 0
        for prompt in PROMPTS:
            out = _complete(mesh, prompt)
            text, num_tokens = offline[prompt]
            assert out.choices[0].text == text, prompt
            assert out.usage.prompt_tokens == num_tokens
            paths[prompt] = out.usage.prompt_tokens_details.prefill_path
            if paths[prompt] == "disagg":
                moved += _expected_handoff_bytes(tiny_v4, num_tokens)
        # short prompts prefill on decode; so may a prompt whose prefix decode's cache holds
        # (PROMPTS[3] once PROMPTS[2]'s blocks are indexed there): the bytes follow the paths
        assert paths[PROMPTS[0]] == "local"
        assert paths[PROMPTS[1]] == paths[PROMPTS[2]] == paths[PROMPTS[4]] == "disagg"
        assert offline[PROMPTS[2]][1] > 8 * BLOCK_SIZE  # its window blocks mostly stay behind
        routing = httpx.get(f"{http_url(mesh)}/mesh", timeout=10).json()["routing"]
        handoffs = [offline[p][1] for p in PROMPTS if paths[p] == "disagg"]
        assert routing["handoffs_measured"] == len(handoffs)
        assert routing["kv_bytes_per_handoff"] == moved // len(handoffs)
        assert routing["kv_bytes_per_prompt_token"] == round(moved / sum(handoffs), 1)
        after = {role: worker_status(mesh, role)[0] for role in ("prefill", "decode")}
        assert after["prefill"].kv_bytes_sent - before["prefill"].kv_bytes_sent == moved
        assert after["decode"].kv_bytes_received - before["decode"].kv_bytes_received == moved
        assert after["prefill"].transfer_failures == before["prefill"].transfer_failures
        _assert_no_leaks(mesh)
    finally:
        mesh.stop()


def test_the_aggregated_mode_matches_the_offline_engine(
    tiny_v4: Path, offline: dict[str, tuple[str, int]], tmp_path: Path
) -> None:
    mesh = start_mesh(
        tiny_v4, tmp_path / "logs", "test-v4-agg", mode="agg", worker_args=V4_WORKER_ARGS
    )
    try:
        for prompt in PROMPTS:
            assert _complete(mesh, prompt).choices[0].text == offline[prompt][0], prompt
        _assert_no_leaks(mesh)
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def tiny_v4_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny V4 in the release format: FP8 dense weights, MXFP4 experts and the `mtp.0.*` layer."""
    from pdmesh.tools.model_init import init_model

    root = tmp_path_factory.mktemp("v4-mtp")
    return init_model(
        root / "tiny-v4-mtp", "tiny", seed=5, arch="deepseek_v4", format="official", verbose=False
    )


def test_mtp_speculation_through_the_mesh_matches_the_offline_engine(
    tiny_v4_mtp: Path, tmp_path: Path
) -> None:
    """Prefill and decode ranks both speculate with the MTP layer: the hand-off carries its window
    KV (group `draft`, on the window table) in the same WRITE, and greedy output equals the
    offline engine without speculation."""
    from pdmesh_engine import LLM, SamplingParams

    block_size = 128  # the release-format preset compresses HCA layers 128 to 1
    llm = LLM(tiny_v4_mtp, dtype="float32", num_blocks=160, block_size=block_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = {p: o.text for p, o in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}
    spec = ("--speculative-method", "mtp", "--num-speculative-tokens", "2")
    mesh = start_mesh(
        tiny_v4_mtp,
        tmp_path / "logs",
        "test-v4-mtp",
        mode="disagg",
        worker_args=(*worker_args(block_size), "--dtype", "float32", *spec),
    )
    try:
        for prompt in PROMPTS[1:]:
            out = _complete(mesh, prompt)
            assert out.choices[0].text == expected[prompt], prompt
            assert out.usage.prompt_tokens_details.prefill_path == "disagg"
        assert _draft_bytes_received(mesh) > 0
        _assert_no_leaks(mesh)
    finally:
        mesh.stop()


def _draft_bytes_received(mesh) -> float:
    """The decode rank's `pdmesh_kv_received_draft_bytes_total` (the proposer's KV it received)."""
    [spec] = [s for s in mesh.specs if s.name == "decode-0"]
    text = httpx.get(f"http://{mesh.options.host}:{spec.metrics_port}/metrics", timeout=10).text
    family = "pdmesh_kv_received_draft_bytes_total{"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(family))
