"""The kvstore's prefix index on a real mesh: after a request, the prefill rank that computed the
prompt is named for the prompt's full blocks (its KV events reached the kvstore)."""

from __future__ import annotations

import time

import grpc
from meshlib import http_url, mesh_metadata
from openai import OpenAI

from pdmesh_engine.block_hash import hash_full_blocks

BLOCK_SIZE = 8  # meshlib.WORKER_ARGS


def _longest_prefix(mesh, hashes: list[bytes]) -> dict[str, int]:
    from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    [address] = [a for s in mesh.specs if s.role == "kvstore" for a in s.addresses]
    with grpc.insecure_channel(address) as channel:
        response = kvstore_pb2_grpc.KVStoreStub(channel).LongestPrefix(
            kvstore_pb2.LongestPrefixRequest(block_hashes=hashes),
            timeout=10,
            metadata=mesh_metadata(mesh),
        )
    return dict(response.matched_blocks)


def test_the_prefill_rank_is_indexed_for_the_prompt_it_computed(disagg_mesh, tiny_model):
    from pdmesh_engine.tokenizer import Tokenizer

    prompt = "An indexed prompt, long enough to fill a few KV blocks of eight tokens each."
    ids = Tokenizer.from_dir(tiny_model).encode(prompt)
    hashes = hash_full_blocks(ids, BLOCK_SIZE)
    assert len(hashes) >= 2
    [prefill] = disagg_mesh.names("prefill")
    assert prefill not in _longest_prefix(disagg_mesh, hashes)
    client = OpenAI(base_url=f"{http_url(disagg_mesh)}/v1", api_key="unused", max_retries=0)
    client.completions.create(
        model=disagg_mesh.options.model_dir.name, prompt=prompt, max_tokens=4, temperature=0
    )
    expected = len(hashes)  # prefill computed the whole prompt: every full block is cached
    deadline = time.monotonic() + 10
    while (found := _longest_prefix(disagg_mesh, hashes).get(prefill)) != expected:
        assert time.monotonic() < deadline, (found, expected)
        time.sleep(0.1)
