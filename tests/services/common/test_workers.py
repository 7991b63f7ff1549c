"""Decode and prefill ranks over real gRPC on loopback, real Redis, real NIXL and a tiny random
model.

kvstore, decode and prefill run in this process on one event loop in a background thread (each
worker has its own engine thread and NIXL agent); one test also runs a prefill rank as a separate
process. Tests talk to them with synchronous gRPC stubs. Greedy tokens must equal `LLM.generate`
run offline with the same engine settings, and every test leaves the KV pools empty and intact.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import pytest

from pdmesh.tools.model_init import init_model
from pdmesh_engine import LLM, EngineConfig, SamplingParams
from pdmesh_engine.config import ModelConfig
from pdmesh_proto.common.v1 import common_pb2
from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
from pdmesh_proto.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from pdmesh_service.redis_server import EmbeddedRedis, free_port

pytest.importorskip("nixl")

BLOCK_SIZE, NUM_BLOCKS, TOKEN_BUDGET = 8, 96, 32  # small pool (leaks show), chunked prefill
WORKER_ARGS = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--block-size",
    str(BLOCK_SIZE),
    "--num-blocks",
    str(NUM_BLOCKS),
    "--max-num-batched-tokens",
    str(TOKEN_BUDGET),
    "--max-num-seqs",
    "8",
]
MAX_MODEL_LEN = NUM_BLOCKS * BLOCK_SIZE
GREEDY = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)
PROMPTS = [[(i * 37 + 11 * n) % 1000 + 2 for i in range(n)] for n in (5, 8, 29, 70)]
REPO = Path(__file__).resolve().parents[2]
RPC_TIMEOUT_S = 60.0


class ServiceHost:
    """Runs services' `serve(config, ready)` on an event loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="services", daemon=True)
        self.thread.start()
        self.tasks: list[asyncio.Task] = []

    def start(self, module, argv: list[str], timeout_s: float = 120.0) -> None:
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        config = module.config_from_args(parser.parse_args(argv))

        async def launch() -> asyncio.Task:
            ready = asyncio.Event()
            task = asyncio.ensure_future(module.serve(config, ready))
            waiter = asyncio.ensure_future(ready.wait())
            done, _ = await asyncio.wait(
                {task, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if task in done:
                waiter.cancel()
                task.result()
                raise RuntimeError(f"{module.__name__} stopped while starting")
            if waiter not in done:
                raise TimeoutError(f"{module.__name__} not ready within {timeout_s}s")
            return task

        self.tasks.append(
            asyncio.run_coroutine_threadsafe(launch(), self.loop).result(timeout_s + 10)
        )

    def stop(self) -> None:
        async def shutdown() -> None:
            for task in reversed(self.tasks):
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(60)
        except TimeoutError:  # show where the shutdown hangs: every thread's stack, every task's
            faulthandler.dump_traceback(all_threads=True)
            for task in asyncio.all_tasks(self.loop):
                task.print_stack(file=sys.stderr)
            raise
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@dataclass
class Mesh:
    model: Path
    redis: EmbeddedRedis
    deployment: str
    kvstore: str
    decode_id: str
    prefill_id: str
    decode: decode_pb2_grpc.DecodeStub
    prefill: prefill_pb2_grpc.PrefillStub
    handoffs: kvstore_pb2_grpc.KVStoreStub

    def handoff_state(self, request_id: str) -> str:
        """The kvstore's record of a hand-off: its state, or GONE (a live record lapses with its
        lease)."""
        try:
            reply = self.handoffs.GetHandoff(
                kvstore_pb2.GetHandoffRequest(request_id=request_id), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return "GONE"
            raise
        return kvstore_pb2.HandoffState.Name(reply.state).removeprefix("HANDOFF_STATE_")

    def wait_handoff(self, request_id: str, *states: str) -> None:
        wait_for(
            lambda: self.handoff_state(request_id) in states, what=f"hand-off {request_id} {states}"
        )

    def common_args(self, instance_id: str, port: int) -> list[str]:
        return [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--redis-url",
            self.redis.url,
            "--deployment",
            self.deployment,
            "--instance-id",
            instance_id,
            "--heartbeat-s",
            "0.5",
            "--log-level",
            "WARNING",
        ]

    def worker_args(self, instance_id: str, port: int) -> list[str]:
        return [
            *self.common_args(instance_id, port),
            "--model",
            str(self.model),
            "--kvstore",
            self.kvstore,
            *WORKER_ARGS,
        ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(
        tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0, verbose=False
    )


@pytest.fixture(scope="module")
def mesh(model_dir: Path) -> Iterator[Mesh]:
    from pdmesh_decode import server as decode_server
    from pdmesh_kvstore import server as kvstore_server
    from pdmesh_prefill import server as prefill_server

    redis = EmbeddedRedis().start()
    host = ServiceHost()
    channels: list[grpc.Channel] = []
    try:
        ports = [free_port() for _ in range(3)]
        mesh = Mesh(
            model_dir,
            redis,
            "test-workers",
            f"127.0.0.1:{ports[0]}",
            "decode-t",
            "prefill-t",
            None,
            None,
            None,
        )
        host.start(kvstore_server, mesh.common_args("kvstore-t", ports[0]))
        host.start(decode_server, mesh.worker_args(mesh.decode_id, ports[1]))
        host.start(prefill_server, mesh.worker_args(mesh.prefill_id, ports[2]))
        channels = [grpc.insecure_channel(f"127.0.0.1:{p}") for p in ports]
        mesh.handoffs = kvstore_pb2_grpc.KVStoreStub(channels[0])
        mesh.decode, mesh.prefill = (
            decode_pb2_grpc.DecodeStub(channels[1]),
            prefill_pb2_grpc.PrefillStub(channels[2]),
        )
        yield mesh
    finally:
        for ch in channels:
            ch.close()
        host.stop()
        redis.stop()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of every prompt, from the offline engine with the workers' settings."""
    llm = LLM(
        model_dir,
        EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=NUM_BLOCKS,
            device="cpu",
            dtype="float32",
            max_num_batched_tokens=TOKEN_BUDGET,
            max_num_seqs=8,
        ),
    )
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0))
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, outputs, strict=True)}


# ----- helpers -----
def md(request_id: str) -> tuple[tuple[str, str], ...]:
    return (("x-request-id", request_id),)


def status(stub, check: bool = True) -> common_pb2.WorkerStatus:
    return stub.Status(common_pb2.StatusRequest(check_integrity=check), timeout=RPC_TIMEOUT_S)


def wait_for(
    condition: Callable[[], bool], timeout_s: float = 15.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_clean(stub) -> None:
    """No request and no block left, and the pool's bookkeeping intact (waits for async
    releases)."""

    def clean() -> bool:
        s = status(stub)
        assert s.integrity_checked and s.integrity_error == "", s.integrity_error
        return s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0

    wait_for(clean, what="an empty KV pool")


def reserve(
    mesh: Mesh, request_id: str, prompt: list[int], sampling=GREEDY, lease_ms: int = 0
) -> common_pb2.KVTarget:
    return mesh.decode.Reserve(
        decode_pb2.ReserveRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, lease_ms=lease_ms
        ),
        timeout=RPC_TIMEOUT_S,
        metadata=md(request_id),
    ).target


def disagg(
    mesh: Mesh, request_id: str, prompt: list[int], prefill=None, sampling=GREEDY
) -> tuple[list[int], prefill_pb2.PrefillResponse, list[decode_pb2.TokenChunk]]:
    """Reserve → Prefill → Decode by hand; the first token followed by the streamed ones."""
    target = reserve(mesh, request_id, prompt, sampling)
    response = (prefill or mesh.prefill).Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling, target=target
        ),
        timeout=RPC_TIMEOUT_S,
        metadata=md(request_id),
    )
    chunks = list(
        mesh.decode.Decode(
            decode_pb2.DecodeRequest(
                request_id=request_id,
                first_token=response.first_token,
                num_cached_tokens=response.num_cached_tokens,
            ),
            timeout=RPC_TIMEOUT_S,
            metadata=md(request_id),
        )
    )
    assert chunks and chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    return (
        [response.first_token.token_id] + [t for c in chunks for t in c.token_ids],
        response,
        chunks,
    )


def prompt_kv_bytes(model: Path, num_tokens: int) -> int:
    """Blocks of the prompt × layers × bytes of one block in one layer (float32 latent + rope
    key)."""
    config = ModelConfig.from_dir(model)
    return (
        math.ceil(num_tokens / BLOCK_SIZE)
        * config.num_hidden_layers
        * BLOCK_SIZE
        * config.kv_cache_dim
        * 4
    )


def metric(name: str, instance: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"instance": instance}) or 0.0


def expect_code(code: grpc.StatusCode, call: Callable[[], object]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__"):
            list(result)
    assert info.value.code() == code, info.value.details()
    return info.value.details()


# ----- tests -----
def test_disagg_matches_offline_and_counts_kv_bytes(mesh: Mesh, offline) -> None:
    before_p, before_d = status(mesh.prefill), status(mesh.decode)
    metric_before = metric("pdmesh_kv_transfer_bytes_total", mesh.prefill_id)
    expected_bytes = 0
    for i, prompt in enumerate(PROMPTS):
        tokens, response, chunks = disagg(mesh, f"disagg-{i}", prompt)
        assert tokens == offline[tuple(prompt)], f"prompt {i}"
        assert response.kv_bytes == prompt_kv_bytes(mesh.model, len(prompt))
        assert chunks[-1].num_prompt_tokens == len(prompt)
        expected_bytes += response.kv_bytes
    after_p, after_d = status(mesh.prefill), status(mesh.decode)
    assert after_p.kv_bytes_sent - before_p.kv_bytes_sent == expected_bytes
    assert after_d.kv_bytes_received - before_d.kv_bytes_received == expected_bytes
    assert (
        metric("pdmesh_kv_transfer_bytes_total", mesh.prefill_id) - metric_before == expected_bytes
    )
    assert metric("pdmesh_kv_received_bytes_total", mesh.decode_id) >= expected_bytes
    for i in range(len(PROMPTS)):
        mesh.wait_handoff(f"disagg-{i}", "CONSUMED")
    assert after_p.transfer_failures == before_p.transfer_failures
    assert_clean(mesh.prefill)
    assert_clean(mesh.decode)


def test_prefix_cached_prompt_still_matches(mesh: Mesh, offline) -> None:
    prompt = PROMPTS[-1]
    disagg(mesh, "cache-warm", prompt)
    tokens, response, chunks = disagg(mesh, "cache-hit", prompt)
    assert tokens == offline[tuple(prompt)]
    assert response.num_cached_tokens >= BLOCK_SIZE
    assert chunks[-1].num_cached_tokens == response.num_cached_tokens
    assert_clean(mesh.prefill)


def test_concurrent_requests_match_offline(mesh: Mesh, offline) -> None:
    """Prompts prefilled and decoded together: batched steps, several WRITEs and notifications at
    once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(
            pool.map(lambda ip: disagg(mesh, f"together-{ip[0]}", ip[1])[0], enumerate(PROMPTS))
        )
    assert results == [offline[tuple(p)] for p in PROMPTS]
    assert_clean(mesh.prefill)
    assert_clean(mesh.decode)


def test_decode_called_before_the_kv_arrives(mesh: Mesh, offline) -> None:
    """Without a first token decode samples it itself; the call may wait for the NIXL
    notification."""
    prompt = PROMPTS[2]
    target = reserve(mesh, "early", prompt)
    call = mesh.decode.Decode(decode_pb2.DecodeRequest(request_id="early"), timeout=RPC_TIMEOUT_S)
    time.sleep(0.2)  # let the call reach the server first
    mesh.prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="early", prompt_token_ids=prompt, sampling=GREEDY, target=target
        ),
        timeout=RPC_TIMEOUT_S,
    )
    assert [t for c in call for t in c.token_ids] == offline[tuple(prompt)]
    assert_clean(mesh.decode)


def test_first_token_can_finish_the_request(mesh: Mesh, model_dir: Path) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
    tokens, response, chunks = disagg(mesh, "one-token", PROMPTS[1], sampling=sampling)
    assert len(tokens) == 1 and len(chunks) == 1 and not chunks[0].token_ids
    assert chunks[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    llm_first = LLM(
        model_dir, EngineConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, device="cpu")
    ).generate(PROMPTS[1], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))[0]
    first = response.first_token
    assert first.token_id == llm_first.token_ids[0]
    assert first.logprob == pytest.approx(llm_first.logprobs[0], abs=1e-4)
    assert [t.token_id for t in first.top] == [t for t, _ in llm_first.top_logprobs[0]]
    assert_clean(mesh.decode)


def test_target_layout_is_the_decode_pool(mesh: Mesh) -> None:
    target = reserve(mesh, "layout", PROMPTS[2])
    config = ModelConfig.from_dir(mesh.model)
    assert target.agent_name == mesh.decode_id and target.instance_id == mesh.decode_id
    assert len(target.groups[0].block_ids) == math.ceil(len(PROMPTS[2]) / BLOCK_SIZE)
    layout = target.groups[0].pools[0]
    assert (layout.num_layers, layout.num_blocks, layout.block_size) == (
        config.num_hidden_layers,
        NUM_BLOCKS,
        BLOCK_SIZE,
    )
    assert layout.block_bytes == BLOCK_SIZE * config.kv_cache_dim * 4
    assert mesh.decode.Cancel(
        decode_pb2.CancelRequest(request_id="layout"), timeout=RPC_TIMEOUT_S
    ).found
    assert not mesh.decode.Cancel(
        decode_pb2.CancelRequest(request_id="layout"), timeout=RPC_TIMEOUT_S
    ).found
    assert_clean(mesh.decode)
    mesh.wait_handoff("layout", "CANCELLED")


def test_generate_matches_offline(mesh: Mesh, offline) -> None:
    for i, prompt in enumerate(PROMPTS):
        chunks = list(
            mesh.decode.Generate(
                decode_pb2.GenerateRequest(
                    request_id=f"gen-{i}", prompt_token_ids=prompt, sampling=GREEDY
                ),
                timeout=RPC_TIMEOUT_S,
            )
        )
        assert [t for c in chunks for t in c.token_ids] == offline[tuple(prompt)]
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert_clean(mesh.decode)


def test_lease_expiry_returns_the_blocks(mesh: Mesh) -> None:
    before = status(mesh.decode).lease_expiries
    reserve(mesh, "lease", PROMPTS[3], lease_ms=200)
    assert status(mesh.decode).kv_blocks_used == math.ceil(len(PROMPTS[3]) / BLOCK_SIZE)
    wait_for(lambda: status(mesh.decode).lease_expiries == before + 1, what="the lease to expire")
    # The blocks go back once the kvstore confirms no write can start (compare-and-set to EXPIRED).
    wait_for(lambda: status(mesh.decode).kv_blocks_used == 0, what="the blocks to come back")
    after = status(mesh.decode)
    assert after.kv_blocks_used == 0 and after.integrity_error == ""
    mesh.wait_handoff("lease", "EXPIRED", "GONE")
    assert metric("pdmesh_lease_expiries_total", mesh.decode_id) >= 1
    expect_code(
        grpc.StatusCode.NOT_FOUND,
        lambda: mesh.decode.Decode(
            decode_pb2.DecodeRequest(
                request_id="lease", first_token=common_pb2.TokenLogprob(token_id=5)
            ),
            timeout=RPC_TIMEOUT_S,
        ),
    )


def test_cancelled_decode_stream_frees_the_blocks(mesh: Mesh) -> None:
    long = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    target = reserve(mesh, "cancel-decode", PROMPTS[2], long)
    response = mesh.prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="cancel-decode", prompt_token_ids=PROMPTS[2], sampling=long, target=target
        ),
        timeout=RPC_TIMEOUT_S,
    )
    call = mesh.decode.Decode(
        decode_pb2.DecodeRequest(request_id="cancel-decode", first_token=response.first_token),
        timeout=RPC_TIMEOUT_S,
    )
    for _ in range(2):
        assert next(call).finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    call.cancel()
    assert_clean(mesh.decode)
    generate = mesh.decode.Generate(
        decode_pb2.GenerateRequest(
            request_id="cancel-generate", prompt_token_ids=PROMPTS[1], sampling=long
        ),
        timeout=RPC_TIMEOUT_S,
    )
    next(generate)
    generate.cancel()
    assert_clean(mesh.decode)


def test_cancel_rpc_ends_a_stream_with_abort(mesh: Mesh) -> None:
    long = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    call = mesh.decode.Generate(
        decode_pb2.GenerateRequest(
            request_id="cancel-rpc", prompt_token_ids=PROMPTS[0], sampling=long
        ),
        timeout=RPC_TIMEOUT_S,
    )
    next(call)
    assert mesh.decode.Cancel(
        decode_pb2.CancelRequest(request_id="cancel-rpc"), timeout=RPC_TIMEOUT_S
    ).found
    assert list(call)[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert_clean(mesh.decode)


def test_abort_during_prefill_frees_the_blocks(mesh: Mesh) -> None:
    prompt = [(i * 13) % 1000 + 2 for i in range(MAX_MODEL_LEN - 8)]  # ~24 chunked steps
    sent = status(mesh.prefill).kv_bytes_sent
    target = reserve(mesh, "cancel-prefill", prompt)
    future = mesh.prefill.Prefill.future(
        prefill_pb2.PrefillRequest(
            request_id="cancel-prefill", prompt_token_ids=prompt, sampling=GREEDY, target=target
        ),
        timeout=RPC_TIMEOUT_S,
    )
    wait_for(
        lambda: status(mesh.prefill, check=False).kv_blocks_used > 0, what="the prefill to start"
    )
    future.cancel()
    assert_clean(mesh.prefill)
    assert status(mesh.prefill).kv_bytes_sent == sent, (
        "the prefill finished before it was cancelled"
    )
    mesh.wait_handoff("cancel-prefill", "CANCELLED")
    assert mesh.decode.Cancel(
        decode_pb2.CancelRequest(request_id="cancel-prefill"), timeout=RPC_TIMEOUT_S
    ).found
    assert_clean(mesh.decode)


def test_bad_input_is_invalid_argument(mesh: Mesh) -> None:
    bad_prompts = {
        "empty": [],
        "out-of-vocab": [5, 1024],
        "negative": [5, -1],
        "too-long": [7] * MAX_MODEL_LEN,
    }
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    target = reserve(mesh, "bad-target", PROMPTS[0])
    for name, prompt in bad_prompts.items():
        # Default arguments bind this iteration's name and prompt (expect_code calls at once).
        expect_code(
            invalid, lambda name=name, prompt=prompt: reserve(mesh, f"bad-r-{name}", prompt)
        )
        expect_code(
            invalid,
            lambda name=name, prompt=prompt: mesh.decode.Generate(
                decode_pb2.GenerateRequest(
                    request_id=f"bad-g-{name}", prompt_token_ids=prompt, sampling=GREEDY
                ),
                timeout=RPC_TIMEOUT_S,
            ),
        )
        expect_code(
            invalid,
            lambda prompt=prompt: mesh.prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="bad-target", prompt_token_ids=prompt, sampling=GREEDY, target=target
                ),
                timeout=RPC_TIMEOUT_S,
            ),
        )
    expect_code(
        invalid,
        lambda: reserve(mesh, "bad-temp", PROMPTS[0], common_pb2.SamplingParams(temperature=-1)),
    )
    expect_code(invalid, lambda: reserve(mesh, "", PROMPTS[0]))
    wrong = common_pb2.KVTarget()
    wrong.CopyFrom(target)
    wrong.groups[0].pools[0].block_size = BLOCK_SIZE * 2
    expect_code(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: mesh.prefill.Prefill(
            prefill_pb2.PrefillRequest(
                request_id="bad-target", prompt_token_ids=PROMPTS[0], sampling=GREEDY, target=wrong
            ),
            timeout=RPC_TIMEOUT_S,
        ),
    )
    assert mesh.decode.Cancel(
        decode_pb2.CancelRequest(request_id="bad-target"), timeout=RPC_TIMEOUT_S
    ).found
    assert_clean(mesh.decode)
    assert_clean(mesh.prefill)


def test_prefill_in_another_process(mesh: Mesh, offline) -> None:
    """NIXL between processes: a prefill rank started with `pdmesh serve prefill` writes into
    decode."""
    port, instance_id = free_port(), "prefill-proc"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdmesh.cli.main",
            "serve",
            "prefill",
            *mesh.worker_args(instance_id, port),
        ],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        wait_for(lambda: _serving(channel, process), timeout_s=150, what="the prefill process")
        for i, prompt in enumerate(PROMPTS[1:3]):
            tokens, response, _ = disagg(mesh, f"proc-{i}", prompt, prefill=stub)
            assert tokens == offline[tuple(prompt)]
        assert status(stub).kv_bytes_sent == sum(
            prompt_kv_bytes(mesh.model, len(p)) for p in PROMPTS[1:3]
        )
        assert_clean(stub)
        assert_clean(mesh.decode)
    finally:
        channel.close()
        process.send_signal(signal.SIGTERM)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
    assert process.returncode == 0, stderr[-3000:]


def _serving(channel: grpc.Channel, process: subprocess.Popen) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if process.poll() is not None:
        raise AssertionError(f"the prefill process exited: {process.stderr.read()[-3000:]}")
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdmesh.prefill.v1.Prefill"), timeout=1
        )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_registry_lists_the_workers_with_stats(mesh: Mesh) -> None:
    import redis

    from pdmesh_service.registry import InstanceInfo, Registry

    client = redis.Redis.from_url(mesh.redis.url)
    try:
        key = Registry(None, mesh.deployment).key
        infos = {
            i: InstanceInfo.from_json(client.get(key(i))) for i in (mesh.decode_id, mesh.prefill_id)
        }
    finally:
        client.close()
    assert infos[mesh.decode_id].role == "decode" and infos[mesh.prefill_id].role == "prefill"
    for info in infos.values():
        assert info.ready and info.model == mesh.model.name
        assert info.stats.num_kv_blocks_used + info.stats.num_kv_blocks_free > 0
        assert {
            "num_running",
            "num_waiting",
            "num_kv_blocks_used",
            "num_kv_blocks_free",
            "num_kv_bytes_sent",
            "num_kv_bytes_received",
            "num_transfer_failures",
            "num_lease_expiries",
        } <= set(asdict(info.stats))


def test_cores_are_pure() -> None:
    """The decode and prefill cores import no gRPC, Redis or NIXL."""
    code = (
        "import sys, pdmesh_decode.core, pdmesh_prefill.core; "
        "print(sorted(m for m in ('grpc', 'redis', 'nixl') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:] + out.stdout


def test_lease_table_and_reservation_book() -> None:
    from pdmesh_decode.core import (
        LeaseAction,
        LeaseTable,
        Reservation,
        ReservationBook,
        ReservationEvent,
    )
    from pdmesh_service.errors import FailedPrecondition, NotFound

    E = ReservationEvent
    leases = LeaseTable()
    leases.add("a", 2.0)
    leases.add("b", 1.0)
    leases.add("a", 3.0)  # renewed: the old deadline no longer counts
    assert (
        leases.expired(2.5) == ["b"]
        and "a" in leases
        and leases.expired(3.0) == ["a"]
        and not leases
    )
    book = ReservationBook()
    for request_id, num_blocks, num_tokens in (
        ("kv-first", 2, 10),
        ("call-first", 1, 3),
        ("lapses", 1, 3),
    ):
        book.add(Reservation(request_id, num_blocks, num_tokens, lease_s=5.0, cap_s=5.0))
        book.apply(request_id, E.PUBLISHED, now=0.0)
    assert book.apply("kv-first", E.KV_ARRIVED, 1.0).action is LeaseAction.KEEP
    assert (
        book.apply("kv-first", E.DECODE_CALLED, 1.0, first_token_id=7).action is LeaseAction.ADMIT
    )
    assert book.apply("call-first", E.DECODE_CALLED, 1.0).action is LeaseAction.KEEP
    with pytest.raises(FailedPrecondition):
        book.apply("call-first", E.DECODE_CALLED, 1.0, first_token_id=1)
    assert book.apply("call-first", E.KV_ARRIVED, 1.0).action is LeaseAction.ADMIT
    with pytest.raises(NotFound):
        book.apply("unknown", E.DECODE_CALLED, 1.0, first_token_id=1)
    assert "kv-first" not in book and "call-first" not in book  # admitted: out of the book
    assert book.due(5.0) == ["lapses"] and len(book) == 1
    book.pop("lapses")
    assert not book
