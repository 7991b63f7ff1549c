"""Chained content hashes of full KV blocks.

Block i's hash covers its tokens and, through the parent hash, every token before it, so equal
hashes mean equal prefixes. The hash is stable across processes and machines (blake2b over the
token ids), so the gateway and the KV-metadata service can compute the same keys as the engine.

Cache isolation (`SamplingParams.cache_salt`, vLLM's design): a salt becomes the parent of the
chain's first block (`salt_root`), so a salted chain differs from every other salt's, and from the
unsalted one, from its first block on; requests share cached blocks (in an engine's prefix cache
and in the kvstore's index, which only sees these hashes) exactly when their salts are equal. No
salt (None) leaves the chain as it always was. The root is a blake2b personalised apart from
`hash_block`'s, so it never equals a block's hash (an unsalted first block's, say) except by a
128-bit collision; "" is a salt like any other (only None means none).
"""

from __future__ import annotations

import hashlib
import sys
from array import array

BlockHash = bytes

_SALT_PERSON = b"pdmesh-salt"  # blake2b personalisation of salt roots (<= 16 bytes)


def salt_root(cache_salt: str | None) -> BlockHash | None:
    """The parent of a chain's first block under `cache_salt`: None (no parent) without one."""
    if cache_salt is None:
        return None
    data = cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16, person=_SALT_PERSON).digest()


def hash_block(parent: BlockHash | None, token_ids: list[int] | tuple[int, ...]) -> BlockHash:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    packed = array("q", token_ids)
    if sys.byteorder == "big":  # hash little-endian int64 everywhere
        packed.byteswap()
    h.update(packed.tobytes())
    return h.digest()


def hash_full_blocks(
    token_ids: list[int],
    block_size: int,
    start_block: int = 0,
    parent: BlockHash | None = None,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`.

    `cache_salt` names the chain's root (`salt_root`): it applies where the chain starts, with no
    `parent`; a `parent` (a previous hash of the same chain) already carries it.
    """
    if parent is None:
        parent = salt_root(cache_salt)
    hashes: list[BlockHash] = []
    for begin in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size])
        hashes.append(parent)
    return hashes
