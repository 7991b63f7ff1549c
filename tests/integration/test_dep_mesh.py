"""Wide-EP meshes end to end: DEP instances (`--prefill-dep`, `--decode-dep`) started by `pdmesh
up`'s launcher.

Three meshes, one at a time: prefill DEP2 + decode DEP2 with 2 redundant expert slots, prefill
DEP1 + decode DEP4 (a prefill rank pushes into decode ranks of another DEP size), and the first on
DeepSeek-V4 (its hash and top-k MoE layers over the ranks, each rank's own hybrid KV). Each rank
is its own routable endpoint. Concurrent greedy requests equal the offline engine; `/mesh` lists
every rank with rank and dp_size; afterwards every rank's pool is empty and intact; the gateway
spread the requests over several decode ranks; each rank holds its share of the routed experts'
weights.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from meshlib import V4_WORKER_ARGS, WORKER_ARGS, block_size_of, http_url, wait_idle
from openai import OpenAI

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_service.redis_server import free_port

PROMPTS = [
    "The quick brown fox",
    "def main():\n    return",
    "Return the number of items in a container.",
    "Return the number of items in a container. Raise an error when",
    "x",
    "Once upon a time, in a land far away, there lived a small dragon who "
    * 4,  # several prefill chunks
    "1, 2, 3, 4, 5,",
    "import numpy as np",
]
MAX_TOKENS = 12
# name -> (architecture, prefill ranks, decode ranks, redundant expert slots)
MESHES = {
    "prefill2-decode2": ("v3", 2, 2, 2),
    "prefill1-decode4": ("v3", 1, 4, 0),
    "v4-prefill2-decode2": ("v4", 2, 2, 2),
}


@pytest.fixture(scope="module")
def offline(dep_mesh: Mesh) -> dict:
    """Greedy completions of PROMPTS and the routed experts' weight bytes of the plain engine on
    the mesh's checkpoint."""
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(dep_mesh.options.model_dir, num_blocks=256, block_size=block_size_of(dep_mesh))
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    return {
        "text": {p: o.text for p, o in zip(PROMPTS, outs, strict=True)},
        "expert_bytes": llm.engine.runner.expert_weight_bytes(),
        "num_experts": llm.engine.model_config.n_routed_experts,
    }


@pytest.fixture(scope="module", params=list(MESHES))
def dep_mesh(request, tmp_path_factory: pytest.TempPathFactory):
    arch, prefill_dep, decode_dep, redundant = MESHES[request.param]
    options = MeshOptions(
        model_dir=request.getfixturevalue("tiny_model" if arch == "v3" else "tiny_v4"),
        num_prefill=1,
        num_decode=1,
        mode="disagg",
        http_port=free_port(),
        grpc_port=free_port(),
        deployment=f"test-{request.param}",
        log_dir=tmp_path_factory.mktemp(f"logs-{request.param}"),
        worker_args=WORKER_ARGS if arch == "v3" else V4_WORKER_ARGS,
        prefill_dep=prefill_dep,
        decode_dep=decode_dep,
        num_redundant_experts=redundant,
    )
    mesh = Mesh(options)
    mesh.start(timeout_s=240, progress=lambda line: None)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def served(dep_mesh: Mesh) -> dict:
    """PROMPTS sent at once (several decode ranks busy together), then every rank's status when
    idle."""
    client = OpenAI(
        base_url=f"{http_url(dep_mesh)}/v1", api_key="unused", max_retries=0, timeout=120
    )

    def complete(prompt: str):
        return client.completions.create(
            model=dep_mesh.options.model_dir.name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = dict(zip(PROMPTS, pool.map(complete, PROMPTS), strict=True))
    return {"outs": outs, "status": wait_idle(dep_mesh)}


def test_concurrent_greedy_outputs_equal_offline_engine(served: dict, offline: dict) -> None:
    for prompt, out in served["outs"].items():
        assert out.choices[0].text == offline["text"][prompt], prompt
        assert (
            out.choices[0].finish_reason == "length" and out.usage.completion_tokens == MAX_TOKENS
        )


def test_mesh_view_lists_every_rank(dep_mesh: Mesh) -> None:
    rows = httpx.get(f"{http_url(dep_mesh)}/mesh", timeout=10).json()["instances"]
    for role in ("prefill", "decode"):
        size = dep_mesh.options.dep(role)
        ranks = sorted((row for row in rows if row["role"] == role), key=lambda row: row["rank"])
        expected = [f"{role}-0-r{r}" for r in range(size)] if size > 1 else [f"{role}-0"]
        assert [row["instance_id"] for row in ranks] == expected
        assert [row["rank"] for row in ranks] == list(range(size))
        assert all(row["dp_size"] == size and row["ready"] for row in ranks)
        assert len({row["address"] for row in ranks}) == size  # each rank is its own endpoint


def test_every_rank_ends_idle_with_an_intact_pool(served: dict, dep_mesh: Mesh) -> None:
    for role, group in served["status"].items():
        size = dep_mesh.options.dep(role)
        assert sorted(s.rank for s in group) == list(range(size)) and {
            s.dp_size for s in group
        } == {size}
        for s in group:
            assert s.integrity_checked and s.integrity_error == "", (
                s.instance_id,
                s.integrity_error,
            )
            assert s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0, s


def test_requests_spread_over_decode_ranks(served: dict) -> None:
    decode, prefill = served["status"]["decode"], served["status"]["prefill"]
    assert sum(s.requests_total for s in decode) >= len(PROMPTS)
    assert sum(s.requests_total > 0 for s in decode) >= 2, [
        (s.instance_id, s.requests_total) for s in decode
    ]
    assert sum(s.kv_bytes_received > 0 for s in decode) >= 2  # prefill pushed to several ranks
    assert sum(s.kv_bytes_received for s in decode) == sum(s.kv_bytes_sent for s in prefill) > 0
    assert all(s.transfer_failures == 0 and s.lease_expiries == 0 for s in [*decode, *prefill])


def test_each_rank_holds_its_share_of_the_experts(
    served: dict, dep_mesh: Mesh, offline: dict
) -> None:
    full, experts = offline["expert_bytes"], offline["num_experts"]
    redundant = dep_mesh.options.num_redundant_experts
    for role, group in served["status"].items():
        size = dep_mesh.options.dep(role)
        slots = experts + (redundant if size > 1 else 0)  # physical slots of the instance
        for s in group:
            assert s.expert_weight_bytes == full * slots // (experts * size), (
                s.instance_id,
                s.expert_weight_bytes,
            )


def test_uneven_expert_split_is_refused_before_spawning(
    tiny_model: Path, capsys: pytest.CaptureFixture
) -> None:
    from pdmesh.cli.main import main

    assert main(["serve", "decode", "--dep", "3", "--model", str(tiny_model)]) == 2
    assert "do not split evenly across 3 DEP ranks" in capsys.readouterr().err
