"""The prefill rank: computes a prompt's KV and pushes it into a decode rank's reserved blocks.

`PrefillRequest(pb)` → `core.PushTarget` + first-token `SamplingParams` → `EngineCore.add_request`
(hold_blocks) → finished `StepOutput` → one NIXL WRITE (notification = request id) → DONE →
`release_held` → `PrefillResponse(pb)`.
"""
