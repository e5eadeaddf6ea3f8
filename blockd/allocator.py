"""The free blocks of one pool, in O(1) memory for a pool that was never filled.

A pool can have 16M blocks; a list of that many ids would cost ~0.5 GB. Free ids are
kept as three parts instead:

    fresh:    ids >= next_fresh that were never handed out ...
    reserved: ... except these (claimed by Resync), skipped when reached
    recycled: ids below next_fresh that came back (a stack: the most recently freed
              block is reused first)
"""

from __future__ import annotations

from collections.abc import Iterable

from blockd.types import BlockId


class FreeBlocks:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._next_fresh = 0
        self._reserved: set[int] = set()
        self._recycled: list[BlockId] = []

    def __len__(self) -> int:
        return len(self._recycled) + self.num_blocks - self._next_fresh - len(self._reserved)

    def take(self, num: int) -> list[BlockId]:
        """`num` free ids (the caller checked there are enough). O(num)."""
        assert 0 <= num <= len(self), f"asked for {num} free blocks, {len(self)} exist"
        start = max(0, len(self._recycled) - num)
        taken = self._recycled[start:]
        del self._recycled[start:]
        missing = num - len(taken)
        if missing and not self._reserved:
            taken.extend(range(self._next_fresh, self._next_fresh + missing))  # type: ignore[arg-type]
            self._next_fresh += missing
        while len(taken) < num:
            block_id = self._next_fresh
            self._next_fresh += 1
            if block_id in self._reserved:
                self._reserved.discard(block_id)  # in use; it comes back through give()
            else:
                taken.append(BlockId(block_id))
        return taken

    def give(self, block_ids: Iterable[BlockId]) -> None:
        """Return ids taken earlier (or reserved). O(len)."""
        for block_id in block_ids:
            if block_id >= self._next_fresh:
                self._reserved.remove(block_id)  # a reserved id rejoins the fresh range
            else:
                self._recycled.append(block_id)

    def give_all(self, block_ids: list[BlockId]) -> None:
        """`give` for ids that were all handed out by `take` (the fast path)."""
        if self._reserved:
            self.give(block_ids)
        else:
            self._recycled.extend(block_ids)

    def reserve(self, block_ids: Iterable[BlockId]) -> None:
        """Mark ids of a never-used allocator as taken (Resync after a reset)."""
        assert self._next_fresh == 0 and not self._recycled, "reserve only on a fresh allocator"
        for block_id in block_ids:
            assert 0 <= block_id < self.num_blocks, f"block id {block_id} out of range"
            self._reserved.add(block_id)

    def free_ids(self) -> set[int]:
        """Every free id (for invariant checks; O(num_blocks))."""
        fresh = set(range(self._next_fresh, self.num_blocks)) - self._reserved
        return fresh | set(self._recycled)
