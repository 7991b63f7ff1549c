"""`pdmesh up` keeps the mesh up, on one mesh started as a user does (prefill 1, decode DEP2, the
tiny model), in order:

- kill -9 one decode rank: the DEP instance stops its other rank (no traceback), exits, and comes
  back as a whole (new instance pid, both ranks SERVING and back in the registry); completions work;
- kill -9 the (single-process) prefill: the same, for a plain process;
- kill -9 the embedded Redis: back on its port, still refusing clients without the password;
  the restart records are in it again;
- kill -9 the launcher itself: every process below it (Redis, services, DEP ranks) is gone within
  seconds and the Redis port is closed.
The children find Redis and the mesh token in their environment, never in their argv.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from pdmesh_service.redis_server import free_port
from pdmesh_service.supervision import read_restarts_sync

DEPLOYMENT = "up-supervision"


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(pid: int) -> set[int]:
    children, found, todo = _children(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def argv_of(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


class Up:
    """A `pdmesh up` process: its stderr lines as they come, and lookups of its processes."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stderr,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip())

    def wait_banner(self, timeout_s: float) -> str:
        banner, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            banner.append(line)
            if "Ctrl-C stops everything" in line:
                break
        return "".join(banner)

    def wait_line(self, text: str, timeout_s: float, after: int = 0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [line for line in self.lines[after:] if text in line]
            if found:
                return found[0]
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} from pdmesh up; stderr:\n" + "\n".join(self.lines))

    def pid(self, instance_id: str) -> int:
        """The launcher's child serving `instance_id` (a DEP instance: its supervisor)."""
        for pid in _children().get(self.process.pid, []):
            argv = argv_of(pid)
            if "--instance-id" in argv and argv[argv.index("--instance-id") + 1] == instance_id:
                return pid
        raise LookupError(instance_id)

    def redis_pid(self) -> int:
        return next(
            p for p in _children().get(self.process.pid, []) if "redis" in " ".join(argv_of(p))
        )


@pytest.fixture(scope="module")
def up(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    http_port, log_dir = free_port(), tmp_path_factory.mktemp("logs-supervision")
    argv = [
        *(sys.executable, "-m", "pdmesh.cli.main", "up", "--model", str(tiny_model)),
        *("--port", str(http_port), "--grpc-port", str(free_port())),
        *("--log-dir", str(log_dir)),
        *("--decode-dep", "2", "--deployment", DEPLOYMENT),
        *("--num-blocks", "64", "--block-size", "8", "--torch-threads", "1"),
    ]
    mesh = Up(argv)
    try:
        text = mesh.wait_banner(240)
        assert "Ctrl-C stops everything" in text, "\n".join(mesh.lines)
        mesh.http = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
        mesh.log_dir = log_dir  # type: ignore[attr-defined]
        gateway_env = environ_of(mesh.pid("gateway-0"))
        mesh.redis_url = gateway_env["PDMESH_REDIS_URL"]  # type: ignore[attr-defined]
        mesh.token = gateway_env["PDMESH_MESH_TOKEN"]  # type: ignore[attr-defined]
        yield mesh
    finally:
        if mesh.process.poll() is None:
            mesh.process.kill()
        for pid in descendants(mesh.process.pid):
            os.kill(pid, signal.SIGKILL)


def complete(up: Up) -> None:
    model = "tiny"
    reply = httpx.post(
        f"{up.http}/v1/completions",  # type: ignore[attr-defined]
        timeout=60,
        json={"model": model, "prompt": "Hello", "max_tokens": 4},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


def registered_since(up: Up, instance_ids: list[str], since_ms: int, timeout_s: float) -> None:
    """Every id is in the registry, published after `since_ms` (by its new process)."""
    client = redis.Redis.from_url(up.redis_url)  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            values = [client.get(f"pdmesh:{DEPLOYMENT}:instance:{i}") for i in instance_ids]
            fresh = [v is not None and json.loads(v)["updated_ms"] > since_ms for v in values]
            if all(fresh) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        client.close()
    assert all(fresh), dict(zip(instance_ids, values, strict=True))


def test_secrets_travel_in_the_environment_not_in_argv(up: Up) -> None:
    assert ":" in up.redis_url.split("@")[0][len("redis://") :]  # type: ignore[attr-defined]
    password = up.redis_url.split("@")[0].rsplit(":", 1)[1]  # type: ignore[attr-defined]
    assert len(up.token) >= 32  # type: ignore[attr-defined]
    for pid in descendants(up.process.pid):
        cmdline = " ".join(argv_of(pid))
        assert password not in cmdline and up.token not in cmdline  # type: ignore[attr-defined]
    assert not any(password in line for line in up.lines)
    assert any("redis://***@" in line for line in up.lines)


def test_a_killed_dep_rank_restarts_its_whole_instance(up: Up) -> None:
    complete(up)
    instance = up.pid("decode-0")
    ranks = sorted(descendants(instance))
    assert len(ranks) == 2
    mark, killed_ms = len(up.lines), int(time.time() * 1000)
    os.kill(ranks[1], signal.SIGKILL)
    up.wait_line("decode-0 exited (code 1); restart 1 in 0.5 s", 30, mark)
    up.wait_line("decode-0 is back (SERVING, restart 1)", 120, mark)
    assert up.pid("decode-0") != instance and not alive(ranks[0])
    registered_since(up, ["decode-0-r0", "decode-0-r1"], killed_ms, 15)
    complete(up)
    log = (up.log_dir / "decode-0.log").read_text()  # type: ignore[attr-defined]
    assert "DEP group broke" in log and "Traceback" not in log


def test_a_killed_process_restarts_with_the_same_id(up: Up) -> None:
    prefill = up.pid("prefill-0")
    mark, killed_ms = len(up.lines), int(time.time() * 1000)
    os.kill(prefill, signal.SIGKILL)
    up.wait_line("prefill-0 exited (code -9); restart 1 in 0.5 s", 30, mark)
    up.wait_line("prefill-0 is back (SERVING, restart 1)", 90, mark)
    assert up.pid("prefill-0") != prefill
    registered_since(up, ["prefill-0"], killed_ms, 15)
    # the restarted rank gets traffic within a couple of heartbeats (gRPC's reconnect back-off,
    # two minutes at most by default, is capped at two seconds)
    deadline = time.monotonic() + 5
    while True:
        complete(up)
        if prefill_bytes_sent(up) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert prefill_bytes_sent(up) > 0, "the restarted prefill rank got no traffic"


def test_a_killed_redis_comes_back_on_its_port_with_its_password(up: Up) -> None:
    url = up.redis_url  # type: ignore[attr-defined]
    old = up.redis_pid()
    mark = len(up.lines)
    os.kill(old, signal.SIGKILL)
    up.wait_line("redis is back (SERVING, restart 1)", 30, mark)
    assert up.redis_pid() != old
    host, port = url.rsplit("@", 1)[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64).startswith(b"-NOAUTH")
    client = redis.Redis.from_url(url)
    try:
        assert client.ping()
        deadline = time.monotonic() + 10  # written again once Redis is back
        while not read_restarts_sync(client, DEPLOYMENT) and time.monotonic() < deadline:
            time.sleep(0.2)
        records = read_restarts_sync(client, DEPLOYMENT)
    finally:
        client.close()
    assert records["redis"]["restarts"] == 1 and records["redis"]["last_exit_code"] == -9
    assert records["decode-0"]["restarts"] == 1 and records["prefill-0"]["restarts"] == 1
    # the services re-published themselves (registry entries, NIXL agents): the gateway shows the
    # restarts, and a request still takes the disaggregated path (prefill pushes KV to decode)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        view = httpx.get(f"{up.http}/mesh", timeout=10).json()  # type: ignore[attr-defined]
        ids = {i["instance_id"] for i in view["instances"]}
        if {"prefill-0", "decode-0-r0", "decode-0-r1", "kvstore-0"} <= ids and view["restarts"]:
            break
        time.sleep(0.3)
    assert view["restarts"]["redis"]["restarts"] == 1, view
    sent = prefill_bytes_sent(up)
    complete(up)
    assert prefill_bytes_sent(up) > sent, "the prefill rank was bypassed after the Redis restart"


def prefill_bytes_sent(up: Up) -> int:
    """KV bytes prefill-0 pushed to decode ranks so far (its Status, with the mesh token)."""
    import grpc

    from pdmesh_proto.common.v1 import common_pb2
    from pdmesh_proto.prefill.v1 import prefill_pb2_grpc
    from pdmesh_service.grpc_server import MESH_TOKEN_METADATA

    view = httpx.get(f"{up.http}/mesh", timeout=10).json()  # type: ignore[attr-defined]
    address = next(i["address"] for i in view["instances"] if i["instance_id"] == "prefill-0")
    with grpc.insecure_channel(address) as channel:
        status = prefill_pb2_grpc.PrefillStub(channel).Status(
            common_pb2.StatusRequest(),
            timeout=10,
            metadata=((MESH_TOKEN_METADATA, up.token),),  # type: ignore[attr-defined]
        )
    return int(status.kv_bytes_sent)


def test_kill_9_of_the_launcher_leaves_no_process(up: Up) -> None:
    started = descendants(up.process.pid)
    ranks = descendants(up.pid("decode-0"))
    redis_pid = up.redis_pid()
    assert len(ranks) == 2 and redis_pid in started and ranks <= started
    host, port = up.redis_url.rsplit("@", 1)[1].split("/")[0].split(":")  # type: ignore[attr-defined]
    up.process.kill()
    up.process.wait(10)
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [(pid, argv_of(pid)[:4]) for pid in started if alive(pid)]
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass
