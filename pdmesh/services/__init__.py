"""The mesh: gRPC services over the engine, coordinated through Redis, KV moved by NIXL.

Request path: client → gateway (REST / gRPC) → decode.Reserve → prefill.Prefill (NIXL WRITE into
the reserved blocks) → decode.Decode (stream) → gateway → client. kvstore records each hand-off
and publishes NIXL agent metadata. Each service is `core` (pure), adapters (servicer, Redis,
NIXL) and `server.py` (wiring only).
"""
