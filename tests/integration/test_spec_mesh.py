"""Speculative decoding across the mesh: real processes, Redis, NIXL and gRPC, the tiny model.

Four meshes, one after the other (class-scoped):
- disaggregated, MTP, K = 2: greedy outputs (openai SDK, plain, streamed, with a stop string) equal
  the offline engine with speculation off; the hand-off moves the blocks of both pools, to the byte;
  the decode worker exports the speculation series; aborts leave no block behind; a prefill rank
  refuses to push into a decode rank without speculation (asked directly, and through the gateway
  once such a rank is the only decode rank: 409 with the reason);
- disaggregated, the target as its own draft model, K = 3: every draft is accepted after the
  hand-off (the proposer's KV arrived with it); a short prompt takes the gateway's local-prefill
  path on the decode rank; steps of up to 4 tokens stream and stop exactly like speculation off;
- aggregated, started by the `pdmesh up` command, `tiny-draft` as the draft model, K = 1: greedy
  outputs equal speculation off;
- disaggregated with a DEP2 prefill and a DEP2 decode instance, `tiny-draft` as the draft model
  (its experts split over the ranks), K = 2: greedy outputs (concurrent, streamed) equal
  speculation off, both decode ranks speculated, and the draft KV the prefill ranks sent is what
  the decode ranks received.
Engine-level coverage of every K and method is in tests/engine/transfer/test_spec_handoff.py.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest
from meshlib import (
    WORKER_ARGS,
    abandon_stream,
    http_url,
    kill,
    mesh_metadata,
    wait_idle,
    worker_status,
)
from openai import OpenAI

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_service.redis_server import free_port

BLOCK_SIZE = 8  # WORKER_ARGS' --block-size
MAX_TOKENS = 16
# token-id prompts: 3, 13, 24 (3 full blocks) and 30 tokens
PROMPTS = [
    [(11 + 17 * i + 5 * k) % 900 + 4 for i in range(n)] for k, n in enumerate([3, 13, 24, 30])
]


@pytest.fixture(scope="module")
def models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pdmesh.tools.model_init import init_model

    root = tmp_path_factory.mktemp("draft")
    draft = init_model(root / "tiny-draft", "tiny-draft", seed=0, verbose=False)
    return {"tiny": tiny_model, "draft": draft}


@pytest.fixture(scope="module")
def offline(models: dict[str, Path]):
    """Greedy completions with speculation off: (without stop, with its stop string) per prompt.
    The stop string is a piece of the prompt's own continuation, so it is met."""
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(models["tiny"], num_blocks=256, block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    plain = llm.generate([{"prompt_ids": p} for p in PROMPTS], params)
    stops = [_stop_of(out.text) for out in plain]
    stopped = [
        llm.generate([{"prompt_ids": p}], replace(params, stop=[s]))[0]
        for p, s in zip(PROMPTS, stops, strict=True)
    ]
    return plain, stops, stopped


def _stop_of(text: str) -> str:
    """Two characters from the middle of `text` (not its start: the stop must cut something)."""
    middle = len(text) // 2
    return text[middle : middle + 2]


def _start(models: dict[str, Path], log_dir: Path, mode: str, spec: tuple[str, ...], **kw) -> Mesh:
    mesh = Mesh(
        MeshOptions(
            model_dir=models["tiny"],
            mode=mode,
            http_port=free_port(),
            grpc_port=free_port(),
            deployment=f"test-spec-{mode}-{log_dir.name}",
            log_dir=log_dir,
            worker_args=WORKER_ARGS + spec,
            **kw,
        )
    )
    mesh.start(timeout_s=240, progress=lambda line: None)
    return mesh


def _client(mesh: Mesh) -> OpenAI:
    return OpenAI(base_url=f"{http_url(mesh)}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(mesh: Mesh, prompt: list[int], stop: str | None = None, stream: bool = False):
    """(text, finish_reason, completion tokens) of a greedy completion through the openai SDK."""
    kw = dict(
        model=mesh.options.model_dir.name,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        stop=stop,
    )
    client = _client(mesh)
    if not stream:
        out = client.completions.create(**kw)
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens
    text, finish, usage = "", None, None
    for chunk in client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return text, finish, usage


def _check_outputs(mesh: Mesh, offline, stream: bool = False) -> None:
    plain, stops, stopped = offline
    for prompt, ref, stop, ref_stop in zip(PROMPTS, plain, stops, stopped, strict=True):
        assert _complete(mesh, prompt, stream=stream) == (ref.text, "length", MAX_TOKENS)
        text, finish, _ = _complete(mesh, prompt, stop=stop, stream=stream)
        assert (text, finish) == (ref_stop.text, "stop") and len(text) < len(ref.text)


def _metrics(mesh: Mesh, name: str) -> str:
    [spec] = [s for s in mesh.specs if s.name == name]
    return httpx.get(f"http://{mesh.options.host}:{spec.metrics_port}/metrics", timeout=10).text


def _series(text: str, family: str, instance: str) -> dict[str, float]:
    """{label string: value} of `family`'s samples of one instance."""
    found = {}
    for line in text.splitlines():
        match = re.match(rf"{family}\{{(.*)\}} (\S+)$", line)
        if match and f'instance="{instance}"' in match.group(1):
            found[match.group(1)] = float(match.group(2))
    return found


def _spec_totals(mesh: Mesh) -> dict[str, dict[str, float]]:
    """The decode worker's speculation series (its Status call brings them up to date first)."""
    worker_status(mesh, "decode")
    text = _metrics(mesh, "decode-0")
    return {
        family: _series(text, f"pdmesh_spec_decode_{family}_total", "decode-0")
        for family in ("draft_tokens", "accepted_tokens", "verify_steps", "emitted_tokens")
    }


def _assert_no_leaks(mesh: Mesh) -> None:
    for role, group in wait_idle(mesh).items():
        for status in group:
            assert status.integrity_checked and status.integrity_error == "", (role, status)
            assert status.kv_blocks_used == 0 and not status.num_running, (role, status)


def _bytes_per_block(model: Path, layers: int | None = None) -> int:
    """One block of a pool of `model`'s latent width: `layers` (default: all) x tokens x entry x
    fp32."""
    from pdmesh_engine.config import ModelConfig

    config = ModelConfig.from_dir(model)
    return (layers or config.num_hidden_layers) * BLOCK_SIZE * config.kv_cache_dim * 4


@pytest.fixture(scope="class")
def mtp_mesh(models, tmp_path_factory):
    spec = ("--speculative-method", "mtp", "--num-speculative-tokens", "2")
    mesh = _start(models, tmp_path_factory.mktemp("logs-spec-mtp"), "disagg", spec)
    yield mesh
    mesh.stop()


class TestDisaggMTP:
    @pytest.fixture
    def mesh(self, mtp_mesh):
        return mtp_mesh

    def test_greedy_outputs_and_stops_equal_speculation_off(self, mesh, offline):
        _check_outputs(mesh, offline)
        _check_outputs(mesh, offline, stream=True)
        totals = _spec_totals(mesh)
        assert set(totals["draft_tokens"]) == {
            f'instance="decode-0",position="{p}"' for p in (0, 1)
        }
        assert sum(totals["draft_tokens"].values()) > 0
        [steps], [emitted] = totals["verify_steps"].values(), totals["emitted_tokens"].values()
        assert steps > 0 and steps <= emitted <= 3 * steps
        _assert_no_leaks(mesh)

    def test_handoff_moves_both_pools_to_the_byte(self, mesh, models):
        target = _bytes_per_block(models["tiny"])
        draft = _bytes_per_block(models["tiny"], layers=1)  # the one MTP layer
        before = {role: worker_status(mesh, role)[0] for role in ("prefill", "decode")}
        sent_draft = _series(
            _metrics(mesh, "prefill-0"), "pdmesh_kv_transfer_draft_bytes_total", "prefill-0"
        )
        for prompt in PROMPTS:
            _complete(mesh, prompt)
        num_blocks = sum(math.ceil(len(p) / BLOCK_SIZE) for p in PROMPTS)  # 1 + 2 + 3 + 4
        after = {role: worker_status(mesh, role)[0] for role in ("prefill", "decode")}
        expected = num_blocks * (target + draft)
        assert after["prefill"].kv_bytes_sent - before["prefill"].kv_bytes_sent == expected
        assert after["decode"].kv_bytes_received - before["decode"].kv_bytes_received == expected
        [draft_before] = sent_draft.values()
        [draft_after] = _series(
            _metrics(mesh, "prefill-0"), "pdmesh_kv_transfer_draft_bytes_total", "prefill-0"
        ).values()
        assert draft_after - draft_before == num_blocks * draft
        [received] = _series(
            _metrics(mesh, "decode-0"), "pdmesh_kv_received_draft_bytes_total", "decode-0"
        ).values()
        assert received == draft_after  # every WRITE of this mesh went to decode-0
        assert after["prefill"].transfer_failures == 0

    def test_prefill_refuses_a_decode_rank_without_speculation(self, mesh):
        """A hand-off to a rank that expects no proposer KV fails fast, before any WRITE."""
        from pdmesh_proto.common.v1 import common_pb2
        from pdmesh_proto.decode.v1 import decode_pb2, decode_pb2_grpc
        from pdmesh_proto.prefill.v1 import prefill_pb2, prefill_pb2_grpc

        decode = next(s for s in mesh.specs if s.role == "decode")
        prefill = next(s for s in mesh.specs if s.role == "prefill")
        metadata = mesh_metadata(mesh)
        sampling = common_pb2.SamplingParams(max_tokens=4)
        with grpc.insecure_channel(decode.grpc_address) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            reply = stub.Reserve(
                decode_pb2.ReserveRequest(
                    request_id="spec-mismatch", prompt_token_ids=PROMPTS[1], sampling=sampling
                ),
                timeout=30,
                metadata=metadata,
            )
            groups = [g.name for g in reply.target.groups]
            assert reply.target.speculative == "mtp" and groups == ["kv", "draft"]
            target = common_pb2.KVTarget()
            target.CopyFrom(reply.target)
            del target.groups[1]  # what a rank without speculation sends
            target.speculative = ""
            with grpc.insecure_channel(prefill.grpc_address) as prefill_channel:
                with pytest.raises(grpc.RpcError) as failed:
                    prefill_pb2_grpc.PrefillStub(prefill_channel).Prefill(
                        prefill_pb2.PrefillRequest(
                            request_id="spec-mismatch",
                            prompt_token_ids=PROMPTS[1],
                            sampling=sampling,
                            target=target,
                        ),
                        timeout=30,
                        metadata=metadata,
                    )
            stub.Cancel(
                decode_pb2.CancelRequest(request_id="spec-mismatch"), timeout=30, metadata=metadata
            )
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--speculative-method" in failed.value.details()
        assert "no speculative decoding" in failed.value.details()
        _assert_no_leaks(mesh)

    def test_aborts_mid_speculation_leave_no_blocks(self, mesh):
        body = {
            "model": mesh.options.model_dir.name,
            "prompt": PROMPTS[3],
            "max_tokens": 300,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        for _ in range(3):  # each leaves with its request decoding speculatively
            abandon_stream(mesh, body)
        _assert_no_leaks(mesh)

    def test_a_decode_rank_without_speculation_is_refused_end_to_end(self, mesh):
        """Last of the class (it kills decode-0): a decode rank started without the speculation
        flags joins the mesh. Its revision differs from the speculating prefill rank's, so the
        gateway never pairs them: the request is served by the decode rank alone (no cross-revision
        hand-off is even tried), and nothing leaks. (A prefill rank handed such a target anyway
        refuses it with the reason: tests/services/test_revision.py.)"""
        from pdmesh.launcher import ServiceSpec

        [decode] = [s for s in mesh.specs if s.name == "decode-0"]
        argv = list(decode.argv)
        del argv[argv.index("--speculative-method") : argv.index("--speculative-method") + 4]
        port, metrics = free_port(), free_port()
        for flag, value in (("--port", port), ("--metrics-port", metrics)):
            argv[argv.index(flag) + 1] = str(value)
        argv[argv.index("--instance-id") + 1] = "decode-plain"
        plain = ServiceSpec("decode-plain", "decode", f"127.0.0.1:{port}", tuple(argv), metrics)
        mesh._spawn(plain)
        mesh._wait_serving(plain, plain.grpc_address, time.monotonic() + 120)
        kill(mesh, "decode-0")
        mesh.specs.remove(decode)
        mesh.specs.append(plain)
        reply = httpx.post(
            f"{http_url(mesh)}/v1/completions",
            json={"model": mesh.options.model_dir.name, "prompt": PROMPTS[1], "max_tokens": 4},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens_details"]["prefill_path"] == "agg"
        _assert_no_leaks(mesh)


@pytest.fixture(scope="class")
def self_draft_mesh(models, tmp_path_factory):
    spec = (
        "--speculative-method",
        "draft_model",
        "--num-speculative-tokens",
        "3",
        "--draft-model",
        str(models["tiny"]),
    )
    mesh = _start(
        models,
        tmp_path_factory.mktemp("logs-spec-self"),
        "disagg",
        spec,
        gateway_args=("--local-prefill-tokens", "4"),
    )
    yield mesh
    mesh.stop()


class TestDisaggSelfDraft:
    @pytest.fixture
    def mesh(self, self_draft_mesh):
        return self_draft_mesh

    def test_every_draft_is_accepted_after_the_handoff(self, mesh, offline):
        plain, _, _ = offline
        for prompt, ref in zip(PROMPTS, plain, strict=True):
            assert _complete(mesh, prompt) == (ref.text, "length", MAX_TOKENS)
        # the 3-token prompt was prefilled on the decode rank itself (its engine, its proposer)
        text = httpx.get(f"{http_url(mesh)}/metrics", timeout=10).text
        assert 'pdmesh_gateway_prefill_paths_total{path="local"} 1.0' in text, text
        sent = worker_status(mesh, "prefill")[0].kv_bytes_sent
        per_block = 2 * _bytes_per_block(mesh.options.model_dir)  # the target and its twin
        assert sent == sum(math.ceil(len(p) / BLOCK_SIZE) for p in PROMPTS[1:]) * per_block
        totals = _spec_totals(mesh)
        drafts, accepted = totals["draft_tokens"], totals["accepted_tokens"]
        assert len(drafts) == 3 and drafts['instance="decode-0",position="2"'] > 0
        assert accepted == drafts  # acceptance 1.0 at every position
        [steps], [emitted] = totals["verify_steps"].values(), totals["emitted_tokens"].values()
        assert emitted == steps + sum(accepted.values())
        assert emitted > 2 * steps  # most steps return several tokens at once
        _assert_no_leaks(mesh)

    def test_several_tokens_per_step_stream_and_stop_like_one(self, mesh, offline):
        """Chunks of up to 4 tokens: the stop strings cut where one token per step would, streamed
        or not."""
        _check_outputs(mesh, offline)
        _check_outputs(mesh, offline, stream=True)
        totals = _spec_totals(mesh)
        assert totals["accepted_tokens"] == totals["draft_tokens"]
        _assert_no_leaks(mesh)


class _UpMesh:
    """A mesh run by the `pdmesh up` command itself (what `_complete` and `_check_outputs` need)."""

    def __init__(self, models: dict[str, Path], log_dir: Path, argv: list[str]) -> None:
        self.log_dir = log_dir
        self.options = MeshOptions(models["tiny"], http_port=free_port(), grpc_port=free_port())
        command = [sys.executable, "-m", "pdmesh.cli.main", "up", "--model", str(models["tiny"])]
        command += ["--port", str(self.options.http_port), "--grpc-port"]
        command += [str(self.options.grpc_port), "--log-dir", str(log_dir), "--deployment"]
        command += ["test-spec-up", *WORKER_ARGS, *argv]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        for line in self.process.stdout or ():
            if "Ctrl-C stops everything" in line:
                return
        raise AssertionError(f"pdmesh up exited with {self.process.wait(60)}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()


@pytest.fixture(scope="class")
def agg_up_mesh(models, tmp_path_factory):
    argv = ["--mode", "agg", "--speculative-method", "draft_model"]
    mesh = _UpMesh(
        models,
        tmp_path_factory.mktemp("logs-spec-agg"),
        argv + ["--draft-model", str(models["draft"])],
    )
    yield mesh
    mesh.stop()


class TestAggDraftModelThroughUp:
    """`pdmesh up --mode agg --speculative-method draft_model --draft-model DIR` (K = 1 by default):
    the flags reach the decode worker, and its own prefill feeds the draft model's KV."""

    def test_greedy_outputs_equal_speculation_off(self, agg_up_mesh, offline):
        _check_outputs(agg_up_mesh, offline, stream=True)
        log = (agg_up_mesh.log_dir / "decode-0.log").read_text()
        [serving] = [json.loads(line) for line in log.splitlines() if '"serving"' in line]
        assert serving["speculative"] == "draft_model:tiny-draft"
        assert serving["num_speculative_tokens"] == 1


def test_up_refuses_bad_speculation_flags_before_starting(tiny_model: Path) -> None:
    """`pdmesh up --num-speculative-tokens 2` without a method fails at once with the reason,
    starting nothing."""
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "pdmesh.cli.main", "up", "--model", str(tiny_model)),
            *("--decode-dep", "2", "--num-speculative-tokens", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "needs a speculative_method" in done.stderr
    assert "pdmesh up: model" not in done.stderr


@pytest.fixture(scope="class")
def dep_draft_mesh(models, tmp_path_factory):
    spec = (
        *("--speculative-method", "draft_model", "--num-speculative-tokens", "2"),
        *("--draft-model", str(models["draft"])),
    )
    log_dir = tmp_path_factory.mktemp("logs-spec-dep")
    mesh = _start(models, log_dir, "disagg", spec, prefill_dep=2, decode_dep=2)
    yield mesh
    mesh.stop()


def _rank_series(mesh: Mesh, role: str, family: str) -> dict[int, float]:
    """{rank: the sum of `family`'s samples} over the two ranks of the DEP instance `role`-0."""
    [spec] = [s for s in mesh.specs if s.role == role]
    assert spec.metrics_port is not None and len(spec.addresses) == 2
    found = {}
    for rank in range(2):
        instance = f"{role}-0-r{rank}"
        url = f"http://{mesh.options.host}:{spec.metrics_port + rank}/metrics"
        found[rank] = sum(_series(httpx.get(url, timeout=10).text, family, instance).values())
    return found


class TestDEP2DraftModel:
    """`pdmesh up --prefill-dep 2 --decode-dep 2` with the tiny-draft model, K = 2 (its launcher):
    every rank of both instances drafts in lockstep, the draft's experts split over the ranks."""

    def test_greedy_outputs_equal_speculation_off_on_every_rank(self, dep_draft_mesh, offline):
        mesh = dep_draft_mesh
        plain, _, _ = offline
        with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:  # concurrent: every rank gets requests
            outs = list(pool.map(lambda p: _complete(mesh, p), PROMPTS * 2))
        assert outs == [(ref.text, "length", MAX_TOKENS) for ref in plain * 2]
        _check_outputs(mesh, offline, stream=True)
        worker_status(mesh, "decode")  # brings every rank's series up to date
        drafted = _rank_series(mesh, "decode", "pdmesh_spec_decode_draft_tokens_total")
        assert all(n > 0 for n in drafted.values()), drafted  # both decode ranks speculated
        steps = _rank_series(mesh, "decode", "pdmesh_spec_decode_verify_steps_total")
        emitted = _rank_series(mesh, "decode", "pdmesh_spec_decode_emitted_tokens_total")
        assert all(steps[r] <= emitted[r] <= 3 * steps[r] for r in steps), (steps, emitted)
        # the prompts' draft KV came from the prefill ranks, in the hand-offs' WRITEs
        sent = _rank_series(mesh, "prefill", "pdmesh_kv_transfer_draft_bytes_total")
        received = _rank_series(mesh, "decode", "pdmesh_kv_received_draft_bytes_total")
        assert sum(sent.values()) == sum(received.values()) > 0
        _assert_no_leaks(mesh)
