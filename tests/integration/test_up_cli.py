"""`pdmesh up` as a user runs it: it prints where it serves, serves, and on SIGTERM stops every
process it started (no orphan: Redis, kvstore, prefill, decode, gateway)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdmesh_service.redis_server import free_port


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_serves_then_stops_everything_on_sigterm(tiny_model, tmp_path) -> None:
    http_port, grpc_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "pdmesh.cli.main",
        "up",
        "--model",
        str(tiny_model),
        "--port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--log-dir",
        str(tmp_path / "logs"),
        "--num-blocks",
        "64",
        "--block-size",
        "8",
        "--torch-threads",
        "1",
        "--deployment",
        "up-cli",
    ]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        banner, deadline = [], time.monotonic() + 240
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            banner.append(line)
            if "Ctrl-C stops everything" in line:
                break
        text = "".join(banner)
        assert f"http://127.0.0.1:{http_port}/v1" in text and "curl" in text, text
        reply = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/completions",
            timeout=60,
            json={"model": tiny_model.name, "prompt": "Hello", "max_tokens": 4},
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        started = _descendants(process.pid)
        assert len(started) >= 5  # redis, kvstore, prefill, decode, gateway
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in started if _alive(pid)]
    finally:
        if process.poll() is None:
            process.kill()
