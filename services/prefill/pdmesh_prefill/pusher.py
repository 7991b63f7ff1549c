"""Moved: `KVPusher` is the engine-thread half of `pdmesh_prefill.connector` (import it there).
This alias stays only while tests/services/decode/test_handoff_safety.py patches
`pusher.KVPusher`."""

from __future__ import annotations

from pdmesh_prefill.connector import KVPusher, PushResult, TransferFailed

__all__ = ["KVPusher", "PushResult", "TransferFailed"]
