"""How much of a prompt each rank holds, from the kvstore's prefix index (for `routing`).

Best effort: with no kvstore, no rank that publishes its cache (`InstanceInfo.block_size` 0), or a
lookup that fails or takes longer than `timeout_s`, the answer is empty and the request is routed on
load alone (`pdmesh_gateway_prefix_lookups_total{result}` counts both outcomes). Ranks with another
block size are asked with that size's hashes (one LongestPrefix per block size present).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pdmesh_gateway.metrics import GatewayMetrics
from pdmesh_gateway.router import Router
from pdmesh_gateway.routing import cached_tokens, prompt_block_hashes
from pdmesh_gateway.upstream import WorkerClient
from pdmesh_service import errors
from pdmesh_service.instance import InstanceInfo, Role
from pdmesh_service.logging import get_logger

log = get_logger(__name__)
HASH_OFF_LOOP_BLOCKS = 256  # longer prompts are hashed in a thread, off the event loop


class PrefixLookup:
    def __init__(
        self, router: Router, workers: WorkerClient, metrics: GatewayMetrics, timeout_s: float
    ) -> None:
        self.router, self.workers, self.metrics, self.timeout_s = (
            router,
            workers,
            metrics,
            timeout_s,
        )

    async def cached(
        self,
        prompt_ids: Sequence[int],
        ranks: Sequence[InstanceInfo],
        cache_salt: str | None = None,
    ) -> dict[str, int]:
        """Instance id → prompt tokens its prefix cache holds for a request with `cache_salt`
        (ranks holding none: absent; blocks cached under another salt do not count)."""
        kvstores = self.router.ready(Role.KVSTORE)
        sizes = sorted({r.block_size for r in ranks if r.block_size > 0})
        if not kvstores or not sizes:
            return {}
        found: dict[str, int] = {}
        for size in sizes:
            hashes = await _hashes(prompt_ids, size, cache_salt)
            if not hashes:
                continue
            try:
                matched = await asyncio.wait_for(
                    self.workers.longest_prefix(kvstores[0], hashes, self.timeout_s),
                    self.timeout_s,
                )
            except (errors.MeshError, TimeoutError) as e:
                self.metrics.prefix_lookups.labels("failed").inc()
                log.debug("prefix lookup failed; routing on load", error=str(e))
                continue
            self.metrics.prefix_lookups.labels("ok").inc()
            n = len(prompt_ids)
            for r in ranks:
                if r.block_size == size and matched.get(r.instance_id):
                    found[r.instance_id] = cached_tokens(matched[r.instance_id], size, n)
        return found


async def _hashes(
    prompt_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> list[bytes]:
    if len(prompt_ids) > HASH_OFF_LOOP_BLOCKS * block_size:
        return await asyncio.to_thread(prompt_block_hashes, prompt_ids, block_size, cache_salt)
    return prompt_block_hashes(prompt_ids, block_size, cache_salt)
