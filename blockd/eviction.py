"""Eviction: which unreferenced cached block goes first.

Only *leaves* are candidates: cached, unreferenced, with no cached child. Evicting a
leaf can turn its parent into a leaf, which then joins the heap, so a chain is
eaten tail first and no cached block is ever left without its parent.

A policy is a one-method object, `priority(block)`; the smallest priority is
evicted first. Policies come from `POLICIES` by name.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from typing import Protocol

from blockd.block import Block


class EvictionPolicy(Protocol):
    def priority(self, block: Block) -> tuple[int, ...]: ...


class LruPolicy:
    """Least recently released first. A release stamps one tick on the sequence's
    whole chain, so a parent is never newer than its children."""

    def priority(self, block: Block) -> tuple[int, ...]:
        return (block.last_tick,)


class LfuPolicy:
    """Fewest verified hits first, least recently released among equals."""

    def priority(self, block: Block) -> tuple[int, ...]:
        return (block.num_hits, block.last_tick)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LruPolicy, "lfu": LfuPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None


class EvictableLeaves:
    """Min-heap of evictable leaves by policy priority, with lazy invalidation.

    `push` stamps the block with a fresh key; an entry is valid only while the
    block still carries that key and is still an evictable leaf. A block that is hit
    again (or gains a cached child) simply leaves a stale entry behind, skipped by
    `pop`; so is one pushed again with a newer priority. Costs: push O(log n), pop
    O(log n) amortised; the heap is rebuilt from its valid entries when stale ones
    outnumber them, which keeps its size O(evictable blocks).
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._heap: list[tuple[tuple[int, ...], int, Block]] = []
        self._keys = count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, block: Block) -> None:
        assert block.is_evictable_leaf, f"only evictable leaves enter the heap: {block}"
        key = next(self._keys)
        block.heap_key = key
        heapq.heappush(self._heap, (self._policy.priority(block), key, block))

    @property
    def priority(self) -> Callable[[Block], tuple[int, ...]]:
        """The policy's priority function (smallest evicted first)."""
        return self._policy.priority

    def first_priority(self) -> tuple[int, ...] | None:
        """The smallest priority in the heap (None when empty). A stale entry may hold
        it, so a block whose priority is below it would be popped first if pushed (a
        pushed block loses ties: its key is the newest), and the heap can skip it."""
        heap = self._heap
        return heap[0][0] if heap else None

    def pop(self) -> Block | None:
        """The evictable leaf of smallest priority, or None when there is none."""
        heap = self._heap
        while heap:
            _, key, block = heapq.heappop(heap)
            if block.heap_key == key and block.is_evictable_leaf:
                block.heap_key = None
                return block
        return None

    def compact(self, num_evictable: int) -> None:
        """Drop stale entries once they dominate (call after operations that hit)."""
        if len(self._heap) > 2 * num_evictable + 1024:
            self._heap = [
                entry for entry in self._heap if entry[2].heap_key == entry[1] and entry[2].is_evictable_leaf
            ]
            heapq.heapify(self._heap)

    def valid_blocks(self) -> list[Block]:
        """Blocks with a valid entry, for invariant checks (O(n))."""
        return [block for _, key, block in self._heap if block.heap_key == key and block.is_evictable_leaf]
