"""The shared tier's value format (directory.proto, SharedBlock): one copy for the
workers that write and read values (computed.shared_store) and blockd, which reads
their headers back to rebuild its index (blockd.shared_store). Pure: no I/O.

A value is `HEADER`, then the block's `block_size` tokens (uint32 little-endian), then
its K/V bytes in the pool's layout. Header fields, in order: magic, version, flags
(`HAS_PARENT`, `SALTED`), namespace seed, block hash, parent hash (zeros for a first
block), salt digest (zeros when unsalted), depth, num_layers, num_kv_heads, head_dim,
block_size, K/V byte count, dtype name (NUL-padded), chain digest.

The chain digest (version 2) names the block's whole chain, not only its parent's hash:
blockd computes it when it asks for the write (`chain_digest`), from the chain it
verified level by level, and checks it again when it links a value read back from the
store under the value its parent hash names. Why: under a hash collision that value
can be another chain's block, and the parent hash alone would make this block's K/V
findable after that chain's prefix (a hit that differs from a miss). The digest is
blake2b whatever hash the pool uses for its block hashes, so a weak or colliding block
hash never weakens it. A reader compares every field, the chain digest included, with
what blockd says of the block, so a value overwritten by a colliding block is a miss.
"""

from __future__ import annotations

import hashlib
import struct

from kvcache_contract.block_hash import TOKEN_BYTES

__all__ = [
    "DIGEST_BYTES",
    "HAS_PARENT",
    "HEADER",
    "MAGIC",
    "NO_DIGEST",
    "SALTED",
    "TOKEN_BYTES",
    "VERSION",
    "chain_digest",
]

MAGIC = b"KVCB"
VERSION = 2  # 1: no chain digest (values of version 1 are misses, and skipped by a rebuild)
HEADER = struct.Struct("<4sHH16s16s16s16sIIIIIQ16s16s")
HAS_PARENT = 1
SALTED = 2
DIGEST_BYTES = 16
NO_DIGEST = bytes(DIGEST_BYTES)


def chain_digest(parent_chain: bytes | None, identity: bytes) -> bytes:
    """The chain digest of a block whose parent's chain digest is `parent_chain` (None
    for a first block) and whose identity is `identity` (its tokens, preceded for the
    salted block by its salt digest: blockd.shared_tier.make_identity)."""
    return hashlib.blake2b((parent_chain or NO_DIGEST) + identity, digest_size=DIGEST_BYTES).digest()
