"""The decode rank: holds KV blocks for running requests and streams their tokens.

`ReserveRequest(pb)` → `EngineLoop.reserve` (blocks + lease in `core.ReservationBook`) → `KVTarget(pb)`;
NIXL notification + `DecodeRequest(pb)` → `EngineCore.kv_arrived` → `StepOutput` → `TokenChunk(pb)`;
`GenerateRequest(pb)` → `EngineCore.add_request` → `StepOutput` → `TokenChunk(pb)`.
"""
