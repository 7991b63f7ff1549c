"""The NIXL agent for real, across two processes on loopback: one WRITE lands exactly the chosen
blocks.

Process B ("decode") owns a pool filled with a marker, publishes its metadata and layout through a
pipe, and waits for the notification; process A (this one, "prefill") writes chosen blocks of its
random pool into non-contiguous blocks of B's. B sends back the request ids it was told and its
whole pool.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import time

import pytest
import torch

from pdmesh_engine.transfer.layout import PoolLayout

SHAPE = (3, 16, 4, 8)  # [L, N, B, D] float32: 128-byte blocks
MARKER = -7.0


def _receiver(conn, name: str, timeout_s: float) -> None:
    """Child process: pool of MARKER; send (metadata, layout); wait for one notification; send (ids,
    pool)."""
    from pdmesh_engine.transfer.agent import KVTransferAgent

    pool = torch.full(SHAPE, MARKER)
    agent = KVTransferAgent(name, pool)
    conn.send((agent.metadata(), agent.layout))
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not got and time.monotonic() < deadline:
        got = agent.notifications()
        time.sleep(0.001)
    conn.send((got, pool.numpy().copy()))
    conn.recv()  # stay alive until the sender is done
    agent.close()


@pytest.fixture
def receiver():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_receiver, args=(child, "test-decode", 30.0), daemon=True)
    process.start()
    try:
        assert parent.poll(60), "receiver did not start"
        yield parent, *parent.recv()
        with contextlib.suppress(OSError):
            parent.send("bye")
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


def test_one_write_moves_exactly_the_chosen_blocks_of_every_layer(receiver):
    from pdmesh_engine.transfer.agent import KVTransferAgent

    conn, metadata, remote_layout = receiver
    source = torch.randn(SHAPE)
    agent = KVTransferAgent("test-prefill", source)
    try:
        agent.connect("test-decode", metadata)
        agent.connect("test-decode", metadata)  # idempotent
        local_ids, remote_ids = [2, 3, 4, 9, 0], [5, 6, 11, 12, 1]
        transfer = agent.write("req-42", local_ids, "test-decode", remote_layout, remote_ids)
        # 3 layers x runs (2→5, 2) (4→11, 1) (9→12, 1) (0→1, 1)
        assert transfer.num_regions == 3 * 4
        assert agent.wait(transfer, timeout_s=20) == "DONE"
        assert conn.poll(30), "receiver never answered"
        ids, pool = conn.recv()
    finally:
        agent.close()
    pool = torch.from_numpy(pool)
    assert ids == ["req-42"]
    assert torch.equal(pool[:, remote_ids], source[:, local_ids])
    untouched = [b for b in range(SHAPE[1]) if b not in remote_ids]
    assert bool((pool[:, untouched] == MARKER).all())
    assert (agent.bytes_sent, agent.num_transfers, agent.num_failures) == (5 * 3 * 128, 1, 0)
    assert transfer.seconds is not None and transfer.seconds > 0


def test_bad_writes_and_connections_are_refused():
    from pdmesh_engine.transfer.agent import KVTransferAgent, TransferError

    agent = KVTransferAgent("test-lonely", torch.zeros(SHAPE), progress_thread=False)
    other = KVTransferAgent("test-other", torch.zeros(SHAPE), progress_thread=False)
    try:
        peer = PoolLayout.of_tensor(torch.zeros(SHAPE))
        with pytest.raises(ValueError, match="not connected"):
            agent.write("r", [0], "nobody", peer, [0])
        with pytest.raises(ValueError, match="2 local blocks but 3 remote"):
            agent.write("r", [0, 1], "nobody", peer, [0, 1, 2])
        with pytest.raises(ValueError, match="block_bytes"):
            agent.write("r", [0], "nobody", PoolLayout.of_tensor(torch.zeros(3, 16, 4, 4)), [0])
        with pytest.raises(ValueError, match="itself"):
            agent.connect("test-lonely", agent.metadata())
        with pytest.raises(ValueError, match="is agent 'test-other', not 'someone-else'"):
            agent.connect("someone-else", other.metadata())
        with pytest.raises(TransferError, match="cannot load"):
            agent.connect("garbage", b"not nixl metadata")
        assert not agent.is_connected("someone-else") and not agent.is_connected("garbage")
        assert agent.notifications() == [] and agent.num_transfers == 0
    finally:
        agent.close()
        other.close()


def test_progress_thread_sleeps_when_idle():
    """nixl's wrapper would make the progress thread spin (~40% of a core); ours waits on UCX
    events."""
    from pdmesh_engine.transfer.agent import KVTransferAgent

    agent = KVTransferAgent("test-idle", torch.zeros(SHAPE))
    try:
        start = time.process_time()
        time.sleep(1.0)
        busy = time.process_time() - start
    finally:
        agent.close()
    assert busy < 0.25, f"{busy:.2f} CPU seconds in 1 s of idling"


def _listening_addresses() -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) of this process's listening TCP
    sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in list(f)[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    found.add(cols[1].rsplit(":", 1)[0])
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_agent_listens_on_loopback_only():
    from pdmesh_engine.transfer.agent import KVTransferAgent

    agent = KVTransferAgent("test-loopback", torch.zeros(SHAPE), progress_thread=False)
    try:
        listening = _listening_addresses()  # UCX may share one listener among a process's agents
    finally:
        agent.close()
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    assert listening and listening <= loopback, listening


def test_kvxfer_quick_bench_reports_positive_figures(tmp_path):
    from pdmesh_bench import kvxfer

    out = tmp_path / "kvxfer.json"
    assert (
        kvxfer.main(["--sizes", "64K,1M", "--repeats", "3", "--warmup", "1", "--json", str(out)])
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["bytes"] for r in report["results"]] == [64 << 10, 1 << 20]
    for row in report["results"]:
        assert row["nixl_gbps"] > 0 and row["memcpy_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["nixl_gbps"] / row["memcpy_gbps"], rel=1e-2)
        assert (
            row["nixl_best_gbps"] >= row["nixl_gbps"]
            and row["memcpy_best_gbps"] >= row["memcpy_gbps"]
        )
    assert report["notes"]
