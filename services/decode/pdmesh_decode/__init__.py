"""The decode rank: holds KV blocks for running requests and streams their tokens.

`ReserveRequest(pb)` → `DecodeConnector.reserve` (blocks + lease: `core.ReservationBook`, hand-off
opened in the kvstore) → `KVTarget(pb)`; NIXL notification + `DecodeRequest(pb)` → `core.decide` →
ADMIT → `EngineCore.kv_arrived` → `StepOutput` → `TokenChunk(pb)`; `GenerateRequest(pb)` →
`EngineCore.add_request`
→ `StepOutput` → `TokenChunk(pb)`.
"""
