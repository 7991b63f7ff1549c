"""The kvstore's prefix index on a real mesh:
- after a request, the prefill rank that computed the prompt is named for the prompt's full blocks
  (its KV events reached the kvstore);
- a kvstore killed and started again learns it all back with no new request (every rank's next
  batch is refused, and the rank answers with a snapshot of its pool);
- a rank killed for good leaves the index within its registry TTL plus one kvstore sweep, and the
  ranks still alive stay in it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from meshlib import heartbeat_s, http_url, kill, mesh_metadata, respawn, start_mesh
from openai import OpenAI

from pdmesh.launcher import Mesh
from pdmesh_engine.block_hash import hash_full_blocks
from pdmesh_service.registry import TTL_BEATS

BLOCK_SIZE = 8  # meshlib.WORKER_ARGS
WAIT_S = 30.0  # the longest any state below is waited for
# What may come on top of a computed bound: timers and heartbeats run late on a loaded machine
# (the registry allows three late beats), plus the registry read and the query.
LATE_S = 3.0


def _longest_prefix(mesh: Mesh, hashes: list[bytes]) -> dict[str, int]:
    from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    [address] = [a for s in mesh.specs if s.role == "kvstore" for a in s.addresses]
    with grpc.insecure_channel(address) as channel:
        response = kvstore_pb2_grpc.KVStoreStub(channel).LongestPrefix(
            kvstore_pb2.LongestPrefixRequest(block_hashes=hashes),
            timeout=10,
            metadata=mesh_metadata(mesh),
        )
    return dict(response.matched_blocks)


def _wait_index(
    mesh: Mesh, hashes: list[bytes], done: Callable[[dict[str, int]], bool], timeout_s: float
) -> dict[str, int]:
    """LongestPrefix(hashes) once `done` accepts it (the kvstore may be down meanwhile); fails
    with the last answer after `timeout_s`."""
    deadline, found = time.monotonic() + timeout_s, None
    while True:
        try:
            found = _longest_prefix(mesh, hashes)
        except grpc.RpcError as e:  # restarting
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        else:
            if done(found):
                return found
        assert time.monotonic() < deadline, f"index after {timeout_s} s: {found}"
        time.sleep(0.1)


def _prompt_hashes(tiny_model: Path, prompt: str) -> list[bytes]:
    from pdmesh_engine.tokenizer import Tokenizer

    hashes = hash_full_blocks(Tokenizer.from_dir(tiny_model).encode(prompt), BLOCK_SIZE)
    assert len(hashes) >= 2
    return hashes


def _complete(mesh: Mesh, prompt: str) -> None:
    client = OpenAI(base_url=f"{http_url(mesh)}/v1", api_key="unused", max_retries=0)
    client.completions.create(
        model=mesh.options.model_dir.name, prompt=prompt, max_tokens=4, temperature=0
    )


def _holding_all(mesh: Mesh, found: dict[str, int], hashes: list[bytes], role: str) -> set[str]:
    """The ranks of `role` named for every one of `hashes`."""
    return {name for name in mesh.names(role) if found.get(name) == len(hashes)}


def test_the_prefill_rank_is_indexed_for_the_prompt_it_computed(disagg_mesh, tiny_model):
    prompt = "An indexed prompt, long enough to fill a few KV blocks of eight tokens each."
    hashes = _prompt_hashes(tiny_model, prompt)
    [prefill] = disagg_mesh.names("prefill")
    assert prefill not in _longest_prefix(disagg_mesh, hashes)
    _complete(disagg_mesh, prompt)
    # prefill computed the whole prompt: every full block is cached
    _wait_index(disagg_mesh, hashes, lambda found: found.get(prefill) == len(hashes), 10)


@pytest.fixture(scope="module")
def two_prefill_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """Two prefill ranks and a decode rank, unsupervised: the tests below kill and restart its
    services themselves."""
    mesh = start_mesh(
        tiny_model,
        tmp_path_factory.mktemp("logs-prefix-index"),
        "test-prefix-index",
        num_prefill=2,
        num_decode=1,
    )
    yield mesh
    mesh.stop()


def _serve_settled(mesh: Mesh, prompt: str, hashes: list[bytes]) -> dict[str, int]:
    """Complete `prompt` and wait until the index names a prefill rank (it computed the prompt)
    and every decode rank (it received it) for all of `hashes`."""
    _complete(mesh, prompt)
    decodes = set(mesh.names("decode"))

    def settled(found: dict[str, int]) -> bool:
        prefills = _holding_all(mesh, found, hashes, "prefill")
        return bool(prefills) and _holding_all(mesh, found, hashes, "decode") == decodes

    return _wait_index(mesh, hashes, settled, WAIT_S)


def test_a_restarted_kvstore_gets_the_index_back_from_snapshots(two_prefill_mesh, tiny_model):
    mesh, prompt = two_prefill_mesh, "Indexed before the kvstore restarts: a few blocks of eight."
    hashes = _prompt_hashes(tiny_model, prompt)
    before = _serve_settled(mesh, prompt, hashes)
    [kvstore] = mesh.names("kvstore")
    old_pid = kill(mesh, kvstore)
    assert respawn(mesh, kvstore) != old_pid
    # no request from here on: only the ranks' keepalives make the new kvstore ask for snapshots
    _wait_index(mesh, hashes, lambda found: found == before, WAIT_S)


def test_a_dead_rank_leaves_the_index_and_the_others_stay(two_prefill_mesh, tiny_model):
    mesh, prefills = two_prefill_mesh, set(two_prefill_mesh.names("prefill"))
    # prompts with nothing in common (their first tokens differ), one at a time, until each prefill
    # rank computed one (idle prefill ranks take requests in turn)
    prompts: dict[str, list[bytes]] = {}
    for word in ("Apples", "Bridges", "Candles", "Dolphins"):
        prompt = f"{word} open this prompt, which fills a few KV blocks of eight tokens."
        prompts[prompt] = _prompt_hashes(tiny_model, prompt)
        _serve_settled(mesh, prompt, prompts[prompt])
        before = {p: _longest_prefix(mesh, hashes) for p, hashes in prompts.items()}
        computed = {
            rank for p, h in prompts.items() for rank in _holding_all(mesh, before[p], h, "prefill")
        }
        if computed == prefills:
            break
    assert computed == prefills, before
    dead = sorted(prefills)[-1]
    dead_prompt = next(p for p in prompts if dead in before[p])
    [kvstore] = mesh.names("kvstore")
    # the dead rank's registry entry lapses TTL_BEATS of its beats after its last one (before the
    # kill); the kvstore's next sweep, at most one of its own beats later, drops it from the index
    bound_s = TTL_BEATS * heartbeat_s(mesh, dead) + heartbeat_s(mesh, kvstore) + LATE_S
    kill(mesh, dead)
    _wait_index(mesh, prompts[dead_prompt], lambda found: dead not in found, bound_s)
    after = {p: _longest_prefix(mesh, hashes) for p, hashes in prompts.items()}
    assert after == {
        p: {rank: n for rank, n in found.items() if rank != dead} for p, found in before.items()
    }
