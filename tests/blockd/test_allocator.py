"""Free blocks: O(1) memory for fresh pools, recycling, and reservations for Resync."""

from __future__ import annotations

from blockd.allocator import FreeBlocks


def test_fresh_then_recycled_most_recent_first():
    free = FreeBlocks(6)
    assert len(free) == 6
    first = free.take(4)
    assert first == [0, 1, 2, 3] and len(free) == 2
    free.give_all([1, 3])  # recycled: [1, 3]
    assert free.take(3) == [1, 3, 4] and len(free) == 1
    assert free.free_ids() == {5}


def test_reserved_ids_are_skipped_and_come_back_when_given():
    free = FreeBlocks(6)
    free.reserve([1, 4])  # held by resynced sequences
    assert len(free) == 4 and free.free_ids() == {0, 2, 3, 5}
    assert free.take(2) == [0, 2]
    free.give([4])  # released while still in the fresh range: fresh again
    assert free.free_ids() == {3, 4, 5}
    assert sorted(free.take(3)) == [3, 4, 5] and len(free) == 0
    free.give([1])
    assert free.free_ids() == {1}


def test_a_huge_pool_costs_nothing_until_used():
    free = FreeBlocks(16_777_216)
    assert len(free) == 16_777_216
    assert free.take(2) == [0, 1]
