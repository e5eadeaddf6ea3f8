"""A pool's host tier: the worker's second KV store, as blockd tracks it.

Device evictions *demote* worth-keeping blocks here instead of dropping them (the
worker copies the K/V before the device block is reused); an admission's walk goes
on through host-resident blocks, which are *loaded* (copied into device blocks of
the admitted sequence) and become findable in the device pool when that sequence
commits them. Records are the pool's `Block`s (one per content block, whichever
tiers hold it; see `blockd.block`).

Accounting, at every moment:

    free + evictable + referenced == num_blocks

- free: host blocks holding nothing findable;
- evictable: resident records with no load in flight (`host_refs == 0`);
- referenced: resident records being loaded (`host_refs > 0`).

Eviction is leaf-first like the device pool's, by the same policy object: only a
record with no host-only child (`Block.is_host_leaf`) leaves, so a chain is eaten
tail first and no host-only record loses its parent.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import count

from blockd.allocator import FreeBlocks
from blockd.block import Block
from blockd.eviction import EvictionPolicy, Priority
from blockd.types import BlockHash, HostBlockId, HostSpec


@dataclass
class HostCounters:
    """Cumulative host tier statistics (they survive pool resets, like PoolCounters)."""

    hit_tokens: int = 0
    num_demotions: int = 0
    num_loads: int = 0
    num_evictions: int = 0
    num_loads_skipped: int = 0


class HostLeaves:
    """Min-heap of host leaves by policy priority, with lazy invalidation (the device
    pool's `EvictableLeaves` scheme on the host fields): an entry is valid while the
    record carries its key and is still a host leaf."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._heap: list[tuple[Priority, int, Block]] = []
        self._keys = count()

    def push(self, block: Block) -> None:
        assert block.is_host_leaf, f"only host leaves enter the heap: {block}"
        key = next(self._keys)
        block.host_heap_key = key
        heapq.heappush(self._heap, (self._policy.priority(block), key, block))

    def pop(self) -> Block | None:
        heap = self._heap
        while heap:
            _, key, block = heapq.heappop(heap)
            if block.host_heap_key == key and block.is_host_leaf:
                block.host_heap_key = None
                return block
        return None

    def compact(self, num_evictable: int) -> None:
        if len(self._heap) > 2 * num_evictable + 1024:
            self._heap = [e for e in self._heap if e[2].host_heap_key == e[1] and e[2].is_host_leaf]
            heapq.heapify(self._heap)

    def valid_blocks(self) -> list[Block]:
        return [b for _, key, b in self._heap if b.host_heap_key == key and b.is_host_leaf]


class HostTier:
    """Host blocks of one pool, the records they hold, and the cost rule for loads."""

    def __init__(
        self, spec: HostSpec, block_size: int, policy: EvictionPolicy, counters: HostCounters
    ) -> None:
        assert spec.num_blocks >= 1, "a host tier has at least one block"
        self.num_blocks = spec.num_blocks
        self.free = FreeBlocks(spec.num_blocks)
        self.index: dict[BlockHash, Block] = {}  # every host-resident record
        self.leaves = HostLeaves(policy)
        self.num_evictable = 0
        self.counters = counters
        self.load_seconds_per_block = spec.load_seconds_per_block
        self.recompute_seconds_per_block = spec.prefill_seconds_per_token * block_size

    @property
    def num_referenced(self) -> int:
        return self.num_blocks - len(self.free) - self.num_evictable

    @property
    def pays_to_load(self) -> bool:
        """Whether copying a host block in is estimated faster than recomputing it
        (unknown costs: load). Both costs are per block, so a run's length cancels."""
        load, recompute = self.load_seconds_per_block, self.recompute_seconds_per_block
        return load <= 0.0 or recompute <= 0.0 or load < recompute

    # ------------------------------------------------------------ references

    def ref(self, block: Block) -> None:
        """A load of `block` starts: it is held until `unref`."""
        assert block.host_block_id is not None, f"load of a block not in the host tier: {block}"
        if block.host_refs == 0:
            self.num_evictable -= 1
        block.host_refs += 1

    def unref(self, block: Block) -> None:
        """A load of `block` ended (committed, or its sequence released)."""
        assert block.host_refs > 0, f"host_refs underflow: {block}"
        block.host_refs -= 1
        if block.host_refs == 0:
            self.num_evictable += 1
            if block.num_host_children == 0:
                self.leaves.push(block)

    # ------------------------------------------------------------ residency

    def place(self, block: Block, host_block_id: HostBlockId) -> None:
        """Make `block` resident in the given (taken) host block."""
        assert block.host_block_id is None and block.block_hash not in self.index, "one record per hash"
        block.host_block_id = host_block_id
        self.index[block.block_hash] = block
        self.num_evictable += 1
        if block.num_host_children == 0:
            self.leaves.push(block)

    def remove(self, block: Block) -> HostBlockId:
        """Drop an unreferenced record's host copy; answers its host block (not freed)."""
        assert block.host_refs == 0 and self.index.get(block.block_hash) is block, f"remove {block}"
        host_block_id = block.host_block_id
        assert host_block_id is not None
        del self.index[block.block_hash]
        block.host_block_id = None
        block.host_heap_key = None
        self.num_evictable -= 1
        return host_block_id

    def child_left(self, parent: Block | None) -> None:
        """A host-only child of `parent` stopped being host-only."""
        if parent is None:
            return
        assert parent.num_host_children > 0, f"host child count underflow: {parent}"
        parent.num_host_children -= 1
        if parent.is_host_leaf:
            self.leaves.push(parent)
