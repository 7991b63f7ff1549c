"""EPLB end to end: a DEP2 decode instance (2 redundant slots) on a skewed tiny model, a real
controller with a short window, greedy requests streaming through the gateway, real Redis.

- the controller publishes a version, both ranks switch to it (their LoadReports say so) and every
  output equals the offline engine's, before, across and after the switch;
- the controller is killed (SIGKILL) right after it wrote a new version: every rank still converges
  to that version and keeps serving; a restarted controller continues the chain at V+1.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from meshlib import WORKER_ARGS as SMALL_POOLS
from meshlib import http_url, mesh_metadata
from openai import OpenAI

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_service.eplb_protocol import read_loads, read_placement
from pdmesh_service.redis_server import free_port

PROMPTS = [
    "The quick brown fox",
    "def main():\n    return",
    "1, 2, 3, 4, 5,",
    "import numpy as np",
    "Once upon a time, in a land far away,",
    "x",
]
MAX_TOKENS = 24
INSTANCE, MODEL = "decode-0", "target"
WORKER_ARGS = (*SMALL_POOLS, "--eplb-report-s", "0.2")
CONTROLLER_ARGS = ("--eplb-window-steps", "8", "--eplb-step-interval", "16", "--poll-s", "0.2")
WAIT_S = 90.0


@pytest.fixture(scope="module")
def skewed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdmesh.tools.model_init import init_model

    return init_model(
        tmp_path_factory.mktemp("eplb-model") / "skewed",
        preset="tiny",
        seed=5,
        verbose=False,
        expert_skew=1.2,
    )


@pytest.fixture(scope="module")
def offline(skewed_model: Path) -> dict[str, str]:
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(skewed_model, num_blocks=256, block_size=8)
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    return {p: o.text for p, o in zip(PROMPTS, outs, strict=True)}


def start_controller(mesh: Mesh) -> subprocess.Popen:
    """(Re)start the mesh's controller with a short window; the mesh stops it with the rest."""
    spec = next(s for s in mesh.specs if s.role == "eplb")
    log = open(mesh.options.log_dir / f"{spec.name}.log", "ab")
    process = subprocess.Popen(
        [*spec.argv, *CONTROLLER_ARGS],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=mesh.environment(spec),  # the Redis URL and the mesh token
    )
    log.close()
    mesh.processes[spec.name] = process
    return process


def kill_controller(mesh: Mesh, sig: int = signal.SIGKILL) -> None:
    process = mesh.processes["eplb-0"]
    process.send_signal(sig)
    process.wait(10)


@pytest.fixture(scope="module")
def mesh(skewed_model: Path, tmp_path_factory: pytest.TempPathFactory):
    options = MeshOptions(
        model_dir=skewed_model,
        num_prefill=1,
        num_decode=1,
        mode="disagg",
        http_port=free_port(),
        grpc_port=free_port(),
        deployment="test-eplb",
        log_dir=tmp_path_factory.mktemp("logs-eplb"),
        worker_args=WORKER_ARGS,
        decode_dep=2,
        num_redundant_experts=2,
    )
    mesh = Mesh(options)
    mesh.start(timeout_s=240, progress=lambda line: None)
    try:
        # the launcher's controller plans every 3000 steps: too slow here
        kill_controller(mesh, signal.SIGTERM)
        start_controller(mesh)
        yield mesh
    finally:
        mesh.stop()


def redis_call(mesh: Mesh, fn: Callable[..., Any], *args: Any) -> Any:
    async def run() -> Any:
        client = aioredis.Redis.from_url(mesh.redis_url)
        try:
            return await fn(client, mesh.options.deployment, *args)
        finally:
            await client.aclose()

    return asyncio.run(run())


def published_version(mesh: Mesh) -> int:
    placement = redis_call(mesh, read_placement, INSTANCE, MODEL)
    return 0 if placement is None else placement.version


def running_versions(mesh: Mesh) -> dict[int, int]:
    return {r.rank: r.running_version for r in redis_call(mesh, read_loads, INSTANCE, MODEL)}


def ranks_on_one_version(mesh: Mesh, at_least: int) -> bool:
    """Both ranks report running one and the same version, `at_least` or newer (the controller may
    have published the next one within a round of traffic)."""
    versions = running_versions(mesh)
    return (
        len(versions) == 2
        and len(set(versions.values())) == 1
        and min(versions.values()) >= at_least
    )


class Traffic:
    """Greedy completions of PROMPTS, round after round (4 at once), checked against the offline
    engine."""

    def __init__(
        self, mesh: Mesh, offline: dict[str, str], prompts: list[str] | None = None
    ) -> None:
        self.prompts = PROMPTS if prompts is None else prompts
        self.client = OpenAI(
            base_url=f"{http_url(mesh)}/v1", api_key="unused", max_retries=0, timeout=60
        )
        self.model, self.offline, self.mismatches, self.completed = (
            mesh.options.model_dir.name,
            offline,
            [],
            0,
        )
        self.pool = ThreadPoolExecutor(4)

    def round(self) -> None:
        for prompt, text in zip(
            self.prompts, self.pool.map(self._complete, self.prompts), strict=True
        ):
            self.completed += 1
            if text != self.offline[prompt]:
                self.mismatches.append((prompt, text, self.offline[prompt]))

    def until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {WAIT_S:g}s: {what}")
            self.round()

    def _complete(self, prompt: str) -> str:
        out = self.client.completions.create(
            model=self.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text


def test_placement_version_advances_on_every_rank_and_outputs_do_not_change(
    mesh: Mesh, offline: dict[str, str]
) -> None:
    traffic = Traffic(mesh, offline)
    traffic.until(lambda: published_version(mesh) >= 1, "the controller publishes a placement")
    version = published_version(mesh)
    traffic.until(
        lambda: ranks_on_one_version(mesh, version), f"both ranks run version {version} or newer"
    )
    traffic.round()  # served on the new placement
    assert traffic.mismatches == [] and traffic.completed >= 2 * len(PROMPTS)
    assert not mesh.failed()


def test_controller_killed_after_a_write_leaves_every_rank_on_that_version(
    mesh: Mesh, offline: dict[str, str]
) -> None:
    traffic = Traffic(mesh, offline)
    before = published_version(mesh)
    rebalance_until_next(mesh, traffic, before)  # periodic, or forced once the loads are balanced
    kill_controller(mesh)  # right after it wrote V
    version = published_version(mesh)
    traffic.until(
        lambda: running_versions(mesh) == {0: version, 1: version},
        f"both ranks converge to version {version} with the controller dead",
    )
    traffic.round()  # still serving, outputs unchanged
    start_controller(mesh)
    # a load unlike the one V was planned on, so that a plan that moves slots exists (a forced
    # Rebalance still publishes nothing when no move improves the placement)
    shifted = Traffic(mesh, offline, prompts=[PROMPTS[2]] * 4)
    rebalance_until_next(mesh, shifted, version)
    # the chain goes on at V+1
    assert redis_call(mesh, read_placement, INSTANCE, MODEL, version + 1) is not None
    traffic.until(
        lambda: ranks_on_one_version(mesh, version + 1), f"both ranks on {version + 1} or newer"
    )
    assert traffic.mismatches == [] and shifted.mismatches == []
    assert not mesh.failed()


def rebalance_until_next(mesh: Mesh, traffic: Traffic, version: int) -> None:
    """Traffic until the controller publishes version + 1 (periodically, or on a forced manual
    Rebalance: the loads may already be balanced, and the minimum gain then holds new versions
    back)."""
    from pdmesh_proto.eplb.v1 import eplb_pb2, eplb_pb2_grpc

    spec = next(s for s in mesh.specs if s.role == "eplb")

    def next_published() -> bool:
        if published_version(mesh) > version:
            return True
        try:
            with grpc.insecure_channel(spec.grpc_address) as channel:
                request = eplb_pb2.RebalanceRequest(instance=INSTANCE, model=MODEL, force=True)
                eplb_pb2_grpc.EplbStub(channel).Rebalance(
                    request, timeout=5, metadata=mesh_metadata(mesh)
                )
        except grpc.RpcError:
            pass  # not serving yet
        return published_version(mesh) > version

    traffic.until(next_published, f"the restarted controller publishes version {version + 1}")
