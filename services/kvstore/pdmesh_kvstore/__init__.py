"""The KV-metadata service: NIXL agent metadata (so prefill ranks find decode agents) and one
hand-off record per request (RESERVED → TRANSFERRING → READY → CONSUMED, or EXPIRED / CANCELLED)
with its lease as a Redis TTL.

`core` (pure state machine) ← `store` (Redis) ← `servicer` (gRPC) ← `server` (wiring); `client` for
workers. The global prefix index (`prefix_index`, pure, in memory): KVEvents(pb) → `PrefixIndex` →
LongestPrefixResponse(pb)."""
