"""The gateway's routing on a real mesh (2 prefill + 1 decode, the kvstore's prefix index): a
session's next turn goes to the prefill rank that holds its prefix, a short prompt is prefilled by
its decode rank (conditional disaggregation, reported in the usage and /mesh), and the
X-Data-Parallel-Rank header pins the prompt's rank."""

from __future__ import annotations

import random
import time

import grpc
import httpx
import pytest
from meshlib import V4_WORKER_ARGS, WORKER_ARGS, block_size_of, http_url, mesh_metadata, start_mesh

from pdmesh.launcher import Mesh
from pdmesh_gateway.routing import prompt_block_hashes

LOCAL_TOKENS = 24  # prompts with at most this many tokens uncached on decode are prefilled there


@pytest.fixture(scope="module", params=["v3", "v4"])
def mesh(request, tmp_path_factory):
    """DeepSeek-V3 and DeepSeek-V4 (whose ranks index the same block hashes: its full pool's)."""
    model = request.getfixturevalue("tiny_model" if request.param == "v3" else "tiny_v4")
    mesh = start_mesh(
        model,
        tmp_path_factory.mktemp(f"logs-routing-{request.param}"),
        f"test-routing-{request.param}",
        num_prefill=2,
        num_decode=1,
        gateway_args=("--local-prefill-tokens", str(LOCAL_TOKENS)),
        worker_args=WORKER_ARGS if request.param == "v3" else V4_WORKER_ARGS,
    )
    yield mesh
    mesh.stop()


def _complete(mesh: Mesh, prompt: list[int], headers: dict[str, str] | None = None) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    response = httpx.post(
        f"{http_url(mesh)}/v1/completions", json=body, headers=headers or {}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def _indexed(mesh: Mesh, prompt: list[int]) -> dict[str, int]:
    from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    [address] = [a for s in mesh.specs if s.role == "kvstore" for a in s.addresses]
    with grpc.insecure_channel(address) as channel:
        answer = kvstore_pb2_grpc.KVStoreStub(channel).LongestPrefix(
            kvstore_pb2.LongestPrefixRequest(
                block_hashes=prompt_block_hashes(prompt, block_size_of(mesh))
            ),
            timeout=10,
            metadata=mesh_metadata(mesh),
        )
    return dict(answer.matched_blocks)


def _wait_indexed(mesh: Mesh, prompt: list[int], prefills: list[str]) -> str:
    """The prefill rank the index names for all of `prompt`'s blocks (waits for its events)."""
    want = (len(prompt) - 1) // block_size_of(mesh)
    deadline = time.monotonic() + 15
    while True:
        holders = [r for r, n in _indexed(mesh, prompt).items() if r in prefills and n == want]
        if holders:
            return holders[0]
        assert time.monotonic() < deadline, _indexed(mesh, prompt)
        time.sleep(0.1)


def test_a_session_turn_goes_to_the_prefill_rank_holding_its_prefix(mesh) -> None:
    prefills = mesh.names("prefill")
    assert len(prefills) == 2
    rng = random.Random(1)
    prompt = [rng.randrange(16, 500) for _ in range(160)]
    usage = _complete(mesh, prompt)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0, "prefill_path": "disagg"}
    for _turn in range(3):  # each turn appends more than the local threshold
        holder = _wait_indexed(mesh, prompt, prefills)
        held = (len(prompt) - 1) // block_size_of(mesh) * block_size_of(mesh)
        prompt = prompt + [rng.randrange(16, 500) for _ in range(40)]
        usage = _complete(mesh, prompt)
        details = usage["prompt_tokens_details"]
        # without the index, ties go round robin: the other rank, which holds nothing
        assert details["prefill_path"] == "disagg"
        assert details["cached_tokens"] >= held, (holder, details)
        assert _wait_indexed(mesh, prompt, prefills) == holder


def test_a_short_prompt_is_prefilled_by_its_decode_rank(mesh) -> None:
    before = httpx.get(f"{http_url(mesh)}/mesh", timeout=10).json()["routing"]
    assert before["local_prefill"] == str(LOCAL_TOKENS)
    assert before["local_prefill_threshold_tokens"] == LOCAL_TOKENS
    short = [17, 18, 19, 20, 21, 22, 23, 24, 25, 26]
    assert _complete(mesh, short)["prompt_tokens_details"]["prefill_path"] == "local"
    long = [random.Random(2).randrange(16, 500) for _ in range(LOCAL_TOKENS + 20)]
    assert _complete(mesh, long)["prompt_tokens_details"]["prefill_path"] == "disagg"
    after = httpx.get(f"{http_url(mesh)}/mesh", timeout=10).json()["routing"]
    paths, was = after["prefill_paths"], before["prefill_paths"]
    assert paths["local"] == was["local"] + 1 and paths["disagg"] == was["disagg"] + 1
    assert after["handoffs_measured"] >= before["handoffs_measured"] + 1
    metrics = httpx.get(f"{http_url(mesh)}/metrics", timeout=10).text
    assert 'pdmesh_gateway_prefill_paths_total{path="local"}' in metrics


def test_the_data_parallel_rank_header_pins_the_prompt_rank(mesh) -> None:
    prompt = [30, 31, 32, 33] * 10
    assert _complete(mesh, prompt, {"X-Data-Parallel-Rank": "0"})["completion_tokens"] == 2
    for bad in ("1", "-1", "x"):
        response = httpx.post(
            f"{http_url(mesh)}/v1/completions",
            json={"prompt": prompt, "max_tokens": 2},
            headers={"X-Data-Parallel-Rank": bad},
            timeout=60,
        )
        assert response.status_code == 400, (bad, response.text)
        assert "X-Data-Parallel-Rank" in response.json()["error"]["message"]
