"""Chained content hashes of full token blocks (xxh3-128).

    h_{-1} = H("kvcache.v1/namespace" | len-prefixed model_id, revision, dtype, adapter | block_size)
    h_i    = H(h_{i-1} | salt_tag_i | tokens of block i as uint32 little-endian)

`salt_tag_i` is b"\\x01" + u32 length + the UTF-8 salt for the one block the salt is
mixed into, and empty for every other block. The encoding is unambiguous: the
parent hash has 16 bytes and the tokens of a block exactly 4 * block_size (fixed
by the namespace), so an input's length says whether a salt is present, and the
salt is length-prefixed: salt "ab" never meets salt "a" followed by other bytes.
An empty salt is no salt. (No tag byte on unsalted blocks: it would cost a second
concatenation per block on the hot path.) No random seed: hashes are equal across
processes and restarts.

Hashes only find candidates; the directory verifies every hit exactly (parent
block, tokens, salt), so a collision costs a miss, never wrong K/V. Tests prove it
by injecting a `BlockHasher` with a deliberately weak digest.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from blockd.types import BlockHash, InvalidArgument, Namespace

Digest = Callable[[bytes], bytes]

HASH_BYTES = 16
TOKEN_BYTES = 4  # one uint32 per token
UNSALTED_TAG = b""  # see the module docstring: lengths disambiguate
_NAMESPACE_TAG = b"kvcache.v1/namespace"

assert array("I").itemsize == TOKEN_BYTES, "array('I') must hold uint32 on this platform"


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The tokens as uint32 little-endian bytes, converted once and sliced per block.

    A protobuf repeated field converts ~50x faster through numpy than element by
    element (its values are uint32 already); plain lists take the array path."""
    if not isinstance(token_ids, (list, tuple)):
        try:
            return np.asarray(token_ids, dtype="<u4").tobytes()
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"token ids must be integers in 0 .. 4294967295: {exc}") from None
    try:
        packed = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidArgument(f"token ids must be integers in 0 .. 4294967295: {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def tokens_of(data: bytes) -> tuple[int, ...]:
    """Inverse of `token_bytes`."""
    packed = array("I")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return tuple(packed)


def salt_tag(salt: str) -> bytes:
    """The unambiguous encoding of a salt mixed into a block (never for an empty salt)."""
    assert salt, "an empty salt is no salt"
    encoded = salt.encode("utf-8")
    return b"\x01" + len(encoded).to_bytes(4, "little") + encoded


def salt_block_index(salt: str, public_prefix_tokens: int, block_size: int) -> int | None:
    """The one block the salt is mixed into: the first block that reaches past the
    public prefix (block 0 without one); None when there is no salt."""
    if not salt:
        return None
    return public_prefix_tokens // block_size


def _encode_field(value: str) -> bytes:
    encoded = value.encode("utf-8")
    return len(encoded).to_bytes(4, "little") + encoded


class BlockHasher:
    """Computes namespace seeds and chained block hashes with an injectable digest.

    The default digest is xxh3-128. Tests inject a weak one (e.g. one that keeps a
    single byte) to force collisions; the directory must then miss, never mismatch.
    """

    def __init__(self, digest: Digest = xxhash.xxh3_128_digest) -> None:
        self.digest = digest

    def namespace_seed(self, namespace: Namespace, block_size: int) -> BlockHash:
        """h_{-1}: derived from everything that changes K/V besides the tokens."""
        data = b"".join(
            [
                _NAMESPACE_TAG,
                _encode_field(namespace.model_id),
                _encode_field(namespace.model_revision),
                _encode_field(namespace.dtype),
                _encode_field(namespace.adapter_id),
                block_size.to_bytes(4, "little"),
            ]
        )
        return self._checked(self.digest(data))

    def block_hash(self, parent: BlockHash, tag: bytes, block_token_bytes: bytes) -> BlockHash:
        """h_i from h_{i-1}, the block's salt tag and its tokens' bytes."""
        return self._checked(self.digest(parent + tag + block_token_bytes))

    def chain(
        self, seed: BlockHash, data: bytes, block_size: int, salt: str = "", public_prefix_tokens: int = 0
    ) -> list[BlockHash]:
        """Hashes of every full block of `data` (a `token_bytes` string); the partial
        tail is never hashed. Cost: one digest per full block."""
        width = block_size * TOKEN_BYTES
        salt_index = salt_block_index(salt, public_prefix_tokens, block_size)
        hashes: list[BlockHash] = []
        parent = seed
        for i in range(len(data) // width):
            tag = salt_tag(salt) if i == salt_index else UNSALTED_TAG
            parent = self.block_hash(parent, tag, data[i * width : (i + 1) * width])
            hashes.append(parent)
        return hashes

    @staticmethod
    def _checked(value: bytes) -> BlockHash:
        assert len(value) == HASH_BYTES, f"a block hash has {HASH_BYTES} bytes, got {len(value)}"
        return BlockHash(value)


DEFAULT_HASHER = BlockHasher()


def truncated_hasher(num_bytes: int) -> BlockHasher:
    """A test hook: xxh3-128 cut to `num_bytes` (zero-padded), so collisions are common."""
    assert 1 <= num_bytes <= HASH_BYTES, f"keep 1 .. {HASH_BYTES} bytes, got {num_bytes}"
    pad = bytes(HASH_BYTES - num_bytes)
    return BlockHasher(lambda data: xxhash.xxh3_128_digest(data)[:num_bytes] + pad)


def namespace_seed(namespace: Namespace, block_size: int) -> BlockHash:
    """h_{-1} with the default (xxh3-128) hasher."""
    return DEFAULT_HASHER.namespace_seed(namespace, block_size)
