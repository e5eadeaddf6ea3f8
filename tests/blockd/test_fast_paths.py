"""The fast paths of bench.blockd_inprocess agree with the plain ones they replace."""

from __future__ import annotations

import random

import pytest

from blockd.admission import _PATTERNS, KeyMemory
from blockd.hashing import truncated_hasher
from blockd.pool import BlockPool
from tests.blockd.helpers import harness, patches_blockd


def _scalar(memory: KeyMemory, keys: list[bytes]) -> None:
    for key in keys:
        memory.add(key)


@pytest.mark.parametrize("capacity", [1, 64, 100, 1_000, 65_536])
@pytest.mark.parametrize("batch", [1, 31, 32, 128, 333])
def test_key_memory_batches_set_the_bytes_one_add_at_a_time_sets(capacity, batch):
    rng = random.Random(capacity * 1_000 + batch)
    batched, single = KeyMemory(capacity), KeyMemory(capacity)
    for _ in range(7):  # several batches: generations roll over inside some of them
        keys = [rng.randbytes(16) for _ in range(batch)]
        batched.add_many(keys)
        _scalar(single, keys)
        assert (batched._young, batched._old, batched._num_young, batched.num_added) == (
            single._young,
            single._old,
            single._num_young,
            single.num_added,
        )


def test_key_memory_batches_of_other_key_lengths_take_the_plain_path():
    rng = random.Random(1)
    keys = [rng.randbytes(rng.choice((8, 16, 20))) for _ in range(100)]
    batched, single = KeyMemory(1_000), KeyMemory(1_000)
    batched.add_many(keys)
    _scalar(single, keys)
    assert batched._young == single._young
    assert all(key in batched for key in keys)


@pytest.mark.parametrize("capacity", [1, 3, 1_000, 65_536, 4_194_304])
def test_key_memory_places_a_key_where_its_128_bit_value_says(capacity):
    """`_slot`'s machine-int arithmetic against the definition: the hash as a little-endian
    128-bit int, modulo the generation's bytes, and its top 6 bits for the pattern."""
    rng = random.Random(capacity)
    memory = KeyMemory(capacity)
    num_bytes = len(memory._young)
    keys = [rng.randbytes(16) for _ in range(2_000)] + [bytes(16), b"\xff" * 16]
    for key in keys:
        x = int.from_bytes(key, "little")
        assert memory._slot(key) == (x % num_bytes, _PATTERNS[(x >> 122) & 63])


def test_a_commit_run_meeting_an_indexed_copy_stops_indexing_there():
    """The bulk commit path is taken only when the whole run is new: a run whose middle
    block is already indexed (a concurrent identical prompt) indexes its blocks before it
    and none from it on, as the block-by-block path does."""
    h = harness(num_blocks=16, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    h.admit(1, tokens)
    h.admit(2, tokens)  # the same prompt while the first is not committed: no hits
    h.commit_full(1, tokens)
    h.commit_full(2, tokens)  # every hash is indexed already: nothing of it is indexed
    pool = h.pool
    assert len(pool.index) == 4
    assert all(block.is_cached for block in pool.sequences[1].committed)
    assert not any(block.is_cached for block in pool.sequences[2].committed)
    h.release(1)
    h.release(2)
    stats = h.directory.stats().total
    assert stats.num_free_blocks + stats.num_evictable_blocks + stats.num_referenced_blocks == 16
    assert stats.num_evictable_blocks == 4


@patches_blockd
def test_commit_runs_with_colliding_hashes_keep_the_invariants(monkeypatch):
    """With 1-byte hashes many runs meet an indexed hash in their middle: the
    block-by-block path indexes the blocks before it and none after (each step checks
    the invariants, `tests.blockd.invariants`)."""
    runs: list[tuple[int, int]] = []  # (blocks indexed, blocks in the run) of the plain path
    by_block = BlockPool._run_by_block

    def recorded(self, run, parent, block_ids, *args):
        loaded = by_block(self, run, parent, block_ids, *args)
        runs.append((len(loaded), len(block_ids)))
        return loaded

    monkeypatch.setattr(BlockPool, "_run_by_block", recorded)
    rng = random.Random(3)
    h = harness(num_blocks=64, block_size=2, hasher=truncated_hasher(1))
    for sequence_id in range(200):
        h.run(sequence_id, [rng.randrange(50) for _ in range(2 * rng.randrange(1, 9))])
    assert any(0 < indexed < num for indexed, num in runs), "a run must stop indexing in its middle"


def test_key_memory_answers_many_as_it_answers_one():
    rng = random.Random(2)
    memory = KeyMemory(1_000)
    known = [rng.randbytes(16) for _ in range(700)]
    memory.add_many(known)  # two generations
    queries = known + [rng.randbytes(16) for _ in range(700)]
    assert memory.contains_many(queries) == [key in memory for key in queries]
    assert all(memory.contains_many(known[-500:]))
