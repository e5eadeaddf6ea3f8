"""The block hash rule of the contract (DESIGN.md, "Hashing and namespaces"): pure, one
module, checked against the published vectors in `block_hash_vectors.json` so that an
implementation in any language can prove it computes the same hashes.

    h_{-1} = H("kvcache.v1/namespace" | field(model_id) | field(model_revision)
               | field(dtype) | field(adapter_id) | u32(block_size))
    h_i    = H(h_{i-1} | salt_tag_i | tokens of block i)

- H is xxh3-128 (16 bytes, the digest's canonical big-endian byte order), no seed.
- u32(n) is 4 bytes little-endian; field(s) = u32(len(utf8(s))) | utf8(s).
- The tokens of a block are its token ids as u32 little-endian, 4 * block_size bytes:
  the same bytes as the packed `token_bytes` fields of the Step messages.
- salt_tag_i = b"\\x01" | field(salt) for the one block the salt is mixed into (the
  first block that reaches past `public_prefix_tokens`: index public_prefix_tokens //
  block_size, block 0 without a public prefix), and empty for every other block. An
  empty salt is no salt. Lengths make the encoding unambiguous: the parent has 16
  bytes and the tokens exactly 4 * block_size, so salt "ab" never meets salt "a"
  followed by other bytes.
- Only full blocks are hashed; the partial tail never is.

blockd (blockd/hashing.py: the same rule with an injectable digest for its collision
tests) and the gateway's mirror (gateway/prefix_hash.py) both build on this module.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

HASH_BYTES = 16
TOKEN_BYTES = 4  # one uint32 per token, little-endian
NAMESPACE_TAG = b"kvcache.v1/namespace"

digest = xxhash.xxh3_128_digest  # H


def field(value: str) -> bytes:
    """u32 length | UTF-8 bytes."""
    encoded = value.encode("utf-8")
    return len(encoded).to_bytes(4, "little") + encoded


def namespace_seed_input(
    model_id: str, model_revision: str, dtype: str, adapter_id: str, block_size: int
) -> bytes:
    """The bytes h_{-1} hashes: everything besides the tokens that changes K/V."""
    fields = field(model_id) + field(model_revision) + field(dtype) + field(adapter_id)
    return NAMESPACE_TAG + fields + block_size.to_bytes(4, "little")


def namespace_seed(model_id: str, model_revision: str, dtype: str, adapter_id: str, block_size: int) -> bytes:
    """h_{-1} of a namespace."""
    return digest(namespace_seed_input(model_id, model_revision, dtype, adapter_id, block_size))


def salt_tag(salt: str) -> bytes:
    """The prefix of the salted block's payload (never for an empty salt)."""
    assert salt, "an empty salt is no salt"
    return b"\x01" + field(salt)


def salt_block_index(salt: str, public_prefix_tokens: int, block_size: int) -> int | None:
    """The one block the salt is mixed into; None without a salt."""
    return public_prefix_tokens // block_size if salt else None


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as u32 little-endian (OverflowError for ids outside 0 .. 2^32-1)."""
    packed = array("I", token_ids)
    assert packed.itemsize == TOKEN_BYTES, "array('I') must hold uint32 on this platform"
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def block_hashes(
    seed: bytes, data: bytes, block_size: int, salt: str = "", public_prefix_tokens: int = 0
) -> list[bytes]:
    """h_0 .. h_{n-1} of every full block of `data` (a `token_bytes` string)."""
    width = TOKEN_BYTES * block_size
    salt_index = salt_block_index(salt, public_prefix_tokens, block_size)
    hashes: list[bytes] = []
    parent = seed
    for i in range(len(data) // width):
        payload = data[i * width : (i + 1) * width]
        if i == salt_index:
            payload = salt_tag(salt) + payload
        parent = digest(parent + payload)
        hashes.append(parent)
    return hashes
