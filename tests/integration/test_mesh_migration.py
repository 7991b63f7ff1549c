"""A decode rank that dies or stops mid-stream loses no request: the gateway continues each of its
streams on the other decode rank (`migration`). Real processes (the launcher's), real Redis, NIXL
and gRPC; the reference is the offline engine on the same checkpoint.

The client must see every token once, in order: the final text equals the offline engine's (greedy,
and seeded sampling, whose generator state follows the request), usage counts the original prompt
and every token once, and no block is leaked on the surviving ranks.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from meshlib import V4_WORKER_ARGS, WORKER_ARGS, http_url, wait_idle

from pdmesh.launcher import Mesh, MeshOptions
from pdmesh_service.redis_server import free_port

PROMPTS = [
    "The quick brown fox",
    "def main():\n    return",
    "Return the number of items in a container.",
    "import os\nimport sys\n",
    "class Stack:\n    def push(self, item):",
    "Once upon a time",
    "for i in range(10):",
    "x = [1, 2, 3]\nprint(",
]
MAX_TOKENS = 160
SEEDED = {"temperature": 0.9, "seed": 1234, "top_k": 50}


def _two_decode_mesh(model, log_dir, deployment: str, worker_args) -> Mesh:
    options = MeshOptions(
        model_dir=model,
        num_prefill=1,
        num_decode=2,
        http_port=free_port(),
        grpc_port=free_port(),
        deployment=deployment,
        log_dir=log_dir,
        worker_args=worker_args,
    )
    mesh = Mesh(options)
    mesh.start(timeout_s=240, progress=lambda line: None)
    return mesh


def _reference(model, block_size: int) -> dict:
    """The offline engine's texts: greedy per prompt, and seeded sampling of the first two."""
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(model, num_blocks=512, block_size=block_size)
    greedy = llm.generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    )
    seeded = llm.generate(
        PROMPTS[:2], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **SEEDED)
    )
    return {("greedy", p): o.text for p, o in zip(PROMPTS, greedy, strict=True)} | {
        ("seeded", p): o.text for p, o in zip(PROMPTS[:2], seeded, strict=True)
    }


@pytest.fixture(scope="module")
def two_decode_mesh(tiny_model, tmp_path_factory):
    mesh = _two_decode_mesh(
        tiny_model, tmp_path_factory.mktemp("logs-migration"), "test-migration", WORKER_ARGS
    )
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return _reference(tiny_model, 8)


@dataclass
class Stream:
    """One streamed completion read on its own thread."""

    prompt: str
    kind: str
    text: str = ""
    usage: dict | None = None
    error: str | None = None
    finish_reason: str | None = None
    chunks: int = 0
    started: threading.Event = field(default_factory=threading.Event)

    def body(self, model: str) -> dict:
        sampling = {"temperature": 0} if self.kind == "greedy" else dict(SEEDED)
        return {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }

    def run(self, url: str, model: str) -> None:
        try:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=self.body(model), timeout=120
            ) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        self.error = event["error"]["message"]
                        return
                    if event.get("usage"):
                        self.usage = event["usage"]
                    for choice in event.get("choices", ()):
                        self.text += choice.get("text", "")
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        self.chunks += 1
                        self.started.set()
        except Exception as e:  # noqa: BLE001 - the test reports it
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()


def _migrations(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    for line in metrics.splitlines():
        if line.startswith("pdmesh_gateway_migrations_total "):
            return float(line.split()[1])
    raise AssertionError("the gateway exports no pdmesh_gateway_migrations_total")


def _run_with_fault(mesh: Mesh, streams: list[Stream], fault) -> None:
    url, model = http_url(mesh), mesh.options.model_dir.name
    threads = [threading.Thread(target=s.run, args=(url, model)) for s in streams]
    for t in threads:
        t.start()
    for s in streams:
        assert s.started.wait(60), "a stream never started"
    fault()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a stream hung"


def _check(streams: list[Stream], reference: dict, tiny_model) -> None:
    from pdmesh_engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model)
    for s in streams:
        assert s.error is None, f"{s.prompt!r}: {s.error}"
        assert s.text == reference[(s.kind, s.prompt)], f"{s.kind} {s.prompt!r} differs"
        assert s.finish_reason == "length"
        assert s.usage is not None
        assert s.usage["completion_tokens"] == MAX_TOKENS
        assert s.usage["prompt_tokens"] == len(tok.encode(s.prompt))


def _streams() -> list[Stream]:
    return [Stream(p, "greedy") for p in PROMPTS] + [Stream(p, "seeded") for p in PROMPTS[:2]]


def _restart(mesh: Mesh, name: str) -> None:
    """Start a stopped service again (same argv: same instance id and ports)."""
    mesh.processes[name].wait(30)
    spec = next(s for s in mesh.specs if s.name == name)
    mesh._spawn(spec)
    mesh._wait_serving(spec, spec.grpc_address, time.monotonic() + 120)


def _kill_9_loses_no_request(mesh: Mesh, reference: dict, model) -> None:
    url = http_url(mesh)
    before = _migrations(url)
    streams = _streams()
    victim = mesh.processes["decode-0"]
    _run_with_fault(mesh, streams, lambda: victim.send_signal(signal.SIGKILL))
    _check(streams, reference, model)
    assert _migrations(url) > before, "no stream was on the killed decode rank"
    _restart(mesh, "decode-0")
    for role, group in wait_idle(mesh).items():
        for status in group:
            assert status.kv_blocks_used == 0, f"{role} {status.instance_id} leaks blocks"


def test_kill_9_of_a_decode_mid_stream_loses_no_request(two_decode_mesh, reference, tiny_model):
    _kill_9_loses_no_request(two_decode_mesh, reference, tiny_model)


def test_kill_9_of_a_decode_mid_stream_loses_no_request_on_v4(tiny_v4, tmp_path):
    """The same on DeepSeek-V4: the stream continues on the other rank from its hybrid state,
    recomputed there (the window and compressed entries of prompt + tokens so far)."""
    mesh = _two_decode_mesh(tiny_v4, tmp_path / "logs", "test-migration-v4", V4_WORKER_ARGS)
    try:
        _kill_9_loses_no_request(mesh, _reference(tiny_v4, 16), tiny_v4)
    finally:
        mesh.stop()


def test_a_paused_decode_is_abandoned_and_its_streams_move_on(
    two_decode_mesh, reference, tiny_model
):
    """SIGSTOP: the rank is not dead (its sockets stay open), it only stops heartbeating."""
    mesh, url = two_decode_mesh, http_url(two_decode_mesh)
    before = _migrations(url)
    streams = _streams()
    victim = mesh.processes["decode-1"]
    _run_with_fault(mesh, streams, lambda: os.kill(victim.pid, signal.SIGSTOP))
    try:
        _check(streams, reference, tiny_model)
        assert _migrations(url) > before
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    # woken up, it drops the requests the gateway abandoned: nothing is leaked anywhere
    for role, group in wait_idle(mesh, timeout_s=60).items():
        for status in group:
            assert status.kv_blocks_used == 0, f"{role} {status.instance_id} leaks blocks"
