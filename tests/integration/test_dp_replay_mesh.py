"""`pdmesh bench serve --dp-replay both` against a real mesh: a DEP2 prefill instance and one decode
rank (`pdmesh up --prefill 1 --prefill-dep 2 --decode 1`), the tiny model, real Redis, gRPC and
NIXL.

Every copy completes; the copies pinned to DP rank r (header `X-Data-Parallel-Rank: r`) were
prefilled by prefill rank r (each rank's Status counts exactly its copies); the result holds the
mirror, lag and second mirror replays and a finite imbalance cost.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from meshlib import http_url, start_mesh, wait_idle, worker_status

from pdmesh.launcher import Mesh
from pdmesh_bench import serve

DP_SIZE = 2
NUM_REQUESTS = 4


@pytest.fixture(scope="module")
def dep2_prefill_mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    mesh = start_mesh(
        tiny_model,
        tmp_path_factory.mktemp("logs-dp-replay"),
        "test-dp-replay",
        num_prefill=1,
        num_decode=1,
        prefill_dep=DP_SIZE,
    )
    yield mesh
    mesh.stop()


def _requests_by_rank(mesh: Mesh) -> dict[int, int]:
    return {s.rank: s.requests_total for s in worker_status(mesh, "prefill")}


def test_dp_replay_both_runs_each_copy_on_its_rank(dep2_prefill_mesh: Mesh) -> None:
    before = _requests_by_rank(dep2_prefill_mesh)
    assert sorted(before) == list(range(DP_SIZE))
    options = serve.ServeOptions(
        url=http_url(dep2_prefill_mesh),
        synthetic=True,
        rate=20.0,
        num_requests=NUM_REQUESTS,
        input_len=24,
        long_input_len=96,
        long_fraction=0.5,
        output_len=2,
        dp_replay="both",
        lag_s=0.2,
        timeout_s=60.0,
        progress_every=0,
    )
    result = serve.run_benchmark(options)
    status = wait_idle(dep2_prefill_mesh)

    dp = result["dp_replay"]
    assert dp["dp_size"] == DP_SIZE  # read from GET /mesh
    assert [r["name"] for r in dp["replays"]] == ["mirror", "lag", "mirror-2"]
    assert result["num_errors"] == 0, [r["error_messages"] for r in dp["replays"]]
    assert result["num_completed"] == 3 * NUM_REQUESTS * DP_SIZE
    for replay in dp["replays"]:
        assert [k["num_completed"] for k in replay["ranks"]] == [NUM_REQUESTS] * DP_SIZE
        assert all(row["ok"] and row["output_tokens"] == 2 for row in replay["requests"])
        assert replay["prefill_tokens_per_s"] > 0
    after = {s.rank: s.requests_total for s in status["prefill"]}
    assert {r: after[r] - before[r] for r in after} == {r: 3 * NUM_REQUESTS for r in after}
    cost = dp["imbalance_cost"]
    assert cost is not None and math.isfinite(cost["throughput"])
    assert all(math.isfinite(cost[f"ttft_{s}_ratio"]) for s in ("p50", "p90", "mean"))


def test_a_replay_on_one_rank_leaves_the_other_idle(dep2_prefill_mesh: Mesh) -> None:
    """`--dp-size 1` pins every copy to rank 0: rank 1 takes none (unpinned, the gateway would
    spread them over both ranks)."""
    before = _requests_by_rank(dep2_prefill_mesh)
    options = serve.ServeOptions(
        url=http_url(dep2_prefill_mesh),
        synthetic=True,
        rate=50.0,
        num_requests=2 * NUM_REQUESTS,
        input_len=24,
        output_len=2,
        dp_replay="mirror",
        dp_size=1,
        seed=1,
        timeout_s=60.0,
        progress_every=0,
    )
    result = serve.run_benchmark(options)
    after = {s.rank: s.requests_total for s in wait_idle(dep2_prefill_mesh)["prefill"]}
    assert result["num_completed"] == 2 * NUM_REQUESTS and result["dp_replay"]["dp_size"] == 1
    assert result["dp_replay"]["imbalance_cost"] is None  # mirror only
    assert (after[0] - before[0], after[1] - before[1]) == (2 * NUM_REQUESTS, 0)
