"""What decode and prefill ranks share: the engine thread, pb ↔ engine conversions and the serve
wiring.

`SamplingParams(pb) → SamplingParams` (convert) → `EngineLoop` command (engine thread) →
`StepOutput` → `RequestStream` → `TokenChunk(pb)` (convert). `runtime.run_worker` wires an
`EngineCore`, its NIXL agent, the kvstore client, the gRPC server and the registry heartbeat.
"""
