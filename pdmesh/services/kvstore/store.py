"""The kvstore's Redis adapter: NIXL agent metadata and one hand-off hash per request.

Keys (prefix `pdmesh:{deployment}`):
    agent:{name}          hash {metadata (bytes), instance_id, updated_ms}; kept until re-registered
    handoff:{request_id}  hash of `core.Handoff.to_fields()`; TTL = the lease (PX lease_ms, renewed on
                          every change) while RESERVED/TRANSFERRING/READY, then `retention_ms` once final,
                          so a hand-off nobody finishes disappears by itself and a finished one can still
                          be read for a while

Changes are compare-and-set: read, `core.advance` (the legality check), then a Lua script writes only
if the state is still the one read (sound because the state graph has no cycle); a lost race re-reads.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import redis.asyncio as aioredis

from pdmesh.services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from pdmesh.services.common.registry import namespace
from pdmesh.services.kvstore import core
from pdmesh.services.kvstore.core import Handoff, HandoffState

# KEYS[1] hand-off; ARGV[1] ttl ms; ARGV[2..] field, value, ... → 1 created, 0 exists.
_OPEN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
# KEYS[1] hand-off; ARGV[1] expected state; ARGV[2] ttl ms; ARGV[3..] field, value, ... → 1 set, 0 raced, -1 gone.
_CAS = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
_CAS_ATTEMPTS = 4            # > the longest path in the state graph


def _flat(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]


class KVStore:
    """Async store over one Redis client (the caller owns and closes it)."""

    def __init__(self, client: aioredis.Redis, deployment: str = "default", retention_ms: int = 60_000,
                 clock: Callable[[], float] = time.time) -> None:
        if retention_ms < 1:
            raise ValueError(f"retention_ms must be >= 1, got {retention_ms}")
        self.client, self.prefix = client, namespace(deployment)
        self.retention_ms, self.clock = retention_ms, clock
        self._open = client.register_script(_OPEN)
        self._cas = client.register_script(_CAS)

    def agent_key(self, name: str) -> str:
        return f"{self.prefix}:agent:{name}"

    def handoff_key(self, request_id: str) -> str:
        return f"{self.prefix}:handoff:{request_id}"

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    # ----- agents -----
    async def put_agent(self, name: str, metadata: bytes, instance_id: str) -> None:
        if not name or not metadata:
            raise InvalidArgument("an agent needs a name and metadata")
        await self.client.hset(self.agent_key(name), mapping={
            "metadata": metadata, "instance_id": instance_id, "updated_ms": str(self._now_ms())})

    async def get_agent(self, name: str) -> tuple[bytes, str]:
        """(metadata, instance_id); NotFound if never registered."""
        fields = await self.client.hgetall(self.agent_key(name))
        if not fields:
            raise NotFound(f"no NIXL agent named {name!r}")
        return fields[b"metadata"], fields.get(b"instance_id", b"").decode()

    # ----- hand-offs -----
    async def open_handoff(self, request_id: str, decode_instance: str, num_blocks: int, lease_ms: int) -> Handoff:
        """A new RESERVED record; FailedPrecondition if one exists for this request (live or retained)."""
        handoff = core.open_handoff(request_id, decode_instance, num_blocks, lease_ms, self._now_ms())
        created = await self._open(keys=[self.handoff_key(request_id)],
                                   args=[handoff.lease_ms, *_flat(handoff.to_fields())])
        if not created:
            raise FailedPrecondition(f"a hand-off for request {request_id!r} already exists")
        return handoff

    async def get_handoff(self, request_id: str) -> Handoff:
        fields = await self.client.hgetall(self.handoff_key(request_id))
        if not fields:
            raise NotFound(f"no hand-off for request {request_id!r} (never opened, or its lease ran out)")
        return Handoff.from_fields(fields)

    async def update_handoff(self, request_id: str, state: HandoffState, prefill_instance: str = "") -> Handoff:
        """Move to `state` atomically; FailedPrecondition if illegal from the current state, NotFound if gone."""
        key = self.handoff_key(request_id)
        for _ in range(_CAS_ATTEMPTS):
            current = await self.get_handoff(request_id)
            updated = core.advance(current, state, prefill_instance, self._now_ms())
            result = await self._cas(keys=[key], args=[
                current.state.name, core.ttl_ms(updated, self.retention_ms), *_flat(updated.to_fields())])
            if result == 1:
                return updated
            if result == -1:
                raise NotFound(f"the hand-off of request {request_id!r} is gone (its lease ran out)")
        raise FailedPrecondition(f"the hand-off of request {request_id!r} kept changing; retry")
