"""The shared tier in the directory core: write-through stores findable only once the
worker reports them written, fetches on any pool of the namespace, failed writes and
missing values, salts, the admission rule, the cost rule, rebuild and flush."""

from __future__ import annotations

import xxhash

from blockd.events import EventKind
from blockd.hashing import BlockHasher
from blockd.shared_tier import SharedRecord
from blockd.types import AdmitOp, CommitOp, HostSpec, ReleaseOp, Tier
from tests.blockd.helpers import NAMESPACE, Harness, harness

BS = 2
A = [1, 2, 3, 4, 5, 6]  # three blocks
SHARED = HostSpec(has_shared_tier=True)


def two_pools(hasher: BlockHasher | None = None, **config) -> tuple[Harness, Harness]:
    if hasher is not None:
        config["hasher"] = hasher
    a = harness(num_blocks=16, block_size=BS, host=SHARED, **config)
    reg = a.directory.register_pool(16, BS, NAMESPACE, "worker-1:50052", host=SHARED)
    return a, Harness(a.directory, a.clock, reg.pool_id, reg.epoch, BS)


def stored_on(h: Harness, sequence_id: int, tokens: list[int], salt: str = "") -> tuple:
    """Run the prompt on `h`: answers the shared tier stores its commit asked for."""
    result = h.admit(sequence_id, tokens, salt)
    table = h.tables[sequence_id]
    first, last = result.num_cached_tokens // BS, len(tokens) // BS
    step = h.step(commits=[CommitOp(sequence_id, table[first:last], tokens[first * BS : last * BS])])
    h.release(sequence_id)
    return step.shared_stores


def test_a_committed_block_is_findable_on_another_pool_once_written():
    a, b = two_pools()
    stores = stored_on(a, 1, A)
    assert len(stores) == 3
    assert [s.depth for s in stores] == [0, 1, 2] and stores[0].parent_hash is None
    # Not findable before the worker says the bytes are there.
    assert b.directory.lookup(A, pool_id=b.pool_id)[0].num_cached_tokens == 0
    a.step(shared_written=[s.block_hash for s in stores])
    match = b.directory.lookup(A, pool_id=b.pool_id)[0]
    assert (match.num_cached_tokens, match.num_shared_cached_tokens) == (6, 6)
    admitted = b.admit(7, A + [9])
    assert admitted.num_cached_tokens == 6
    assert [s.block_hash for s in admitted.shared_loads] == [s.block_hash for s in stores]
    assert [s.block_id for s in admitted.shared_loads] == list(admitted.block_ids[:3])
    # The fetched blocks are b's own until committed; their commit stores nothing again.
    step = b.step(commits=[CommitOp(7, admitted.block_ids[:3], A)])
    assert step.shared_stores == ()
    demoted = [e for e in a.directory.events.read(0) if e.kind is EventKind.DEMOTED]
    assert [(e.tier, len(e.block_hashes)) for e in demoted] == [(Tier.SHARED, 3)]
    stats = a.directory.stats(b.pool_id).total.shared
    assert (stats.num_loads, stats.hit_tokens, stats.num_blocks) == (3, 6, 3)


def test_route_weighs_a_shared_hit_below_a_device_hit():
    a, b = two_pools()
    a.step(shared_written=[s.block_hash for s in stored_on(a, 1, A)])
    route = a.directory.route(A)
    assert route.pool_id == a.pool_id  # a holds it in its device pool, b only through the store
    assert {m.pool_id: m.num_shared_cached_tokens for m in route.candidates} == {a.pool_id: 0, b.pool_id: 6}


def test_a_failed_write_is_never_findable_and_a_missing_value_drops_the_chain():
    a, b = two_pools()
    stores = stored_on(a, 1, A)
    a.step(shared_written=[stores[0].block_hash], shared_failed=[s.block_hash for s in stores[1:]])
    assert b.directory.lookup(A, pool_id=b.pool_id)[0].num_shared_cached_tokens == 2
    # The second block is asked again by the next commit of that content.
    assert len(a.directory.shared.index_for(a.pool.seed)) == 1
    a.step(shared_written=[s.block_hash for s in stores[1:]])  # too late: forgotten
    assert len(a.directory.shared.index_for(a.pool.seed)) == 1
    b.step(shared_missing=[stores[0].block_hash])
    assert b.directory.lookup(A, pool_id=b.pool_id)[0].num_shared_cached_tokens == 0
    removed = [e for e in a.directory.events.read(0) if e.kind is EventKind.REMOVED and e.tier is Tier.SHARED]
    assert [e.block_hashes for e in removed] == [(stores[0].block_hash,)]
    assert a.directory.stats(b.pool_id).total.shared.num_evictions == 1


def test_a_child_whose_parent_never_made_it_stays_unfindable():
    a, _b = two_pools()
    stores = stored_on(a, 1, A)
    a.step(shared_written=[s.block_hash for s in stores[1:]], shared_failed=[stores[0].block_hash])
    assert len(a.directory.shared.index_for(a.pool.seed)) == 0


# Blind to the parent: a block's hash is its own tokens', so equal blocks under other
# prefixes collide (as any hash may), the case only the records' parent links tell apart.
BLIND = BlockHasher(digest=lambda data: xxhash.xxh3_128_digest(data[-BS * 4 :]))


def test_a_write_under_a_colliding_parent_hash_never_joins_the_other_chain():
    """B = [7, 8] [3, 4] [9, 10]: its middle block's hash is A's middle block's (same
    tokens, other prefix), so its last block's parent hash names A's record. Linked by
    that hash, [9, 10]'s K/V (computed after [7, 8]) would be served to A's prompts; it
    must not be written at all (it could never be found on its own chain)."""
    a, b = two_pools(BLIND)
    a.step(shared_written=[s.block_hash for s in stored_on(a, 1, A)])
    a.directory.flush(tier=Tier.DEVICE)  # A stays in the store only: B's chain is cached whole
    b_chain = [7, 8, 3, 4, 9, 10]
    stores = stored_on(a, 2, b_chain)
    a.step(shared_written=[s.block_hash for s in stores])
    # A's prefix with B's last block: only A's own two blocks are in the store.
    assert b.directory.lookup([1, 2, 3, 4, 9, 10], pool_id=b.pool_id)[0].num_shared_cached_tokens == 4
    assert [s.depth for s in stores] == [0]  # [3, 4]'s hash is A's; [9, 10] has no parent record
    assert b.directory.lookup(A, pool_id=b.pool_id)[0].num_shared_cached_tokens == 6
    assert b.directory.lookup(b_chain, pool_id=b.pool_id)[0].num_shared_cached_tokens == 2


def test_salted_blocks_never_cross_tenants():
    a, b = two_pools()
    a.step(shared_written=[s.block_hash for s in stored_on(a, 1, A, salt="t1")])
    assert b.directory.lookup(A, "t2", pool_id=b.pool_id)[0].num_cached_tokens == 0
    assert b.directory.lookup(A, pool_id=b.pool_id)[0].num_cached_tokens == 0
    assert b.directory.lookup(A, "t1", pool_id=b.pool_id)[0].num_shared_cached_tokens == 6
    a.step(shared_written=[s.block_hash for s in stored_on(a, 2, A)])
    flushed = a.directory.flush(cache_salt="t1", tier=Tier.SHARED)
    assert flushed.tiers == ((Tier.SHARED, 3, 0),) and len(flushed.shared_keys) == 3
    assert flushed.shared_namespaces == ()  # a salted flush deletes that chain's keys only
    assert b.directory.lookup(A, pool_id=b.pool_id)[0].num_shared_cached_tokens == 6


def test_flush_of_the_shared_tier_names_the_namespace_for_the_store():
    a, _ = two_pools()
    a.step(shared_written=[s.block_hash for s in stored_on(a, 1, A)])
    flushed = a.directory.flush(tier=Tier.SHARED)
    assert flushed.tiers == ((Tier.SHARED, 3, 0),)
    assert flushed.shared_namespaces == (a.pool.seed,)
    everything = a.directory.flush()
    assert {t for t, _, _ in everything.tiers} == {Tier.DEVICE, Tier.SHARED}


def test_a_write_reported_after_a_flush_stays_unfindable():
    # The worker's write finished before the flush deleted the namespace's keys, its
    # report came after: confirming it would make a record of a value no longer there.
    a, b = two_pools()
    stores = stored_on(a, 1, A)
    a.directory.flush(tier=Tier.SHARED)
    late = a.step(shared_written=[s.block_hash for s in stores])
    assert b.directory.lookup(A, pool_id=b.pool_id)[0].num_cached_tokens == 0
    assert a.directory.stats(a.pool_id).total.shared.num_blocks == 0
    # The keys those writes left in the store are named once, for blockd to delete.
    assert late.shared_orphans == tuple((a.pool.seed, s.block_hash) for s in stores)
    assert a.step(shared_written=[s.block_hash for s in stores]).shared_orphans == ()
    # A salted flush forgets only its own chains' writes in flight.
    salted = stored_on(a, 2, A, salt="t1")
    plain = stored_on(a, 3, [7, 8, 9, 10])
    a.directory.flush(cache_salt="t1", tier=Tier.SHARED)
    late = a.step(shared_written=[s.block_hash for s in salted + plain])
    assert a.directory.stats(a.pool_id).total.shared.num_blocks == 2
    assert late.shared_orphans == tuple((a.pool.seed, s.block_hash) for s in salted)


def test_with_seen_twice_a_block_goes_to_the_store_on_its_second_sighting():
    a, _b = two_pools(demote_min_hits=1)
    assert stored_on(a, 1, A) == ()
    again = a.step(admits=[AdmitOp(2, A + [9])])
    assert len(again.shared_stores) == 3 and again.admits[0].num_cached_tokens == 6


def test_a_fetch_estimated_slower_than_recompute_is_skipped():
    a = harness(num_blocks=16, block_size=BS, host=SHARED)
    slow = HostSpec(has_shared_tier=True, shared_load_seconds_per_block=1.0, prefill_seconds_per_token=1e-3)
    reg = a.directory.register_pool(16, BS, NAMESPACE, "worker-1:50052", host=slow)
    b = Harness(a.directory, a.clock, reg.pool_id, reg.epoch, BS)
    a.step(shared_written=[s.block_hash for s in stored_on(a, 1, A)])
    admitted = b.admit(3, A + [9])
    assert admitted.num_cached_tokens == 0 and admitted.shared_loads == ()
    assert a.directory.stats(b.pool_id).total.shared.num_loads_skipped == 1


def test_a_rebuild_links_records_by_parent_and_leaves_orphans_out():
    a, _b = two_pools()
    stores = stored_on(a, 1, A)
    records = [_read_back(s) for s in stores]
    fresh = harness(num_blocks=16, block_size=BS, host=SHARED)
    assert fresh.directory.load_shared(fresh.pool.seed, records[1:]) == 0  # no first block: orphans
    assert fresh.directory.load_shared(fresh.pool.seed, records) == 3
    assert fresh.directory.lookup(A)[0].num_shared_cached_tokens == 6


def _read_back(stored) -> SharedRecord:
    """The record a rebuild reads from the header a worker wrote for `stored`."""
    return SharedRecord(
        stored.block_hash,
        stored.parent_hash,
        stored.token_bytes,
        stored.salt_digest,
        stored.depth,
        stored.chain_digest,
    )


def test_a_rebuild_never_links_a_value_under_another_chains_block_of_the_same_hash():
    """A = [1, 2] [3, 4] [5, 6] and B = [7, 8] [3, 4] [9, 10] under a hash blind to the
    parent: both middle blocks hash alike, so the store holds one value under that key
    (A's here) and B's last block names it as its parent. Linked by that hash after a
    restart, [9, 10]'s K/V (computed after [7, 8]) would serve A's prefix; its chain
    digest does not chain from A's block, so it stays out."""
    b_chain = [7, 8, 3, 4, 9, 10]
    a_stores = stored_on(harness(num_blocks=16, block_size=BS, host=SHARED, hasher=BLIND), 1, A)
    b_stores = stored_on(harness(num_blocks=16, block_size=BS, host=SHARED, hasher=BLIND), 1, b_chain)
    assert a_stores[1].block_hash == b_stores[1].block_hash  # the collision
    assert b_stores[2].parent_hash == a_stores[1].block_hash
    fresh = harness(num_blocks=16, block_size=BS, host=SHARED, hasher=BLIND)
    records = [_read_back(s) for s in (*a_stores, b_stores[0], b_stores[2])]
    assert fresh.directory.load_shared(fresh.pool.seed, records) == 4  # B's last block left out
    assert fresh.directory.lookup([1, 2, 3, 4, 9, 10])[0].num_shared_cached_tokens == 4
    assert fresh.directory.lookup(A)[0].num_shared_cached_tokens == 6
    assert fresh.directory.lookup(b_chain)[0].num_shared_cached_tokens == 2


def test_a_reset_pool_forgets_its_writes_in_flight():
    a, b = two_pools()
    stores = stored_on(a, 1, A)
    a.directory.register_pool(
        16, BS, NAMESPACE, "worker-0:50052", pool_id=a.pool_id, pool_token=a.pool_token, host=SHARED
    )
    assert a.directory.shared.index_for(a.pool.seed).pending == {}
    # b computing the same content is asked to store it now.
    assert len(stored_on(b, 1, A)) == len(stores)


def test_the_index_forgets_its_least_recently_used_chains_past_its_bound():
    a, b = two_pools(shared_index_max_blocks=4)
    first = [s.block_hash for s in stored_on(a, 1, A)]
    a.step(shared_written=first)
    b.admit(2, A + [9])  # A's chain is used: most recent
    other = [20, 21, 22, 23]  # two more blocks: one too many
    a.step(shared_written=[s.block_hash for s in stored_on(a, 3, other)])
    shared = a.directory.shared.index_for(a.pool.seed)
    # index, least recent first: A2 A1 A0 (touched child first) O0 O1 -> A's tail goes
    assert len(shared) == 4 and shared.num_forgotten == 1
    assert b.directory.lookup(A, pool_id=b.pool_id)[0].num_shared_cached_tokens == 4
    assert b.directory.lookup(other, pool_id=b.pool_id)[0].num_shared_cached_tokens == 4
    removed = [e for e in a.directory.events.read(0) if e.kind is EventKind.REMOVED and e.tier is Tier.SHARED]
    assert sum(len(e.block_hashes) for e in removed) == shared.num_forgotten


def test_an_admission_hashes_the_device_hits_once_across_tiers():
    """The shared tier's walk goes on from the device hits' known hashes instead of
    hashing the prompt again from block 0 (issue 43: one hash walk per admission)."""
    calls = []

    def digest(data: bytes) -> bytes:
        calls.append(data)
        return xxhash.xxh3_128_digest(data)

    a = harness(num_blocks=16, block_size=BS, host=SHARED, hasher=BlockHasher(digest))
    reg = a.directory.register_pool(16, BS, NAMESPACE, "worker-1:50052", host=SHARED)
    b = Harness(a.directory, a.clock, reg.pool_id, reg.epoch, BS)
    a.step(shared_written=[s.block_hash for s in stored_on(a, 1, A)])  # all 3 blocks in the shared tier
    table = b.admit(1, A[:BS]).block_ids  # fetched from the shared tier, then committed:
    b.step(commits=[CommitOp(1, table, A[:BS])], releases=[ReleaseOp(1)])  # b holds block 0
    calls.clear()
    admitted = b.directory.step(b.pool_id, b.epoch, admits=[AdmitOp(2, A + [9])]).admits[0]  # no checks
    assert admitted.num_cached_tokens == 3 * BS and len(admitted.shared_loads) == 2
    # device: a probe of block 0, then its walk (block 0 hit, block 1 missed); shared:
    # blocks 1 and 2 only (block 0's hash is known). Hashing from block 0 again made it 6.
    assert len(calls) == 5, len(calls)
