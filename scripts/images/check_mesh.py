"""The checks `scripts/test-images.sh` runs against a mesh it started (compose, or `pdmesh up`).

    python scripts/images/check_mesh.py ready URL [--timeout-s S] [--live-only]
    python scripts/images/check_mesh.py serve URL --model DIR           # the openai SDK checks
    python scripts/images/check_mesh.py kill-decode URL --compose "docker compose -f ..."
    python scripts/images/check_mesh.py speed URL [--requests N] [--max-tokens T] --json OUT

- `ready`: until GET /health/ready answers 200 (or /health/live, for a control plane without
  workers, whose readiness must then say why it is not ready: no decode rank).
- `serve`: a completion and an SSE chat stream through the openai SDK; the greedy completion equals
  `pdmesh generate` on the same checkpoint (run here, on the host); the decode worker's metrics show
  KV bytes received over NIXL.
- `kill-decode`: streams in flight when the decode container's process is killed (SIGKILL from the
  host, so its restart policy applies, not a manual stop): every stream ends with all its tokens,
  the container restarts and the mesh serves again.
- `speed`: decode tokens/s of one stream at a time (the median over the requests: tokens after the
  first over the time after the first), the figure set beside `pdmesh up`'s.

Each prints one JSON line of what it measured and exits non-zero with the reason when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai

PROMPT = "def fibonacci(n):"
GREEDY_TOKENS = 24


class CheckFailed(Exception):
    pass


def _get(url: str, path: str) -> httpx.Response | None:
    try:
        return httpx.get(url + path, timeout=5.0)
    except httpx.HTTPError:
        return None


def ready(url: str, timeout_s: float, live_only: bool) -> dict:
    start = time.monotonic()
    path = "/health/live" if live_only else "/health/ready"
    while (answer := _get(url, path)) is None or answer.status_code != 200:
        if time.monotonic() - start > timeout_s:
            status = "no answer" if answer is None else f"{answer.status_code} {answer.text[:300]}"
            raise CheckFailed(f"{url}{path} not 200 within {timeout_s:.0f}s: {status}")
        time.sleep(1.0)
    result = {"ready_after_s": round(time.monotonic() - start, 1)}
    if live_only:  # a control plane alone: alive, and not ready for want of a decode rank
        answer = _get(url, "/health/ready")
        if answer is None or answer.status_code != 503 or "decode" not in answer.text:
            raise CheckFailed(f"readiness without workers: {answer and answer.text[:300]}")
        result["ready_without_workers"] = answer.json()
    return result


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1", api_key=os.environ.get("PDMESH_API_KEY", "none"), timeout=120.0
    )


def _model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _decode_metric(compose: list[str], name: str) -> float:
    """The sum of `name`'s samples on the decode worker's /metrics (read inside its container)."""
    read = (
        "import urllib.request;"
        "print(urllib.request.urlopen('http://127.0.0.1:9090/metrics').read().decode())"
    )
    text = subprocess.run(
        [*compose, "exec", "-T", "decode", "python", "-c", read],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def serve(url: str, model_dir: Path, compose: list[str] | None) -> dict:
    client = _client(url)
    model = _model_name(client)
    started = time.monotonic()
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=GREEDY_TOKENS, temperature=0.0
    )
    first_completion_s = time.monotonic() - started
    reference = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pdmesh.cli.main",
                "generate",
                "--model",
                str(model_dir),
                "--prompt",
                PROMPT,
                "--max-tokens",
                str(GREEDY_TOKENS),
                "--json",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    if completion.choices[0].text != reference["text"]:
        raise CheckFailed(
            f"greedy differs from pdmesh generate: {completion.choices[0].text!r} "
            f"!= {reference['text']!r}"
        )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Write a haiku about caches."}],
            max_tokens=16,
            stream=True,
            temperature=0.0,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    if not text or finish[-1:] not in (["length"], ["stop"]):
        raise CheckFailed(f"SSE chat: text {text!r}, finish {finish}")
    result = {
        "model": model,
        "greedy_equals_pdmesh_generate": True,
        "sse_chunks": len(chunks),
        "first_completion_s": round(first_completion_s, 2),
    }
    if compose:
        received = _decode_metric(compose, "pdmesh_kv_received_bytes_total")
        if received <= 0:
            raise CheckFailed("the decode worker received no KV bytes over NIXL")
        result["kv_received_bytes"] = int(received)
    return result


def kill_decode(url: str, compose: list[str], streams: int, max_tokens: int) -> dict:
    client = _client(url)
    model = _model_name(client)
    container = subprocess.run(
        [*compose, "ps", "-q", "decode"], capture_output=True, text=True, check=True
    ).stdout.strip()
    inspect = ["docker", "inspect", "-f"]

    def state(field: str) -> str:
        return subprocess.run(
            [*inspect, field, container], capture_output=True, text=True, check=True
        ).stdout.strip()

    restarts_before = int(state("{{.RestartCount}}"))
    tokens: list[int] = [0] * streams  # chunks seen
    counted: list[list[int]] = [[] for _ in range(streams)]  # each stream's usage
    errors: list[str] = []
    first = threading.Barrier(streams + 1, timeout=120)

    def stream(i: int) -> None:
        try:
            prompt = f"{PROMPT} # stream {i}"
            for _ in _token_times(client, model, prompt, max_tokens, counted[i]):
                tokens[i] += 1
                if tokens[i] == 1:
                    first.wait()
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            errors.append(f"stream {i}: {type(exc).__name__}: {exc}")
            if not first.broken:
                first.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    first.wait()  # every stream has its first token: all are in flight on the decode worker
    at_kill = list(tokens)
    os.kill(int(state("{{.State.Pid}}")), signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=300)
    served_s = time.monotonic() - killed_at
    if errors:
        raise CheckFailed("; ".join(errors))
    done = [c[-1] if c else 0 for c in counted]
    if any(n != max_tokens for n in done):
        raise CheckFailed(f"streams ended short after the kill: {done} of {max_tokens} tokens")
    deadline = time.monotonic() + 300
    while state("{{.State.Health.Status}}") != "healthy" or state("{{.State.Running}}") != "true":
        if time.monotonic() > deadline:
            raise CheckFailed("the killed decode container did not come back healthy")
        time.sleep(2.0)
    restarts = int(state("{{.RestartCount}}")) - restarts_before
    if restarts < 1:
        raise CheckFailed("the decode container was not restarted by its restart policy")
    after = serve_once(client, model)
    return {
        "streams": streams,
        "tokens_at_kill": at_kill,
        "tokens_after": done,
        "streams_done_s_after_kill": round(served_s, 1),
        "decode_restarts": restarts,
        "serves_after_restart": after,
    }


def _token_times(
    client: openai.OpenAI, model: str, prompt: str, max_tokens: int, usage: list[int] | None = None
) -> Iterator[float]:
    """The arrival time of each streamed chunk that carries text (greedy, EOS ignored); the
    completion's token count is appended to `usage` (the stream's last chunk says it)."""
    for chunk in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].text:
            yield time.perf_counter()
        if chunk.usage is not None and usage is not None:
            usage.append(chunk.usage.completion_tokens)


def serve_once(client: openai.OpenAI, model: str) -> bool:
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0.0)
    return bool(done.choices[0].text)


def speed(url: str, requests: int, max_tokens: int) -> dict:
    client = _client(url)
    model = _model_name(client)
    rates = []
    for i in range(requests):
        usage: list[int] = []
        times = list(_token_times(client, model, f"{PROMPT} # speed {i}", max_tokens, usage))
        if len(times) < 2 or not usage:
            raise CheckFailed(f"request {i} streamed {len(times)} chunks, usage {usage}")
        rates.append((usage[-1] - 1) / (times[-1] - times[0]))  # tokens after the first
    return {
        "decode_tokens_per_s": round(statistics.median(rates), 2),
        "requests": requests,
        "max_tokens": max_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("check", choices=["ready", "serve", "kill-decode", "speed"])
    parser.add_argument("url")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--live-only", action="store_true")
    parser.add_argument("--model", type=Path, help="the checkpoint the mesh serves (serve)")
    parser.add_argument("--compose", help="the compose command line of the mesh under test")
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    compose = shlex.split(args.compose) if args.compose else None
    try:
        if args.check == "ready":
            result = ready(args.url, args.timeout_s, args.live_only)
        elif args.check == "serve":
            if args.model is None:
                parser.error("serve needs --model")
            result = serve(args.url, args.model, compose)
        elif args.check == "kill-decode":
            if compose is None:
                parser.error("kill-decode needs --compose")
            result = kill_decode(args.url, compose, args.streams, args.max_tokens)
        else:
            result = speed(args.url, args.requests, args.max_tokens)
    except CheckFailed as exc:
        print(f"check {args.check} FAILED: {exc}", file=sys.stderr)
        return 1
    line = json.dumps({"check": args.check, **result})
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
