"""KV events and the prefix index for real: the kvstore served over gRPC on 127.0.0.1 with an
embedded Redis, `KVStoreClient`, and a rank's `KVEventPublisher` over a real `KVCacheManager`.

The publisher's engine loop is a stand-in that runs each command inline (these tests run no engine
thread); the kvstore, Redis and gRPC are real. A kvstore killed and started again on the same port
comes back empty and refills from the rank's snapshot.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from pdmesh_engine.block_hash import hash_full_blocks
from pdmesh_engine.kv_cache import KVCacheManager
from pdmesh_kvstore import server as kvstore_server
from pdmesh_kvstore.prefix_index import PrefixIndex
from pdmesh_kvstore.server import sweep_index
from pdmesh_service.errors import Unavailable
from pdmesh_service.kvstore_client import KVStoreClient
from pdmesh_service.redis_server import EmbeddedRedis, free_port
from pdmesh_service.registry import InstanceInfo, Registry, connect
from pdmesh_service.worker.kv_events import KVBatch, KVEventPublisher, messages

BS = 4
HEARTBEAT_S = 0.2


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as redis:
        yield redis.url


class Kvstore:
    """A kvstore process body (`serve`) in this event loop, on a fixed port, startable again."""

    def __init__(self, redis_url: str, deployment: str) -> None:
        self.port = free_port()
        parser = argparse.ArgumentParser()
        kvstore_server.add_arguments(parser)
        self.config = kvstore_server.config_from_args(
            parser.parse_args(
                [
                    *("--host", "127.0.0.1", "--port", str(self.port)),
                    *("--redis-url", redis_url, "--deployment", deployment),
                    *("--heartbeat-s", str(HEARTBEAT_S)),
                ]
            )
        )
        self.task: asyncio.Future[None] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        ready = asyncio.Event()
        self.task = asyncio.ensure_future(kvstore_server.serve(self.config, ready))
        await asyncio.wait_for(ready.wait(), 20)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None


def _run(redis_url: str, body: Callable[..., Awaitable[Any]]) -> Any:
    """Start a kvstore under a fresh deployment and run `body(kvstore, client, registry)`."""

    async def main() -> Any:
        kvstore = Kvstore(redis_url, f"t-{uuid.uuid4().hex[:8]}")
        await kvstore.start()
        redis = connect(redis_url)
        client = KVStoreClient(kvstore.address, timeout_s=2.0)
        try:
            return await body(kvstore, client, Registry(redis, kvstore.config.common.deployment))
        finally:
            await client.close()
            await kvstore.stop()
            await redis.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


async def _register(registry: Registry, rank_id: str, ttl_s: float = 60.0) -> None:
    await registry.publish(InstanceInfo(rank_id, "prefill", "127.0.0.1:1", ready=True), ttl_s)


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def chain(n: int, start: int = 0) -> list[bytes]:
    return hash_full_blocks(list(range(start, start + n)), 1)


def test_batches_in_sequence_gaps_ask_for_resync_and_lookups_answer(redis_url: str) -> None:
    hashes = chain(10)

    async def body(kvstore: Kvstore, client: KVStoreClient, registry: Registry) -> None:
        await _register(registry, "p-0")
        await _register(registry, "p-1")
        assert await client.publish_kv_events("p-0", 1, hashes[:4]) is True  # unknown rank
        assert await client.longest_prefix(hashes) == {}
        assert await client.publish_kv_events("p-0", 5, hashes[:2], snapshot=True) is False
        assert await client.publish_kv_events("p-0", 6, hashes[2:6], []) is False
        assert await client.publish_kv_events("p-1", 1, hashes[:3], snapshot=True) is False
        assert await client.longest_prefix(hashes) == {"p-0": 6, "p-1": 3}
        assert await client.publish_kv_events("p-0", 8, [], hashes[:1]) is True  # 7 was lost
        assert await client.publish_kv_events("p-0", 7, [], [hashes[4]]) is False
        assert await client.longest_prefix(hashes) == {"p-0": 4, "p-1": 3}
        assert await client.longest_prefix([]) == {}

    _run(redis_url, body)


def test_ranks_gone_from_the_registry_leave_the_index(redis_url: str) -> None:
    hashes = chain(3)

    async def body(kvstore: Kvstore, client: KVStoreClient, registry: Registry) -> None:
        await _register(registry, "live")
        await _register(registry, "dying", ttl_s=5 * HEARTBEAT_S)  # stops heartbeating now
        for rank_id in ("live", "dying", "never-registered"):
            await client.publish_kv_events(rank_id, 1, hashes, snapshot=True)
        assert set(await client.longest_prefix(hashes)) == {"live", "dying", "never-registered"}

        async def only_live() -> bool:
            return set(await client.longest_prefix(hashes)) == {"live"}

        await _until(only_live, timeout_s=5 * HEARTBEAT_S + 3.0)
        # a dropped rank's next batch is refused: it sends a snapshot
        assert await client.publish_kv_events("dying", 2, hashes[:1]) is True

    _run(redis_url, body)


def test_sweep_index_drops_exactly_the_unregistered_ranks(redis_url: str) -> None:
    async def body(kvstore: Kvstore, client: KVStoreClient, registry: Registry) -> None:
        await _register(registry, "a-r0")
        index = PrefixIndex()
        index.snapshot("a-r0", 1, chain(2))
        index.snapshot("a-r1", 1, chain(2))
        assert await sweep_index(index, registry) == {"a-r1"}
        assert index.ranks() == ["a-r0"]

    _run(redis_url, body)


class InlineLoop:
    """Stands in for `EngineLoop` (no engine thread here): commands run at once, in this thread."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.engine = SimpleNamespace(kv=kv)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        future.set_result(fn(*args))
        return future


def _admit(kv: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    blocks = kv.allocate(request_id, len(tokens), kv.find_cached_prefix(request_id, tokens))
    assert blocks is not None
    kv.cache_blocks(request_id, tokens, len(tokens))
    kv.free(request_id)


def test_publisher_fills_the_index_and_refills_it_after_a_kvstore_restart(redis_url: str) -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    first, second = list(range(5 * BS + 1)), list(range(1000, 1000 + 3 * BS))
    first_hashes, second_hashes = hash_full_blocks(first, BS), hash_full_blocks(second, BS)

    async def body(kvstore: Kvstore, client: KVStoreClient, registry: Registry) -> None:
        await _register(registry, "prefill-1")
        publisher = KVEventPublisher(
            InlineLoop(kv),  # type: ignore[arg-type]
            client,
            "prefill-1",
            interval_s=0.05,
            keepalive_s=0.2,
        )
        task = asyncio.ensure_future(publisher.run())
        try:
            _admit(kv, "a", first)

            async def first_indexed() -> bool:
                return await client.longest_prefix(first_hashes) == {"prefill-1": 5}

            await _until(first_indexed)
            await kvstore.stop()
            _admit(kv, "b", second)  # while the kvstore is down: these events are lost

            async def failed() -> bool:
                return publisher.is_failing

            await _until(failed)
            await kvstore.start()  # empty: refills from the rank's snapshot

            async def both_indexed() -> bool:
                try:  # this client's channel reconnects to the new kvstore too
                    found = [await client.longest_prefix(h) for h in (first_hashes, second_hashes)]
                except Unavailable:
                    return False
                return found == [{"prefill-1": 5}, {"prefill-1": 3}]

            await _until(both_indexed)
            assert not publisher.is_failing
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    _run(redis_url, body)


def test_a_large_snapshot_goes_in_numbered_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdmesh_service.worker import kv_events

    monkeypatch.setattr(kv_events, "SNAPSHOT_CHUNK", 2)
    hashes = chain(5)
    sent = messages(KVBatch(hashes, [], True), 7)
    assert sent == [
        (7, hashes[:2], [], True),
        (8, hashes[2:4], [], False),
        (9, hashes[4:], [], False),
    ]
    assert messages(KVBatch([], [], True), 3) == [(3, [], [], True)]
    assert messages(KVBatch(hashes[:1], hashes[1:2], False), 4) == [
        (4, hashes[:1], hashes[1:2], False)
    ]


def test_publisher_answers_a_resync_with_a_snapshot(redis_url: str) -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    first, second = list(range(2 * BS)), list(range(500, 500 + 3 * BS))
    first_hashes, second_hashes = hash_full_blocks(first, BS), hash_full_blocks(second, BS)

    async def body(kvstore: Kvstore, client: KVStoreClient, registry: Registry) -> None:
        await _register(registry, "decode-1")
        loop = InlineLoop(kv)
        publisher = KVEventPublisher(loop, client, "decode-1", keepalive_s=60.0)  # type: ignore[arg-type]
        _admit(kv, "a", first)
        assert await publisher.publish_once()  # the first send is a snapshot
        assert await publisher.publish_once() is False  # nothing new, keepalive not due
        assert await client.longest_prefix(first_hashes) == {"decode-1": 2}
        # the index lost track of the rank (as after a kvstore restart): its state is another one
        await client.publish_kv_events("decode-1", 1000, [], snapshot=True)
        _admit(kv, "b", second)
        assert await publisher.publish_once() and publisher.needs_snapshot  # refused: resync
        assert await client.longest_prefix(second_hashes) == {}
        assert await publisher.publish_once()  # the snapshot
        assert not publisher.needs_snapshot
        assert await client.longest_prefix(first_hashes) == {"decode-1": 2}
        assert await client.longest_prefix(second_hashes) == {"decode-1": 3}

    _run(redis_url, body)
