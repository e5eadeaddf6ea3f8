"""The admission gate's key memory: which block hashes a pool has seen before.

A block the pool has never held before is, on most traces, a one-off: caching it
costs a block that a reused one could have held. The gate (blockd.eviction.GatedPolicy)
admits a block to the protected part of the cache only once its key has been seen
before; it needs to remember keys for longer than a block can survive in the pool,
or a key used twice with a gap longer than the pool is never recognised (measured on
bench.eviction_quality's conversation trace: a memory of 1x the pool gains almost
nothing; the gate's gain needs several times the pool).

`KeyMemory` is that memory, compact: two generations of a Bloom filter (k = 4 bits
per key, `BITS_PER_KEY` bits per key of a generation). Keys are added to the young
generation; when it holds `capacity / 2` keys the old one is dropped and the young one
becomes old, so a key is remembered for at least `capacity / 2` and at most
`capacity` later insertions (a sliding window without per-key state). A query answers
"maybe seen" with a false-positive rate of about 1-2% per generation (a false positive
only admits a block early); never a false negative inside the window.

Memory: 2 x `BITS_PER_KEY` x capacity / 2 bits = `BITS_PER_KEY` / 8 bytes per tracked
key (1.25 B at 10 bits), against ~200 B per entry of the ghost table's OrderedDict.
`nbytes` reports it; tests/blockd/test_admission.py measures the false-positive rate.

The probes come straight from the block hash (xxh3-128: uniform bits), four 32-bit
slices, so a query costs one int conversion and four bit tests. Pure: no I/O.
"""

from __future__ import annotations

from blockd.types import BlockHash

BITS_PER_KEY = 10  # per key of a generation: ~1.2% false positives with 4 probes
NUM_PROBES = 4
_SLICE = 32  # bits of the hash per probe (128-bit hashes: 4 probes)


class KeyMemory:
    """Block hashes seen in the last `capacity` insertions (at least the last half)."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 0, "capacity must be >= 0"
        self.capacity = capacity
        self._per_generation = max(1, capacity // 2)
        self._num_bits = max(64, self._per_generation * BITS_PER_KEY)
        self._young = bytearray((self._num_bits + 7) // 8)
        self._old = bytearray(len(self._young))
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
            self._young = bytearray(len(self._old))
            self._num_young = 0
        young = self._young
        for bit in self._probes(block_hash):
            young[bit >> 3] |= 1 << (bit & 7)
        self._num_young += 1
        self.num_added += 1

    def __contains__(self, block_hash: object) -> bool:
        if not self.num_added:
            return False
        probes = self._probes(block_hash)  # type: ignore[arg-type]
        return _all_set(self._young, probes) or _all_set(self._old, probes)

    def clear(self) -> None:
        self._young = bytearray(len(self._young))
        self._old = bytearray(len(self._old))
        self._num_young = 0
        self.num_added = 0

    def _probes(self, block_hash: BlockHash) -> list[int]:
        x = int.from_bytes(block_hash[:16], "little")
        n = self._num_bits
        mask = (1 << _SLICE) - 1
        return [((x >> (_SLICE * i)) & mask) % n for i in range(NUM_PROBES)]


def _all_set(bits: bytearray, probes: list[int]) -> bool:
    return all(bits[p >> 3] & (1 << (p & 7)) for p in probes)
