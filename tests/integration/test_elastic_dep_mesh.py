"""Elastic DEP end to end: a DEP4 decode instance (`--dep-elastic`) loses one rank to SIGKILL under
16 open streams.

The survivors re-form their gloo group without it and keep decoding in place; the dead rank's
streams migrate through the gateway; every stream ends with the offline engine's greedy text (0
lost, 0 wrong). Measured and printed: each stream's longest gap between two tokens around the kill
(the survivors' pause), and the tokens per second of all streams before and after the loss. The
supervisor restarts the rank alone; it rejoins and every rank reports dp_size 4 again; requests
after the rejoin are still exact.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from meshlib import WORKER_ARGS, block_size_of, http_url, start_mesh, worker_status

from pdmesh.launcher import Mesh

NUM_STREAMS, MAX_TOKENS, VICTIM = 16, 160, 2
KILL_AFTER_TOKENS = 40  # every stream has this many tokens when the rank is killed


def prompt(i: int) -> str:
    return f"Request {i}: the numbers {', '.join(str(i * 7 + j) for j in range(i % 5 + 2))} and"


@pytest.fixture(scope="module")
def mesh(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    mesh = start_mesh(
        tiny_model,
        tmp_path_factory.mktemp("logs-elastic"),
        "test-elastic-dep",
        num_prefill=1,
        num_decode=1,
        mode="disagg",
        decode_dep=4,
        worker_args=(*WORKER_ARGS, "--dep-elastic"),
    )
    try:
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture(scope="module")
def offline(mesh: Mesh) -> dict[int, str]:
    from pdmesh_engine import LLM, SamplingParams

    llm = LLM(mesh.options.model_dir, num_blocks=512, block_size=block_size_of(mesh))
    outs = llm.generate(
        [prompt(i) for i in range(NUM_STREAMS)],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    return {i: o.text for i, o in enumerate(outs)}


def rank_pid(mesh: Mesh, rank: int) -> int:
    """The pid of decode rank `rank` (a child of the instance's supervisor process)."""
    parent = mesh.processes["decode-0"].pid
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if int(stat[1]) == parent and "--dep-rank" in argv:
            if argv[argv.index("--dep-rank") + 1] == str(rank):
                return int(entry.name)
    raise AssertionError(f"no decode rank {rank} under pid {parent}")


def stream(mesh: Mesh, i: int, out: dict) -> None:
    """One streaming completion; its text and every token's arrival time."""
    body = dict(
        model=mesh.options.model_dir.name,
        prompt=prompt(i),
        max_tokens=MAX_TOKENS,
        temperature=0,
        ignore_eos=True,
        stream=True,
    )
    text: list[str] = []
    times: list[float] = []
    out[i] = (None, times)  # live: the arrival times grow while it streams
    try:
        url = f"{http_url(mesh)}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=180) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    text.append(chunk["choices"][0]["text"])
                    times.append(time.monotonic())
        out[i] = ("".join(text), times)
    except Exception as e:  # noqa: BLE001 - a lost stream is what the test counts
        out[i] = (f"ERROR {type(e).__name__}: {e}", times)


def run_streams(mesh: Mesh, kill: bool) -> tuple[dict, float | None]:
    out: dict = {}
    threads = [threading.Thread(target=stream, args=(mesh, i, out)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    killed_at = None
    if kill:
        pid = rank_pid(mesh, VICTIM)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
            len(out.get(i, ("", []))[1]) >= KILL_AFTER_TOKENS for i in range(NUM_STREAMS)
        ):
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
    for t in threads:
        t.join(200)
    return out, killed_at


def _progress(out: dict) -> dict[int, list[float]]:
    return {i: times for i, (_, times) in out.items()}


def test_a_killed_rank_loses_no_stream_and_rejoins(mesh: Mesh, offline: dict) -> None:
    # streams only decode on ranks that have joined: the first batch warms every rank
    warm, _ = run_streams(mesh, kill=False)
    assert {i: text for i, (text, _) in warm.items()} == offline
    out, killed_at = run_streams(mesh, kill=True)
    assert killed_at is not None
    wrong = {i: text[:80] for i, (text, _) in out.items() if text != offline[i]}
    assert len(out) == NUM_STREAMS and not wrong, wrong  # 0 lost, 0 wrong
    times = _progress(out)
    t0 = min(t[0] for t in times.values())
    spans = [(sum(x < killed_at for x in t), round(t[-1] - t0, 2)) for t in times.values()]
    print(f"\nkill at {killed_at - t0:.2f}s; per stream (tokens before it, last token at): {spans}")
    gaps = sorted(
        max((b - a for a, b in zip(t, t[1:], strict=False) if b > killed_at - 0.5), default=0.0)
        for t in times.values()
    )
    before = sum(1 for t in times.values() for x in t if killed_at - 2.0 <= x < killed_at) / 2.0
    after_start = killed_at + max(gaps[: NUM_STREAMS * 3 // 4])
    after_end = min(after_start + 2.0, max(x for t in times.values() for x in t))
    after = sum(1 for t in times.values() for x in t if after_start <= x < after_end) / max(
        after_end - after_start, 1e-3
    )
    print(
        f"\nelastic DEP4 -> DEP3: longest inter-token gap per stream around the kill "
        f"(s, sorted): {[round(g, 3) for g in gaps]}\n"
        f"survivors' pause (3/4 of the streams, max): {max(gaps[: NUM_STREAMS * 3 // 4]):.3f} s; "
        f"throughput before {before:.0f} tok/s, after {after:.0f} tok/s"
    )
    # the survivors' streams (at least the 12 fastest of 16 over 4 ranks) pause a few seconds
    assert max(gaps[: NUM_STREAMS * 3 // 4]) < 5.0
    # the supervisor restarts the rank alone; it rejoins: every rank in a group of 4 again
    deadline = time.monotonic() + 120
    sizes: list[int] = []
    while time.monotonic() < deadline:
        try:
            sizes = [s.dp_size for s in worker_status(mesh, "decode")]
        except Exception:  # noqa: BLE001 - the restarted rank is not serving yet
            sizes = []
        if sizes == [4, 4, 4, 4]:
            break
        time.sleep(0.5)
    assert sizes == [4, 4, 4, 4], sizes
    listed: list[int] = []
    while time.monotonic() < deadline + 30:  # the registry learns it at the next heartbeats
        rows = httpx.get(f"{http_url(mesh)}/mesh", timeout=10).json()["instances"]
        listed = sorted(r["dp_size"] for r in rows if r["role"] == "decode")
        if listed == [4, 4, 4, 4]:
            break
        time.sleep(0.5)
    assert listed == [4, 4, 4, 4], listed
    again, _ = run_streams(mesh, kill=False)
    assert {i: text for i, (text, _) in again.items()} == offline
