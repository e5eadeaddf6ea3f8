"""The admission gate's key memory: which block hashes a pool has seen before.

A block the pool has never held before is, on most traces, a one-off: caching it
costs a block that a reused one could have held. The gate (blockd.eviction.GatedPolicy)
admits a block to the protected part of the cache only once its key has been seen
before; it needs to remember keys for longer than a block can survive in the pool,
or a key used twice with a gap longer than the pool is never recognised (measured on
bench.eviction_quality's conversation trace: a memory of 1x the pool gains almost
nothing; the gate's gain needs several times the pool).

`KeyMemory` is that memory, compact: two generations of a byte-blocked Bloom filter
(each key sets 3 of the 8 bits of one byte, `BYTES_PER_KEY` bytes per key of a
generation). Keys are added to the young generation; when it holds `capacity / 2` keys
the old one is dropped and the young one becomes old, so a key is remembered for at
least `capacity / 2` and at most `capacity` later insertions (a sliding window without
per-key state). A query answers "maybe seen" with ~0.6% false positives per full
generation (a false positive only admits a block early); never a false negative inside
the window.

Memory: 2 x `BYTES_PER_KEY` x capacity / 2 = `BYTES_PER_KEY` bytes per tracked key
(3 B), against ~190 B per ghost of the ghost table (tracemalloc, its dict, FIFO and
entry; 250 B when it was an OrderedDict). `nbytes` reports it;
tests/blockd/test_admission.py measures the false-positive rate.

One byte per key, not k scattered bits: a query is one int conversion, one byte and
one pattern lookup per generation. It runs once per committed block that no ghost
explains, and only once the pool has evicted (`GhostTable.__bool__`): a pool without
pressure never pays it. The probes come straight from the block hash (xxh3-128:
uniform bits). Pure: no I/O.
"""

from __future__ import annotations

from itertools import combinations
from typing import Final

from blockd.types import BlockHash
from kvcache_contract.block_hash import HASH_BYTES

BYTES_PER_KEY = 3  # per key of a generation: ~0.6% false positives when it is full
_BITS_SET = 3  # of the 8 bits of a key's byte
# A key's bit pattern, by 6 bits of its hash: the 56 patterns of 3 bits in a byte.
_THREE_OF_EIGHT = [sum(1 << b for b in bits) for bits in combinations(range(8), _BITS_SET)]
# Final: the compiled core (blockd.native) reads a Final global from a C static, any other
# from the module's dict (two dict lookups per key in `_slot`, callgrind).
_PATTERNS: Final = [_THREE_OF_EIGHT[v % len(_THREE_OF_EIGHT)] for v in range(64)]
# The byte is the hash (as a little-endian int) modulo the bytes of a generation; the
# pattern is its top 6 bits (of 128). `_slot` computes both without a 128-bit int: with
# the hash's 24-bit words w0..w5 (little-endian; w5 is its last byte), x mod n =
# (w0 + w1 (2^24 mod n) + ... + w5 (2^120 mod n)) mod n, and the top 6 bits are w5's. For
# n < 2^26 every operand of a product is below 2^30 and the sum below 2^53, so the
# compiled core (blockd.native) multiplies machine ints without an overflow path (mypyc
# takes its slow path for a factor of 2^30 or more), where int.from_bytes, % and >> on
# the 128-bit int took ~25% of the instructions of an admission of
# bench.blockd_inprocess (callgrind): 7-8 us per 128 keys against 15-16. Interpreted, the
# 128-bit path is the faster (15-19 us against 74: one C call per operation either way,
# and it makes fewer), so the words are used only where this module runs compiled, and
# for n < 2^26 (a generation of ~22M keys).
_COMPILED: Final = not __file__.endswith(".py")  # mypyc's module is an extension module
_PATTERN_SHIFT: Final = 122
_FAST_LIMIT: Final = 1 << 26
_HASH_BYTES: Final = HASH_BYTES  # the contract's (xxh3-128): other lengths take the 128-bit path


class KeyMemory:
    """Block hashes seen in the last `capacity` insertions (at least the last half)."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 0, "capacity must be >= 0"
        self.capacity = capacity
        self._per_generation = max(1, capacity // 2)
        self._num_bytes = max(8, self._per_generation * BYTES_PER_KEY)
        self._young = bytearray(self._num_bytes)
        self._old = bytearray(self._num_bytes)
        self._num_young = 0
        self.num_added = 0  # keys added since creation (or the last clear)
        n = self._num_bytes
        # 2^24k mod n for k = 1 .. 5 (`_slot`), and whether the machine-int path is taken
        self._fast = _COMPILED and n < _FAST_LIMIT
        self._m1, self._m2, self._m3, self._m4, self._m5 = [(1 << 24 * k) % n for k in range(1, 6)]

    @property
    def nbytes(self) -> int:
        """Bytes of filter state (both generations)."""
        return len(self._young) + len(self._old)

    @property
    def bytes_per_key(self) -> float:
        """Filter bytes per key the memory tracks at its fullest (`capacity`)."""
        return self.nbytes / max(1, self.capacity)

    def add(self, block_hash: BlockHash) -> None:
        if not self.capacity:
            return
        if self._num_young >= self._per_generation:
            self._old = self._young
            self._young = bytearray(self._num_bytes)
            self._num_young = 0
        i, pattern = self._slot(block_hash)
        self._young[i] |= pattern
        self._num_young += 1
        self.num_added += 1

    def _slot(self, block_hash: bytes) -> tuple[int, int]:
        """(byte index, bit pattern) of a key in either generation (see `_PATTERN_SHIFT`)."""
        h = block_hash
        if self._fast and len(h) == _HASH_BYTES:
            top = h[15]
            # products, not shifts: mypyc inlines a small int's product, calls out for a shift
            i = (
                (h[0] + h[1] * 256 + h[2] * 65536)
                + (h[3] + h[4] * 256 + h[5] * 65536) * self._m1
                + (h[6] + h[7] * 256 + h[8] * 65536) * self._m2
                + (h[9] + h[10] * 256 + h[11] * 65536) * self._m3
                + (h[12] + h[13] * 256 + h[14] * 65536) * self._m4
                + top * self._m5
            ) % self._num_bytes
            return i, _PATTERNS[top >> 2]
        x = int.from_bytes(h, "little")
        return x % self._num_bytes, _PATTERNS[(x >> _PATTERN_SHIFT) & 63]

    def add_many(self, block_hashes: list[BlockHash]) -> None:
        """`add` each, oldest first (one call per eviction batch: no call per key)."""
        if not self.capacity:
            return
        num_bytes, per_generation = self._num_bytes, self._per_generation
        young, num_young = self._young, self._num_young
        for block_hash in block_hashes:
            if num_young >= per_generation:
                self._old = young
                young = self._young = bytearray(num_bytes)
                num_young = 0
            i, pattern = self._slot(block_hash)  # a method call, not a bound local: native in mypyc
            young[i] |= pattern
            num_young += 1
        self._num_young = num_young
        self.num_added += len(block_hashes)

    def __contains__(self, block_hash: object) -> bool:
        # Runs once per committed block of a pool under pressure (GhostTable.recall); no
        # emptiness test (an empty memory's bytes are zero, and every pattern has bits set).
        # Hot callers ask `contains_many` (one call per commit run).
        if not isinstance(block_hash, bytes):
            return False
        i, pattern = self._slot(block_hash)
        return self._young[i] & pattern == pattern or self._old[i] & pattern == pattern

    def contains_many(self, block_hashes: list[BlockHash]) -> list[bool]:
        """`hash in self` for each, in one call (a commit run's recall)."""
        young, old = self._young, self._old
        answers: list[bool] = []
        append = answers.append
        for block_hash in block_hashes:
            i, pattern = self._slot(block_hash)
            append(young[i] & pattern == pattern or old[i] & pattern == pattern)
        return answers

    def clear(self) -> None:
        self._young = bytearray(self._num_bytes)
        self._old = bytearray(self._num_bytes)
        self._num_young = 0
        self.num_added = 0
