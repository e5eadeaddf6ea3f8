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
(3 B), against ~160 B per entry of the ghost table's OrderedDict. `nbytes` reports it;
tests/blockd/test_admission.py measures the false-positive rate.

One byte per key, not k scattered bits: a query is one int conversion, one byte and
one pattern lookup per generation. It runs once per committed block that no ghost
explains, and only once the pool has evicted (`GhostTable.__bool__`): a pool without
pressure never pays it. The probes come straight from the block hash (xxh3-128:
uniform bits). Pure: no I/O.
"""

from __future__ import annotations

from itertools import combinations

from blockd.types import BlockHash

BYTES_PER_KEY = 3  # per key of a generation: ~0.6% false positives when it is full
_BITS_SET = 3  # of the 8 bits of a key's byte
# A key's bit pattern, by 6 bits of its hash: the 56 patterns of 3 bits in a byte.
_PATTERNS = [sum(1 << b for b in bits) for bits in combinations(range(8), _BITS_SET)]
_PATTERNS = [_PATTERNS[v % len(_PATTERNS)] for v in range(64)]
# The byte is the hash (as a little-endian int) modulo the bytes of a generation; the
# pattern is its top 6 bits (of 128). Measured per query: 244 ns against 428 ns for the
# low 48 bits then the next 6 (masks and shifts on a 128-bit int cost more than one
# modulo); ~5% of blockd's time under `python -m bench.blockd_grpc` (py-spy).
_PATTERN_SHIFT = 122


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
        x = int.from_bytes(block_hash, "little")
        self._young[x % self._num_bytes] |= _PATTERNS[(x >> _PATTERN_SHIFT) & 63]
        self._num_young += 1
        self.num_added += 1

    def add_many(self, block_hashes: list[BlockHash]) -> None:
        """`add` each, oldest first (one call per eviction batch: no call per key)."""
        if not self.capacity:
            return
        num_bytes, per_generation, patterns = self._num_bytes, self._per_generation, _PATTERNS
        young, num_young = self._young, self._num_young
        from_bytes = int.from_bytes
        for block_hash in block_hashes:
            if num_young >= per_generation:
                self._old = young
                young = self._young = bytearray(num_bytes)
                num_young = 0
            x = from_bytes(block_hash, "little")
            young[x % num_bytes] |= patterns[(x >> _PATTERN_SHIFT) & 63]
            num_young += 1
        self._num_young = num_young
        self.num_added += len(block_hashes)

    def __contains__(self, block_hash: object) -> bool:
        # Runs once per committed block of a pool under pressure (GhostTable.recall); no
        # emptiness test (an empty memory's bytes are zero, and every pattern has bits set).
        # Hot callers ask `contains_many` (one call per commit run).
        x = int.from_bytes(block_hash, "little")  # type: ignore[arg-type]
        i = x % self._num_bytes
        pattern = _PATTERNS[(x >> _PATTERN_SHIFT) & 63]
        return self._young[i] & pattern == pattern or self._old[i] & pattern == pattern

    def contains_many(self, block_hashes: list[BlockHash]) -> list[bool]:
        """`hash in self` for each, in one call (a commit run's recall)."""
        young, old, num_bytes, patterns = self._young, self._old, self._num_bytes, _PATTERNS
        from_bytes = int.from_bytes
        answers: list[bool] = []
        append = answers.append
        for block_hash in block_hashes:
            x = from_bytes(block_hash, "little")
            i = x % num_bytes
            pattern = patterns[(x >> _PATTERN_SHIFT) & 63]
            append(young[i] & pattern == pattern or old[i] & pattern == pattern)
        return answers

    def clear(self) -> None:
        self._young = bytearray(self._num_bytes)
        self._old = bytearray(self._num_bytes)
        self._num_young = 0
        self.num_added = 0
