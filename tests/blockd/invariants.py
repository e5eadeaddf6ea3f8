"""Ground-truth checks of the directory's invariants (DESIGN.md), computed from its
state independently of its own counters, plus a canonical snapshot for "changed
nothing" assertions. Shared by the unit tests and the property tests."""

from __future__ import annotations

from collections import Counter

from blockd.directory import BlockDirectory
from blockd.hashing import TOKEN_BYTES, UNSALTED_TAG, salt_tag


def attributes(obj: object) -> dict:
    """An object's attributes by name: `vars(obj)`, or for a compiled blockd class (no
    `__dict__`, blockd.native) the attributes mypyc lays out."""
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    return {name: getattr(obj, name) for name in type(obj).__mypyc_attrs__ if hasattr(obj, name)}


class FakeClock:
    """Seconds that move only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def holders_of(directory: BlockDirectory, pool_id: str) -> tuple[Counter, Counter]:
    """(all holders, pin holders) per block id of one pool."""
    pool = directory._slots[pool_id].pool
    holders: Counter = Counter()
    pins: Counter = Counter()
    for sequence in pool.sequences.values():
        holders.update(sequence.block_ids)
    for pin in directory._pins:
        for block in pin.blocks.get(pool_id, ()):
            holders[block.block_id] += 1
            pins[block.block_id] += 1
    return holders, pins


def check_invariants(directory: BlockDirectory) -> None:
    hasher = directory._hasher
    for pool_id, slot in directory._slots.items():
        pool = slot.pool
        width = pool.block_size * TOKEN_BYTES
        if not slot.is_live:
            assert not pool.sequences and not pool.blocks and not pool.index, (
                f"{pool_id} not live but holds state"
            )
        holders, pin_holders = holders_of(directory, pool_id)

        # Sequences: committed prefix has records chained parent to child with the
        # sequence's tokens; the rest is owned by the sequence alone, without records.
        for sequence in pool.sequences.values():
            table = sequence.block_ids
            assert len(set(table)) == len(table), f"sequence {sequence.sequence_id} holds a block twice"
            assert all(0 <= b < pool.num_blocks for b in table)
            assert len(table) * width >= len(sequence.token_bytes)
            assert sequence.num_committed <= len(table)
            assert sequence.num_committed * width <= len(sequence.token_bytes)
            assert len(sequence.committed) == sequence.num_committed
            parent = None
            for i, block_id in enumerate(table[: sequence.num_committed]):
                block = pool.blocks[block_id]
                assert sequence.committed[i] is block, f"sequence {sequence.sequence_id}: stale record"
                assert block.parent is parent, (
                    f"block {block_id} of sequence {sequence.sequence_id}: wrong parent"
                )
                assert block.depth == i
                assert block.token_bytes == sequence.token_bytes[i * width : (i + 1) * width], (
                    f"block {block_id} content differs from sequence {sequence.sequence_id}'s tokens"
                )
                parent = block
            for block_id in table[sequence.num_committed :]:
                assert block_id not in pool.blocks, f"uncommitted block {block_id} has a record"
                assert holders[block_id] == 1, f"uncommitted block {block_id} is shared"

        # The three states partition the pool, and the counters agree with them.
        free = pool.free.free_ids()
        evictable = {b.block_id for b in pool.index.values() if b.ref_count == 0}
        referenced = set(holders)
        assert not free & evictable and not free & referenced and not evictable & referenced, (
            f"{pool_id}: a block is in two states"
        )
        assert free | evictable | referenced == set(range(pool.num_blocks)), f"{pool_id}: a block leaked"
        assert (pool.num_free, pool.num_evictable, pool.num_referenced) == (
            len(free),
            len(evictable),
            len(referenced),
        )
        assert pool.num_free + pool.num_evictable + pool.num_referenced == pool.num_blocks

        # Records: reference counts equal holders; unreferenced means cached.
        for block_id, block in pool.blocks.items():
            assert block.block_id == block_id
            assert block.ref_count == holders[block_id], f"block {block_id}: ref_count != holders"
            assert block.pin_count == pin_holders[block_id]
            assert block.ref_count > 0 or block.is_cached, f"unreferenced uncached block {block_id} kept"
            assert block.is_cached == (pool.index.get(block.block_hash) is block)
        assert pool.num_pinned == sum(1 for b in pool.blocks.values() if b.pin_count)

        # Index: exact content hashes, cached parents (no orphans), child counts.
        children: Counter = Counter()
        for block_hash, block in pool.index.items():
            assert block.block_hash == block_hash and block.is_cached
            assert pool.blocks.get(block.block_id) is block, "indexed block without its record"
            parent = block.parent
            assert parent is None or (parent.is_cached and pool.blocks.get(parent.block_id) is parent), (
                f"cached block {block.block_id} has an uncached parent (orphan)"
            )
            parent_hash = parent.block_hash if parent is not None else pool.seed
            tag = salt_tag(block.mixed_salt) if block.mixed_salt is not None else UNSALTED_TAG
            assert hasher.block_hash(parent_hash, tag, block.token_bytes) == block_hash, "index key is stale"
            assert block.payload == tag + block.token_bytes, "payload is not the salt tag and the tokens"
            assert block.depth == (0 if parent is None else parent.depth + 1)
            if parent is not None:
                children[parent.block_id] += 1
        for block in pool.index.values():
            assert block.num_cached_children == children[block.block_id], f"child count of {block.block_id}"

        # Every evictable leaf can be found by eviction.
        leaves = {b.block_id for b in pool.index.values() if b.is_evictable_leaf}
        assert {b.block_id for b in pool.leaves.valid_blocks()} == leaves, (
            "an evictable leaf is not in the heap"
        )
        counters = pool.counters
        assert 0 <= counters.hit_tokens <= counters.queried_tokens
        assert sum(counters.miss_tokens.values()) == counters.queried_tokens - counters.hit_tokens, (
            "every uncached admitted token has one miss reason"
        )

        # Ghosts: bounded, never a cached hash; salt-free hashes counted for cached salted blocks.
        ghosts = pool.ghosts
        assert len(ghosts) <= ghosts.capacity
        assert not any(h in ghosts for h in pool.index), "a cached hash is also a ghost"
        salted: Counter = Counter()
        for block in pool.index.values():
            if block.mixed_salt is not None:
                parent_hash = block.parent.block_hash if block.parent is not None else pool.seed
                salted[hasher.block_hash(parent_hash, UNSALTED_TAG, block.token_bytes)] += 1
        assert dict(salted) == ghosts.salted, "salt-free hashes of cached salted blocks"
        if pool.host is not None:
            check_host_tier(pool)


def check_host_tier(pool) -> None:
    """The host tier's accounting, residency and leaf-first structure."""
    host = pool.host
    resident = {b.host_block_id: b for b in host.index.values()}
    assert len(resident) == len(host.index), "two records share a host block"
    free = host.free.free_ids()
    assert not free & set(resident), "a host block is free and resident"
    assert free | set(resident) == set(range(host.num_blocks)), "a host block leaked"
    loading: Counter = Counter()
    for sequence in pool.sequences.values():
        for record in sequence.loading:
            loading[id(record)] += 1
            assert record.host_block_id is not None, "a load from a block the host tier lost"
    evictable = [b for b in host.index.values() if b.host_refs == 0]
    assert host.num_evictable == len(evictable)
    assert len(free) + host.num_evictable + host.num_referenced == host.num_blocks
    host_children: Counter = Counter()
    for block_hash, block in host.index.items():
        assert block.block_hash == block_hash and block.host_block_id is not None
        assert block.host_refs == loading[id(block)], f"host_refs of {block} != loads in flight"
        if block.is_cached:
            assert pool.index.get(block_hash) is block
            continue
        assert block.ref_count == 0, f"host-only {block} is referenced"
        parent = block.parent
        if parent is not None:
            assert (
                pool.index.get(parent.block_hash) is parent or host.index.get(parent.block_hash) is parent
            ), f"host-only {block} lost its parent (orphan)"
            host_children[id(parent)] += 1
    for block in list(pool.index.values()) + list(host.index.values()):
        assert block.num_host_children == host_children[id(block)], f"host child count of {block}"
    leaves = {id(b) for b in host.index.values() if b.is_host_leaf}
    assert {id(b) for b in host.leaves.valid_blocks()} == leaves, "a host leaf is not in the heap"


def _host_snapshot(pool) -> tuple:
    host = pool.host
    if host is None:
        return ()
    return (
        tuple(
            sorted(
                (b.host_block_id, b.block_hash, b.host_refs, b.num_host_children) for b in host.index.values()
            )
        ),
        tuple(sorted(host.free.free_ids())),
        host.num_evictable,
    )


def snapshot(directory: BlockDirectory) -> tuple:
    """Everything observable about the directory's state, canonically ordered."""
    pools = []
    for pool_id, slot in sorted(directory._slots.items()):
        pool = slot.pool
        pools.append(
            (
                pool_id,
                slot.epoch,
                slot.is_live,
                slot.lease_expires_at,
                slot.worker_address,
                pool.num_blocks,
                pool.block_size,
                tuple(
                    sorted(
                        (s.sequence_id, tuple(s.block_ids), s.num_committed, s.token_bytes, s.salt)
                        for s in pool.sequences.values()
                    )
                ),
                tuple(
                    sorted(
                        (
                            b.block_id,
                            b.block_hash,
                            b.ref_count,
                            b.pin_count,
                            b.is_cached,
                            b.last_tick,
                            b.num_hits,
                            b.num_cached_children,
                        )
                        for b in pool.blocks.values()
                    )
                ),
                tuple(sorted(pool.index)),
                tuple(sorted(pool.free.free_ids())),
                pool.num_free,
                pool.num_evictable,
                pool.num_referenced,
                pool.num_pinned,
                _host_snapshot(pool),
                tuple(sorted(attributes(pool.counters).items())),
            )
        )
    pins = tuple(
        sorted(
            (
                p.pin_id,
                p.expires_at,
                tuple(sorted((k, tuple(b.block_id for b in v)) for k, v in p.blocks.items())),
            )
            for p in directory._pins
        )
    )
    return tuple(pools), pins, directory.events.last_sequence
