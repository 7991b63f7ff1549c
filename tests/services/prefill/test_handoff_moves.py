"""`kvstore_client.move_handoff` (the one compare-and-set loop on hand-off records) against a real
kvstore server over gRPC and a real (embedded) Redis: typed outcomes, races, tenacity's retries on
an unreachable kvstore that comes up later or never, and answers lost in transit.

Each test starts a kvstore under a fresh deployment namespace and talks to it with `KVStoreClient`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from pdmesh_kvstore import server as kvstore_server
from pdmesh_kvstore.store import KVStore
from pdmesh_service.errors import DeadlineExceeded
from pdmesh_service.handoff import (
    AlreadyFinal,
    Elsewhere,
    Handoff,
    HandoffState,
    Missing,
    Moved,
    Unknown,
    may_be_written,
)
from pdmesh_service.kvstore_client import (
    LIVE,
    KVStoreClient,
    RetryPolicy,
    end_handoff,
    expire_handoff,
    move_handoff,
)
from pdmesh_service.redis_server import EmbeddedRedis, free_port
from pdmesh_service.registry import Registry, connect

S = HandoffState
FAST = RetryPolicy(budget_s=0.5, initial_wait_s=0.01, max_wait_s=0.1)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as redis:
        yield redis.url


@contextlib.asynccontextmanager
async def kvstore(redis_url: str, deployment: str, port: int = 0) -> AsyncIterator[str]:
    """A kvstore server on 127.0.0.1 (`port`; 0: any): its address while the block runs."""
    parser = argparse.ArgumentParser()
    kvstore_server.add_arguments(parser)
    config = kvstore_server.config_from_args(
        parser.parse_args(
            [
                "--redis-url",
                redis_url,
                "--deployment",
                deployment,
                "--port",
                str(port),
                "--heartbeat-s",
                "0.2",
            ]
        )
    )
    ready = asyncio.Event()
    task = asyncio.ensure_future(kvstore_server.serve(config, ready))
    try:
        await asyncio.wait_for(ready.wait(), 20)
        redis = connect(redis_url)
        try:
            [info] = await Registry(redis, deployment).instances("kvstore")
        finally:
            await redis.aclose()
        yield info.address
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def run(redis_url: str, body: Any) -> Any:
    """`body(client, store)` against a fresh kvstore; `store` opens records in Redis directly."""
    deployment = f"t-{uuid.uuid4().hex[:8]}"

    async def main() -> Any:
        redis = connect(redis_url)
        async with kvstore(redis_url, deployment) as address:
            client = KVStoreClient(address)
            try:
                return await body(client, KVStore(redis, deployment))
            finally:
                await client.close()
                await redis.aclose()

    return asyncio.run(asyncio.wait_for(main(), 60))


async def opened(store: KVStore, request_id: str, *path: S) -> None:
    """A record opened RESERVED, then moved along `path`."""
    await store.open_handoff(request_id, "decode-0", 2, 10_000)
    for state in path:
        claimer = "prefill-9" if state == S.TRANSFERRING else ""
        await store.update_handoff(request_id, state, claimer)


def test_claim_moves_reserved_once_and_records_the_prefill_rank(redis_url) -> None:
    async def body(client: KVStoreClient, store: KVStore) -> tuple[Any, Any, Handoff]:
        await opened(store, "claim")
        first = await move_handoff(client, "claim", S.TRANSFERRING, (S.RESERVED,), "prefill-0")
        second = await move_handoff(client, "claim", S.TRANSFERRING, (S.RESERVED,), "prefill-1")
        return first, second, await client.get_handoff("claim")

    first, second, record = run(redis_url, body)
    assert first == Moved(S.RESERVED) and second == Elsewhere(S.TRANSFERRING)
    assert (record.state, record.prefill_instance) == (S.TRANSFERRING, "prefill-0")


def test_end_reports_where_it_ended_from_and_leaves_final_records_alone(redis_url) -> None:
    paths = {
        "from-reserved": (),
        "from-transferring": (S.TRANSFERRING,),
        "from-ready": (S.TRANSFERRING, S.READY),
        "consumed": (S.READY, S.CONSUMED),
        "expired": (S.EXPIRED,),
    }

    async def body(client: KVStoreClient, store: KVStore) -> dict[str, tuple[Any, S | None]]:
        for request_id, path in paths.items():
            await opened(store, request_id, *path)
        found = {}
        for rid in paths:
            ended_from = await end_handoff(client, rid, S.CANCELLED)
            found[rid] = (ended_from, (await store.get_handoff(rid)).state)
        found["never-opened"] = (await end_handoff(client, "never-opened", S.CANCELLED), None)
        return found

    found = run(redis_url, body)
    assert found == {
        "from-reserved": (S.RESERVED, S.CANCELLED),
        "from-transferring": (S.TRANSFERRING, S.CANCELLED),
        "from-ready": (S.READY, S.CANCELLED),
        "consumed": (S.CONSUMED, S.CONSUMED),
        "expired": (S.EXPIRED, S.EXPIRED),
        "never-opened": (None, None),
    }
    # only a record ended from TRANSFERRING (or not known) may still receive a WRITE
    assert {rid for rid, (ended_from, _) in found.items() if may_be_written(ended_from)} == {
        "from-transferring",
        "never-opened",
    }


def test_expire_only_from_reserved(redis_url) -> None:
    async def body(client: KVStoreClient, store: KVStore) -> list[tuple[S | None, S]]:
        await opened(store, "unclaimed")
        await opened(store, "claimed", S.TRANSFERRING)
        return [
            (await expire_handoff(client, rid), (await store.get_handoff(rid)).state)
            for rid in ("unclaimed", "claimed")
        ]

    assert run(redis_url, body) == [(S.RESERVED, S.EXPIRED), (S.TRANSFERRING, S.TRANSFERRING)]


def test_moves_follow_the_expected_states_in_order_and_report_missing(redis_url) -> None:
    async def body(client: KVStoreClient, store: KVStore) -> list[Any]:
        await opened(store, "ours", S.TRANSFERRING)
        await opened(store, "landed", S.TRANSFERRING, S.READY)
        return [
            await move_handoff(client, "ours", S.CANCELLED, (S.RESERVED, S.TRANSFERRING)),
            await move_handoff(client, "landed", S.CANCELLED, (S.RESERVED, S.TRANSFERRING)),
            await move_handoff(client, "gone", S.CANCELLED, (S.RESERVED,)),
        ]

    assert run(redis_url, body) == [Moved(S.TRANSFERRING), Elsewhere(S.READY), Missing()]
    with pytest.raises(ValueError, match="live states"):
        asyncio.run(move_handoff(None, "r", S.CANCELLED, (S.CONSUMED,)))  # type: ignore[arg-type]


def test_racing_ends_move_a_record_exactly_once(redis_url) -> None:
    async def body(client: KVStoreClient, store: KVStore) -> list[list[Any]]:
        rounds = []
        for i in range(6):
            rid = f"race-{i}"
            await opened(store, rid, S.TRANSFERRING)
            rounds.append(
                list(
                    await asyncio.gather(
                        move_handoff(client, rid, S.CANCELLED, LIVE),
                        move_handoff(client, rid, S.EXPIRED, LIVE),
                    )
                )
            )
        return rounds

    for outcomes in run(redis_url, body):
        moved = [o for o in outcomes if isinstance(o, Moved)]
        assert len(moved) == 1 and moved[0] == Moved(S.TRANSFERRING), outcomes
        [other] = [o for o in outcomes if not isinstance(o, Moved)]
        assert isinstance(other, AlreadyFinal) and other.state in (S.CANCELLED, S.EXPIRED)


def test_transient_errors_are_retried_until_the_kvstore_comes_up(redis_url) -> None:
    """The client first finds nothing listening (UNAVAILABLE); tenacity retries until served."""
    deployment, port = f"t-{uuid.uuid4().hex[:8]}", free_port()

    async def main() -> tuple[Any, float, S]:
        redis = connect(redis_url)
        store = KVStore(redis, deployment)
        await opened(store, "late")
        client = KVStoreClient(f"127.0.0.1:{port}", timeout_s=1.0)

        async def start_later() -> Any:
            await asyncio.sleep(0.5)
            async with kvstore(redis_url, deployment, port):
                await asyncio.sleep(30)

        server = asyncio.ensure_future(start_later())
        started = time.monotonic()
        try:
            patient = RetryPolicy(budget_s=20.0, initial_wait_s=0.05, max_wait_s=0.5)
            outcome = await move_handoff(client, "late", S.CANCELLED, (S.RESERVED,), policy=patient)
            return outcome, time.monotonic() - started, (await store.get_handoff("late")).state
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
            await client.close()
            await redis.aclose()

    outcome, seconds, state = asyncio.run(asyncio.wait_for(main(), 60))
    assert outcome == Moved(S.RESERVED) and state == S.CANCELLED
    assert seconds >= 0.5  # it did wait for the server


def test_an_unreachable_kvstore_is_unknown_after_the_budget() -> None:
    async def main() -> tuple[Any, S | None, float]:
        client = KVStoreClient(f"127.0.0.1:{free_port()}", timeout_s=0.5)
        started = time.monotonic()
        try:
            outcome = await move_handoff(client, "r", S.CANCELLED, LIVE, policy=FAST)
            ended_from = await end_handoff(client, "r", S.CANCELLED, policy=FAST)
            return outcome, ended_from, time.monotonic() - started
        finally:
            await client.close()

    outcome, ended_from, seconds = asyncio.run(main())
    assert isinstance(outcome, Unknown) and "Unavailable" in outcome.reason
    assert ended_from is None and may_be_written(ended_from)  # the safe answer: quarantine
    assert 2 * FAST.budget_s <= seconds < 2 * FAST.budget_s + 5


class LostFirstAnswer:
    """The real client, except that the first update's answer is lost after it applied."""

    def __init__(self, client: KVStoreClient) -> None:
        self.client, self.num_lost = client, 0

    async def update_handoff(
        self, request_id: str, state: S, prefill_instance: str = "", expected: S | None = None
    ) -> Handoff:
        record = await self.client.update_handoff(request_id, state, prefill_instance, expected)
        if self.num_lost == 0:
            self.num_lost += 1
            raise DeadlineExceeded("kvstore: the answer was lost")
        return record

    async def get_handoff(self, request_id: str) -> Handoff:
        return await self.client.get_handoff(request_id)


def test_a_lost_answer_is_never_read_as_someone_elses_move(redis_url) -> None:
    async def body(client: KVStoreClient, store: KVStore) -> list[Any]:
        await opened(store, "cancel-lost", S.TRANSFERRING)
        await opened(store, "claim-lost")
        return [
            await end_handoff(LostFirstAnswer(client), "cancel-lost", S.CANCELLED, policy=FAST),
            await move_handoff(
                LostFirstAnswer(client),
                "claim-lost",
                S.TRANSFERRING,
                (S.RESERVED,),
                "prefill-0",
                policy=FAST,
            ),
            (await store.get_handoff("cancel-lost")).state,
        ]

    ended_from, claim, state = run(redis_url, body)
    # this call ended it, from TRANSFERRING: reading "already CANCELLED" would free the blocks
    assert state == S.CANCELLED and ended_from is None and may_be_written(ended_from)
    assert claim == Moved(S.RESERVED)  # the record names this prefill rank: it is ours
