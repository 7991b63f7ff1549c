"""Cache isolation by `cache_salt` on a real mesh: requests share cached KV blocks exactly when
their salts are equal, in the engines' prefix caches, in the kvstore's prefix index and in the
gateway's cache-aware routing (it looks the prompt up under the request's salt).

Requests go through the gateway's gRPC API, whose SamplingParams carry the salt as they are."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import grpc
import pytest
from meshlib import block_size_of, grpc_address, http_url, mesh_metadata, start_mesh

from pdmesh.launcher import Mesh
from pdmesh_gateway.routing import prompt_block_hashes

PROMPT_TOKENS = 81  # with blocks of 8: 10 full blocks, all of them cacheable (the last token is
# always computed)
WAIT_S = 30.0


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(16, 500) for _ in range(PROMPT_TOKENS)]


def _generate(mesh: Mesh, prompt: list[int], salt: str | None) -> tuple[list[int], int]:
    """(output token ids, cached prompt tokens) of a greedy gRPC Generate with `salt`."""
    from pdmesh_proto.common.v1 import common_pb2
    from pdmesh_proto.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    if salt is not None:
        sampling.cache_salt = salt
    with grpc.insecure_channel(grpc_address(mesh)) as channel:
        response = gateway_pb2_grpc.GenerateStub(channel).Generate(
            gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling
            ),
            timeout=60,
        )
    assert response.usage.prompt_tokens == len(prompt)
    return list(response.token_ids), response.usage.cached_tokens


def _indexed(mesh: Mesh, prompt: list[int], salt: str | None) -> dict[str, int]:
    """The kvstore's LongestPrefix for the prompt's blocks under `salt`: rank -> blocks held."""
    from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    hashes = prompt_block_hashes(prompt, block_size_of(mesh), salt)
    [address] = [a for s in mesh.specs if s.role == "kvstore" for a in s.addresses]
    with grpc.insecure_channel(address) as channel:
        answer = kvstore_pb2_grpc.KVStoreStub(channel).LongestPrefix(
            kvstore_pb2.LongestPrefixRequest(block_hashes=hashes),
            timeout=10,
            metadata=mesh_metadata(mesh),
        )
    return dict(answer.matched_blocks)


def _wait_indexed(
    mesh: Mesh, prompt: list[int], salt: str | None, done: Callable[[dict[str, int]], bool]
) -> dict[str, int]:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = _indexed(mesh, prompt, salt)
        if done(found):
            return found
        assert time.monotonic() < deadline, f"index for salt {salt!r}: {found}"
        time.sleep(0.1)


def _full_blocks(mesh: Mesh) -> int:
    return (PROMPT_TOKENS - 1) // block_size_of(mesh)


def test_salts_isolate_the_prefix_caches_and_the_index(disagg_mesh) -> None:
    """One prefill rank: every request of the same prompt is computed by the same engine, which
    serves it from its cache only under the salt that cached it."""
    mesh, prompt, blocks = disagg_mesh, _prompt(1), _full_blocks(disagg_mesh)
    [prefill], [decode] = mesh.names("prefill"), mesh.names("decode")
    out_a, cached = _generate(mesh, prompt, "tenant-a")
    assert cached == 0
    # the prefill rank computed it and the decode rank received it: both hold it, under salt A only
    both = {prefill: blocks, decode: blocks}
    assert _wait_indexed(mesh, prompt, "tenant-a", lambda found: found == both) == both
    assert _indexed(mesh, prompt, "tenant-b") == {}
    assert _indexed(mesh, prompt, None) == {}

    # the same salt shares the blocks
    out, cached = _generate(mesh, prompt, "tenant-a")
    assert (out, cached) == (out_a, blocks * block_size_of(mesh))
    # another salt, or none, does not (the engine holds salt A's blocks all along)
    out, cached = _generate(mesh, prompt, "tenant-b")
    assert (out, cached) == (out_a, 0)
    out, cached = _generate(mesh, prompt, None)
    assert (out, cached) == (out_a, 0)
    # and each salt's own blocks are shared within it, side by side with A's
    _wait_indexed(mesh, prompt, "tenant-b", lambda found: found == both)
    out, cached = _generate(mesh, prompt, "tenant-b")
    assert (out, cached) == (out_a, blocks * block_size_of(mesh))
    assert _indexed(mesh, prompt, "tenant-a") == both
    assert _indexed(mesh, prompt, "tenant-c") == {}


def test_the_rest_usage_reports_cached_tokens_per_salt(disagg_mesh) -> None:
    from openai import OpenAI

    mesh, prompt = disagg_mesh, _prompt(2)
    client = OpenAI(base_url=f"{http_url(mesh)}/v1", api_key="unused", max_retries=0)

    def cached(salt: str) -> int:
        out = client.completions.create(
            model=mesh.options.model_dir.name,
            prompt=prompt,
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt},
        )
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("rest-a") == 0
    assert cached("rest-a") == _full_blocks(mesh) * block_size_of(mesh)
    assert cached("rest-b") == 0


@pytest.fixture(scope="module")
def two_prefill_mesh(tiny_model, tmp_path_factory):
    mesh = start_mesh(
        tiny_model,
        tmp_path_factory.mktemp("logs-cache-salt"),
        "test-cache-salt",
        num_prefill=2,
        num_decode=1,
    )
    yield mesh
    mesh.stop()


def test_the_gateway_routes_a_salted_prompt_to_the_rank_holding_it(two_prefill_mesh) -> None:
    """Two prefill ranks: the gateway finds the rank holding a salted prompt by its salted hashes
    (with no rank found, ties go round robin, to the other rank, which holds nothing)."""
    mesh, prompt, blocks = two_prefill_mesh, _prompt(3), _full_blocks(two_prefill_mesh)
    prefills = set(mesh.names("prefill"))
    out_a, cached = _generate(mesh, prompt, "tenant-a")
    assert cached == 0

    def one_prefill(found: dict[str, int]) -> bool:
        return [r for r, n in found.items() if r in prefills and n == blocks] != []

    found = _wait_indexed(mesh, prompt, "tenant-a", one_prefill)
    [holder] = [r for r, n in found.items() if r in prefills]
    assert _indexed(mesh, prompt, None) == {} and _indexed(mesh, prompt, "tenant-b") == {}
    for _ in range(2):
        out, cached = _generate(mesh, prompt, "tenant-a")
        assert (out, cached) == (out_a, blocks * block_size_of(mesh))
    out, cached = _generate(mesh, prompt, "tenant-b")
    assert (out, cached) == (out_a, 0)
    # salt A's blocks stayed where they were (every A request went to `holder`)
    assert [r for r in _indexed(mesh, prompt, "tenant-a") if r in prefills] == [holder]
