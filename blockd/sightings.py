"""Fleet-wide sightings of block hashes: the count behind the seen-twice demotion rule.

A block is *seen* when a worker commits it (it was computed) and when an admission
hits it, on any pool of this blockd. Pools of one namespace share hashes (the seed
carries the namespace), so one table serves every pool and a prefix computed on one
worker and hit on another counts twice on both: a lone worker's view would call it a
one-off. Bounded: the least recently seen hashes are forgotten first; a forgotten
block then counts its own pool's sightings only (`Block.num_hits + 1`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from blockd.types import BlockHash


class Sightings:
    def __init__(self, capacity: int) -> None:
        assert capacity >= 1, "the sightings table holds at least one hash"
        self._capacity = capacity
        self._counts: OrderedDict[BlockHash, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def see(self, block_hashes: Iterable[BlockHash]) -> None:
        counts = self._counts
        for block_hash in block_hashes:
            counts[block_hash] = counts.pop(block_hash, 0) + 1
        while len(counts) > self._capacity:
            counts.popitem(last=False)

    def count(self, block_hash: BlockHash) -> int:
        return self._counts.get(block_hash, 0)
