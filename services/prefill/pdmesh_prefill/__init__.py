"""The prefill rank: computes a prompt's KV and pushes it into a decode rank's reserved blocks.

`PrefillRequest(pb)` → `core.PushTarget` + first-token `SamplingParams` →
`PrefillConnector.push`: `KVPusher` runs the prompt (hold_blocks) → finished `StepOutput` →
hand-off claimed RESERVED → TRANSFERRING (`kvstore_client.move_handoff`) → one NIXL WRITE
(notification = request id) → DONE → `release_held` → `PushResult` → `PrefillResponse(pb)`.
A push's states: `core.PushState`.
"""
