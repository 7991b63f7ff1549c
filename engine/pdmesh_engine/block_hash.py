"""Chained content hashes of full KV blocks.

Block i's hash covers its tokens and, through the parent hash, every token before it, so equal
hashes mean equal prefixes. The hash is stable across processes and machines (blake2b over the
token ids), so the gateway and the KV-metadata service can compute the same keys as the engine.
"""

from __future__ import annotations

import hashlib
import sys
from array import array

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int] | tuple[int, ...]) -> BlockHash:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    packed = array("q", token_ids)
    if sys.byteorder == "big":  # hash little-endian int64 everywhere
        packed.byteswap()
    h.update(packed.tobytes())
    return h.digest()


def hash_full_blocks(
    token_ids: list[int], block_size: int, start_block: int = 0, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`."""
    hashes: list[BlockHash] = []
    for begin in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes
