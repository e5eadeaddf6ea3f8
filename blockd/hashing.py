"""Chained content hashes of full token blocks (xxh3-128): the one block walk.

    h_{-1} = H("kvcache.v1/namespace" | len-prefixed model_id, revision, dtype, adapter | block_size)
    h_i    = H(h_{i-1} | payload_i)        payload_i = salt_tag_i | tokens of block i (uint32 LE)

`salt_tag_i` is b"\\x01" + u32 length + the UTF-8 salt for the one block the salt is
mixed into, and empty for every other block. The encoding is unambiguous: the
parent hash has 16 bytes and the tokens of a block exactly 4 * block_size (fixed
by the namespace), so a payload's length says whether a salt is present, and the
salt is length-prefixed: salt "ab" never meets salt "a" followed by other bytes.
So equal payloads mean equal tokens *and* equal mixed salt, which is what lets the
directory verify a hit with one comparison. An empty salt is no salt. No random
seed: hashes are equal across processes and restarts.

Every walk over a token run goes through `BlockHasher.walk` (cache match, commit,
resync, and the `chain`/`block_hash` helpers the tests use); `split_blocks` and
`block_payloads` are the only places that cut tokens into blocks.

The rule itself (the seed's fields, the salt tag, the token encoding) is the
contract's: `kvcache_contract.block_hash`, checked against its published vectors
(tests/test_block_hash_vectors.py); this module adds the injectable digest, the walk
that stops at the first miss, and validation of client tokens.

Hashes only find candidates; the directory verifies every hit exactly (parent
block, payload), so a collision costs a miss, never wrong K/V. Tests prove it by
injecting a `BlockHasher` with a deliberately weak digest.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence

import numpy as np

from blockd.types import BlockHash, InvalidArgument, Namespace
from kvcache_contract import block_hash as rule
from kvcache_contract.block_hash import HASH_BYTES, TOKEN_BYTES

Digest = Callable[[bytes], bytes]

UNSALTED_TAG = b""  # see the module docstring: lengths disambiguate
_SPLIT_WITH_NUMPY_FROM = 8  # blocks; below, plain slices are faster (a cold match probes one)

assert array("I").itemsize == TOKEN_BYTES, "array('I') must hold uint32 on this platform"


def block_width(block_size: int) -> int:
    """Bytes of one full block's tokens."""
    return block_size * TOKEN_BYTES


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The tokens as uint32 little-endian bytes, converted once and cut per block.

    A protobuf repeated field converts ~50x faster through numpy than element by
    element (its values are uint32 already); plain lists take the array path, which
    is ~4x faster than numpy for them (bench.blockd_core)."""
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


def split_blocks(data: bytes, block_size: int) -> list[bytes]:
    """The full blocks of `data` (a `token_bytes` string), one bytes object each; the
    partial tail is dropped. One numpy call instead of a Python slice per block: 9 us
    instead of 42 us for 256 blocks (bench.blockd_core). A void dtype keeps trailing
    zero bytes, which a bytes ("S") dtype would strip."""
    width = block_width(block_size)
    count = len(data) // width
    if count < _SPLIT_WITH_NUMPY_FROM:  # numpy's fixed cost loses for a handful of slices
        return [data[start : start + width] for start in range(0, count * width, width)]
    return np.frombuffer(data, dtype=f"V{width}", count=count).tolist()


salt_tag = rule.salt_tag  # the unambiguous encoding of a salt mixed into a block
# The one block the salt is mixed into: the first block that reaches past the public
# prefix (block 0 without one); None when there is no salt.
salt_block_index = rule.salt_block_index


def block_payloads(blocks: list[bytes], salt: str, salt_index: int | None) -> list[bytes]:
    """What each h_i covers after h_{i-1}: the block's tokens, preceded by the salt tag
    in the salted block. `salt_index` counts from blocks[0] and may fall outside them
    (the salted block is elsewhere in the chain): then the blocks are their payloads."""
    if salt_index is None or not 0 <= salt_index < len(blocks):
        return blocks
    payloads = list(blocks)
    payloads[salt_index] = salt_tag(salt) + blocks[salt_index]
    return payloads


class BlockHasher:
    """Computes namespace seeds and walks block chains with an injectable digest.

    The default digest is xxh3-128. Tests inject a weak one (e.g. one that keeps a
    single byte) to force collisions; the directory must then miss, never mismatch.
    """

    def __init__(self, digest: Digest = rule.digest) -> None:
        # Checked once here, not per block: the walk is the hot path.
        assert len(digest(b"")) == HASH_BYTES, f"a digest must answer {HASH_BYTES} bytes"
        self.digest = digest

    def namespace_seed(self, namespace: Namespace, block_size: int) -> BlockHash:
        """h_{-1}: derived from everything that changes K/V besides the tokens."""
        ns = namespace
        data = rule.namespace_seed_input(ns.model_id, ns.model_revision, ns.dtype, ns.adapter_id, block_size)
        return BlockHash(self.digest(data))

    def walk(
        self,
        parent: BlockHash,
        payloads: Sequence[bytes],
        lookup: Callable[[BlockHash], object | None] | None = None,
    ) -> list:
        """The chain rule, h_i = H(h_{i-1} | payload_i), for each payload in turn from
        `parent` (the seed, or the hash of the block before payloads[0]).

        Without `lookup`: every h_i. With it: lookup(h_i) for the leading blocks whose
        lookup is not None; the first None ends the walk, so a cache match hashes its
        hits and one miss, never the rest of the prompt. Cost: one concatenation and
        one digest per block (one list append per answer); the loop is kept to the
        fewest bytecodes because a 4,096-token prompt runs it 256 times
        (bench.blockd_core)."""
        digest = self.digest
        found: list = []
        append = found.append
        for payload in payloads:
            parent = digest(parent + payload)  # type: ignore[assignment]  # a BlockHash: no call per block
            value = parent if lookup is None else lookup(parent)
            if value is None:
                break
            append(value)
        return found

    def chain(
        self, seed: BlockHash, data: bytes, block_size: int, salt: str = "", public_prefix_tokens: int = 0
    ) -> list[BlockHash]:
        """Hashes of every full block of `data` (a `token_bytes` string); the partial
        tail is never hashed."""
        salt_index = salt_block_index(salt, public_prefix_tokens, block_size)
        return self.walk(seed, block_payloads(split_blocks(data, block_size), salt, salt_index))

    def block_hash(self, parent: BlockHash, tag: bytes, block_token_bytes: bytes) -> BlockHash:
        """h_i from h_{i-1}, the block's salt tag and its tokens' bytes."""
        return self.walk(parent, [tag + block_token_bytes])[0]


DEFAULT_HASHER = BlockHasher()


def truncated_hasher(num_bytes: int) -> BlockHasher:
    """A test hook: xxh3-128 cut to `num_bytes` (zero-padded), so collisions are common."""
    assert 1 <= num_bytes <= HASH_BYTES, f"keep 1 .. {HASH_BYTES} bytes, got {num_bytes}"
    pad = bytes(HASH_BYTES - num_bytes)
    return BlockHasher(lambda data: rule.digest(data)[:num_bytes] + pad)


def namespace_seed(namespace: Namespace, block_size: int) -> BlockHash:
    """h_{-1} with the default (xxh3-128) hasher."""
    return DEFAULT_HASHER.namespace_seed(namespace, block_size)
