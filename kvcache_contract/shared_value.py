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

from kvcache_contract.block_hash import TOKEN_BYTES, salt_block_index, salt_tag

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
    "chain_digests",
    "identity",
    "salt_digest",
]

MAGIC = b"KVCB"
VERSION = 2  # 1: no chain digest (values of version 1 are misses, and skipped by a rebuild)
HEADER = struct.Struct("<4sHH16s16s16s16sIIIIIQ16s16s")
HAS_PARENT = 1
SALTED = 2
DIGEST_BYTES = 16
NO_DIGEST = bytes(DIGEST_BYTES)


def salt_digest(tag: bytes) -> bytes:
    """A one-way digest of a salt's tag (`block_hash.salt_tag`): what a value's header and
    blockd's records keep instead of the salt."""
    return hashlib.blake2b(tag, digest_size=DIGEST_BYTES).digest()


def identity(token_bytes: bytes, salt: bytes | None) -> bytes:
    """What makes a block itself besides its chain: its tokens (as `token_bytes`), after
    b"S" and its salt digest `salt` for the salted block. Unambiguous: an unsalted
    identity is exactly 4 x block_size bytes long, a salted one longer."""
    return token_bytes if salt is None else b"S" + salt + token_bytes


def chain_digest(parent_chain: bytes | None, identity: bytes) -> bytes:
    """The chain digest of a block whose parent's chain digest is `parent_chain` (None
    for a first block) and whose identity is `identity`: blake2b-128 of the parent's
    (16 zero bytes for a first block) followed by the identity."""
    return hashlib.blake2b((parent_chain or NO_DIGEST) + identity, digest_size=DIGEST_BYTES).digest()


def chain_digests(data: bytes, block_size: int, salt: str = "", public_prefix_tokens: int = 0) -> list[bytes]:
    """The chain digests of every full block of `data` (a `token_bytes` string), first
    block first, the salt mixed into the block `block_hash` mixes it into."""
    width = TOKEN_BYTES * block_size
    salted = salt_block_index(salt, public_prefix_tokens, block_size)
    chain: bytes | None = None
    digests = []
    for i in range(len(data) // width):
        tokens = data[i * width : (i + 1) * width]
        chain = chain_digest(chain, identity(tokens, salt_digest(salt_tag(salt)) if i == salted else None))
        digests.append(chain)
    return digests
