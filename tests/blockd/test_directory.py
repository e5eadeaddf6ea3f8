"""The pure directory core: hits, sharing, eviction order, salts, collisions, pins,
flush, leases, events. Block size 4 unless said otherwise; `A0..` name blocks."""

from __future__ import annotations

import pytest

from blockd.block import Block
from blockd.directory import BlockDirectory
from blockd.events import EventKind
from blockd.eviction import LruPolicy
from blockd.hashing import BlockHasher, token_bytes
from blockd.types import (
    AdmitOp,
    CommitOp,
    GrowOp,
    InvalidArgument,
    Namespace,
    NotFound,
    ReleaseOp,
    ResourceExhausted,
    ResyncSequence,
    StaleEpoch,
)
from tests.blockd.helpers import NAMESPACE, harness
from tests.blockd.invariants import check_invariants, snapshot

A = list(range(100, 112))  # 12 tokens: 3 full blocks
B = list(range(200, 212))


def test_same_prompt_twice_hits_every_full_block():
    h = harness()
    prompt = A + [7, 8]  # 3 full blocks + a partial tail of 2
    first = h.run(1, prompt)
    assert first.num_cached_tokens == 0 and len(first.block_ids) == 4
    second = h.admit(2, prompt)
    assert second.num_cached_tokens == 12
    assert second.block_ids[:3] == first.block_ids[:3]  # the same physical blocks
    assert second.block_ids[3] not in second.block_ids[:3]  # the tail got its own block
    stats = h.directory.stats().total
    assert (stats.queried_tokens, stats.hit_tokens) == (28, 12)  # tokens, not requests


def test_block_aligned_prompt_is_fully_cached():
    h = harness()
    h.run(1, A)
    assert h.admit(2, A).num_cached_tokens == len(A)


def test_shared_prefix_hits_exactly_the_shared_full_blocks():
    h = harness()
    first = h.run(1, A)
    # shares 6 tokens: block 0 fully, block 1 only half -> exactly one block hits
    other = A[:6] + [999] * 6
    result = h.admit(2, other)
    assert result.num_cached_tokens == 4
    assert result.block_ids[0] == first.block_ids[0]
    assert not set(result.block_ids[1:]) & set(first.block_ids)
    assert h.directory.lookup(other)[0].num_cached_tokens == 4


def test_unrelated_prompts_do_not_hit():
    h = harness()
    h.run(1, A)
    assert h.admit(2, B).num_cached_tokens == 0
    assert h.admit(3, [A[0]] + B[1:]).num_cached_tokens == 0  # first block differs


def test_partial_tail_is_never_hashed_or_found():
    h = harness()
    h.run(1, A[:6])  # 1 full block + 2-token tail
    assert len(h.pool.index) == 1
    assert h.admit(2, A[:6]).num_cached_tokens == 4


def test_lru_evicts_the_least_recently_released_chain_tail_first():
    h = harness(num_blocks=6, block_size=2)
    h.run(1, [1, 2, 3, 4])  # a0 <- a1, released at tick 1
    h.run(2, [5, 6, 7, 8])  # b0 <- b1, released at tick 2
    # free: 2 | evictable leaves: a1(t1), b1(t2); a0 and b0 wait for their children
    seen = h.directory.events.last_sequence
    h.admit(3, [9, 10, 11, 12, 13, 14, 15, 16])  # needs 4: 2 free + evict 2
    removed = [e for e in h.directory.events.read(seen) if e.kind is EventKind.REMOVED]
    chain_a = h.directory.lookup([1, 2, 3, 4])  # a is gone, b is whole
    assert chain_a[0].num_cached_tokens == 0
    assert h.directory.lookup([5, 6, 7, 8])[0].num_cached_tokens == 4
    assert [len(e.block_hashes) for e in removed] == [2]
    a_hashes = h.directory._hasher.chain(h.pool.seed, _bytes([1, 2, 3, 4]), 2)
    assert removed[0].block_hashes == (a_hashes[1], a_hashes[0])  # child a1 before parent a0


def test_eviction_never_takes_a_referenced_block():
    h = harness(num_blocks=4, block_size=2)
    held = h.admit(1, [1, 2, 3, 4])  # referenced, not released
    h.commit_full(1, [1, 2, 3, 4])
    h.run(2, [5, 6])  # one evictable block
    # referenced: h0 h1 | evictable: b0 | free: 1
    result = h.admit(3, [7, 8, 9, 10])
    assert result.admitted  # took the free block and evicted b0, not the referenced ones
    assert not set(result.block_ids) & set(held.block_ids)
    assert h.directory.lookup([1, 2, 3, 4])[0].num_cached_tokens == 4
    assert h.directory.lookup([5, 6])[0].num_cached_tokens == 0
    assert not h.admit(5, [9, 9]).admitted  # everything is referenced now


def test_leaf_first_even_when_the_policy_ranks_the_parent_first():
    """With a policy that prefers shallow blocks, the heap still offers only leaves."""

    class RootFirst(LruPolicy):
        def priority(self, block: Block) -> tuple[int, ...]:
            return (block.depth,)

    h = harness(num_blocks=3, block_size=2)
    pool = h.pool
    pool.leaves._policy = RootFirst()
    chain = h.run(1, [1, 2, 3, 4, 5, 6]).block_ids  # c0 <- c1 <- c2, all evictable, only c2 a leaf
    assert h.admit(2, [7, 8]).block_ids == (chain[2],)
    assert h.admit(3, [9, 9]).block_ids == (chain[1],)
    assert h.directory.lookup([1, 2, 3, 4, 5, 6])[0].num_cached_tokens == 2  # c0 still cached


def test_hits_are_referenced_before_misses_are_allocated():
    # pool of 3: prompt P (2 blocks) cached and evictable; admitting P + 1 more block
    # needs 3 blocks: 2 hits + 1 free. Allocating first could evict the hits.
    h = harness(num_blocks=3, block_size=2)
    h.run(1, [1, 2, 3, 4])
    # free: 1 | evictable: p0 <- p1
    result = h.admit(2, [1, 2, 3, 4, 5, 6])
    assert result.admitted and result.num_cached_tokens == 4
    assert h.pool.num_evictable == 0 and h.pool.num_free == 0


def test_salts_isolate_tenants():
    h = harness()
    h.run(1, A, salt="tenant-a")
    assert h.admit(2, A).num_cached_tokens == 0  # unsalted
    assert h.admit(3, A, salt="tenant-b").num_cached_tokens == 0
    assert h.admit(4, A, salt="tenant-a").num_cached_tokens == 12


def test_salt_encoding_is_unambiguous():
    hasher = BlockHasher()
    seed = hasher.namespace_seed(NAMESPACE, 4)
    data = _bytes(A)
    assert hasher.chain(seed, data, 4, "ab") != hasher.chain(seed, data, 4, "a")
    assert hasher.chain(seed, data, 4, "") == hasher.chain(seed, data, 4)


def test_salt_scope_shares_only_the_public_prefix():
    h = harness(num_blocks=32)
    # public prefix of 8 tokens = blocks 0 and 1; the salt is mixed into block 2
    h.run(1, A, salt="tenant-a", public=8)
    assert h.admit(2, A, salt="tenant-b", public=8).num_cached_tokens == 8
    assert h.admit(3, A, salt="tenant-a", public=8).num_cached_tokens == 12
    # a public prefix ending inside block 1 mixes the salt into block 1
    assert h.admit(4, A, salt="tenant-b", public=6).num_cached_tokens == 4
    infos = h.directory.list_blocks().blocks
    assert sum(b.is_salted for b in infos) == 1  # only block 2 of the first chain so far


def test_forced_collision_costs_a_miss_never_wrong_blocks():
    """Every hash collides: only exact verification keeps sequences apart."""
    h = harness(hasher=BlockHasher(digest=lambda data: bytes(16)))
    first = h.run(1, A)
    other = h.admit(2, B)
    assert other.num_cached_tokens == 0  # B's block 0 hash equals A's block 0 entry: rejected
    salted = h.admit(3, A, salt="x")
    assert salted.num_cached_tokens == 0  # same tokens, other salt: rejected
    again = h.admit(4, A)
    # block 0 verifies; block 1's hash points at A0 itself (parent mismatch): a miss
    assert again.num_cached_tokens == 4
    assert again.block_ids[0] == first.block_ids[0]


def test_collision_with_equal_tokens_under_another_parent_is_a_miss():
    h = harness(hasher=BlockHasher(digest=lambda data: bytes(16)))
    h.run(1, [1, 2, 3, 4, 5, 6, 7, 8])  # only X0 is indexed (every hash collides)
    # block 1 has X0's tokens and X0's hash, but its parent must be X0, not None
    result = h.admit(2, [1, 2, 3, 4, 1, 2, 3, 4])
    assert result.num_cached_tokens == 4
    assert len(set(result.block_ids)) == 2


def test_failed_admission_changes_nothing():
    h = harness(num_blocks=5, block_size=2)
    h.run(1, [1, 2, 3, 4])  # evictable: p0 <- p1
    h.admit(2, [9, 9, 9, 9, 9])  # holds 3 blocks; free: 0
    before = snapshot(h.directory)
    result = h.admit(3, [1, 2, 3, 4, 5, 6])  # 2 hits + 1 miss: nothing left to allocate
    assert not result.admitted and result.block_ids == ()
    after = snapshot(h.directory)
    assert _without_counters(after) == _without_counters(before)
    assert h.directory.stats().total.num_admissions_deferred == 1


def test_bad_op_in_a_step_changes_nothing():
    h = harness()
    r = h.admit(1, A)
    before = snapshot(h.directory)
    with pytest.raises(InvalidArgument):
        h.directory.step(
            h.pool_id,
            h.epoch,
            commits=[CommitOp(1, r.block_ids[:1], A[:4])],  # valid
            admits=[AdmitOp(2, [])],
        )  # invalid: empty
    assert snapshot(h.directory) == before


def test_commit_validation():
    h = harness()
    r = h.admit(1, A + [1])
    ids = r.block_ids
    cases = [
        (CommitOp(1, ids[:1], A[:3]), InvalidArgument, "partial block"),
        (CommitOp(1, [999], A[:4]), InvalidArgument, "foreign block"),
        (CommitOp(1, ids[1:2], A[4:8]), InvalidArgument, "first uncommitted"),
        (CommitOp(1, ids[:1], [0, 0, 0, 0]), InvalidArgument, "differ from the sequence's prompt"),
        (CommitOp(7, ids[:1], A[:4]), NotFound, "not live"),
    ]
    for op, error, text in cases:
        before = snapshot(h.directory)
        with pytest.raises(error, match=text):
            h.directory.step(h.pool_id, h.epoch, commits=[op])
        assert snapshot(h.directory) == before
    # the prompt's tail block may be committed once generated tokens fill it
    h.step(commits=[CommitOp(1, ids[:3], A)])
    h.step(grows=[GrowOp(1, 16)])
    with pytest.raises(InvalidArgument, match="differ"):
        h.directory.step(h.pool_id, h.epoch, commits=[CommitOp(1, ids[3:4], [2, 50, 51, 52])])
    h.step(commits=[CommitOp(1, ids[3:4], [1, 50, 51, 52])])
    with pytest.raises(InvalidArgument, match="every block is committed"):
        h.directory.step(h.pool_id, h.epoch, commits=[CommitOp(1, ids[3:4], [1, 50, 51, 52])])


def test_release_and_admit_errors():
    h = harness(num_blocks=4, max_sequence_tokens=64)
    h.admit(1, A)
    with pytest.raises(InvalidArgument, match="already live"):
        h.directory.step(h.pool_id, h.epoch, admits=[AdmitOp(1, B)])
    h.release(1)
    with pytest.raises(NotFound, match="not live"):
        h.directory.step(h.pool_id, h.epoch, releases=[ReleaseOp(1)])
    with pytest.raises(NotFound):
        h.directory.step(h.pool_id, h.epoch, releases=[ReleaseOp(5)])
    with pytest.raises(ResourceExhausted, match="only 4 blocks"):
        h.directory.step(h.pool_id, h.epoch, admits=[AdmitOp(2, list(range(17)))])
    with pytest.raises(InvalidArgument, match="exceed the limit of 64"):
        h.directory.step(h.pool_id, h.epoch, admits=[AdmitOp(2, list(range(65)))])
    with pytest.raises(InvalidArgument, match="0 .. 4294967295"):
        h.directory.step(h.pool_id, h.epoch, admits=[AdmitOp(2, [-1])])
    # a release frees the id for an admit of the same step; a double release in one step is refused
    h.admit(3, A)
    h.step(releases=[ReleaseOp(3)], admits=[AdmitOp(3, B)])
    with pytest.raises(NotFound):
        h.directory.step(h.pool_id, h.epoch, releases=[ReleaseOp(3), ReleaseOp(3)])


def test_grow():
    h = harness(num_blocks=4, block_size=4)
    r = h.admit(1, A[:5])  # 2 blocks
    result = h.step(grows=[GrowOp(1, 8)]).grows[0]
    assert result.grown and result.new_block_ids == ()
    result = h.step(grows=[GrowOp(1, 9)]).grows[0]
    assert result.grown and len(result.new_block_ids) == 1
    assert h.admit(2, B[:4]).admitted  # the last block
    assert not h.step(grows=[GrowOp(1, 13)]).grows[0].grown  # full: not an error
    with pytest.raises(ResourceExhausted):
        h.directory.step(h.pool_id, h.epoch, grows=[GrowOp(1, 17)])
    assert r.admitted


def test_identical_concurrent_misses_keep_the_first_index_entry():
    h = harness()
    r1 = h.admit(1, A)
    r2 = h.admit(2, A)  # nothing committed yet: a second copy
    assert r2.num_cached_tokens == 0 and not set(r1.block_ids) & set(r2.block_ids)
    h.commit_full(1, A)
    h.commit_full(2, A)
    assert len(h.pool.index) == 3 and len(h.pool.blocks) == 6
    h.release(2)  # the copy is not findable: straight back to free
    assert h.pool.num_free == 16 - 3
    h.release(1)
    assert h.admit(3, A).block_ids == r1.block_ids


def test_flush_reports_dropped_and_busy():
    h = harness()
    h.run(1, A)  # 3 cached, unreferenced
    h.run(2, B, salt="s")  # 3 cached, salted
    r = h.admit(3, B, salt="s")  # now referenced again
    assert r.num_cached_tokens == 12
    result = h.directory.flush(cache_salt="s")
    assert (result.dropped, result.busy) == (0, 3)
    result = h.directory.flush()
    assert (result.dropped, result.busy) == (3, 3)
    assert h.directory.lookup(A)[0].num_cached_tokens == 0
    check_invariants(h.directory)
    h.release(3)
    assert h.directory.flush(h.pool_id).dropped == 3
    assert h.pool.num_free == 16


def test_flush_of_a_salt_keeps_the_public_prefix():
    h = harness()
    h.run(1, A, salt="s", public=4)  # public b0 <- salted b1 <- b2
    assert h.directory.flush(cache_salt="s").dropped == 2
    assert h.directory.lookup(A, "s", 4)[0].num_cached_tokens == 4
    check_invariants(h.directory)


def test_pins_protect_from_eviction_and_expire():
    h = harness(num_blocks=4, block_size=4, lease_ttl_seconds=1000, pin_budget=1.0)
    h.run(1, A)  # 3 cached blocks
    pin = h.directory.pin(A, ttl_seconds=60)
    assert (pin.num_pinned_tokens, pin.num_pinned_blocks) == (12, 3)
    stats = h.directory.stats().total
    assert (stats.num_pinned_blocks, stats.num_referenced_blocks, stats.num_evictable_blocks) == (3, 3, 0)
    assert not h.admit(2, B[:8]).admitted  # only 1 free block: the pinned ones stay
    assert h.directory.flush().busy == 3
    h.clock.advance(59)
    assert h.directory.expire_pins() == []
    h.clock.advance(2)
    assert h.directory.expire_pins() == [pin.pin_id]
    check_invariants(h.directory)
    assert h.admit(3, B[:8]).admitted  # now evictable
    with pytest.raises(NotFound):
        h.directory.unpin(pin.pin_id)


def test_unpin_and_pin_ttl_validation():
    h = harness()
    h.run(1, A)
    pin = h.directory.pin(A[:8])
    assert pin.expires_in_seconds == 3600 and pin.num_pinned_blocks == 2
    assert h.directory.unpin(pin.pin_id) == 2
    assert h.pool.num_pinned == 0 and h.pool.num_evictable == 3
    for ttl in (-1, 31 * 86400, float("nan")):
        with pytest.raises(InvalidArgument, match="ttl_seconds"):
            h.directory.pin(A, ttl_seconds=ttl)


def test_lease_expiry_frees_everything_and_refuses_the_old_epoch():
    h = harness(lease_ttl_seconds=10)
    h.run(1, A)
    h.admit(2, B)
    pin = h.directory.pin(A)
    h.clock.advance(9)
    h.directory.renew_lease(h.pool_id, h.epoch)
    h.clock.advance(9)
    assert h.directory.expire_leases() == []
    h.clock.advance(2)
    assert h.directory.expire_leases() == [h.pool_id]
    check_invariants(h.directory)
    stats = h.directory.stats(h.pool_id).total
    assert (stats.num_free_blocks, stats.num_sequences, stats.num_cached_blocks) == (16, 0, 0)
    with pytest.raises(StaleEpoch, match="RegisterPool"):
        h.directory.step(h.pool_id, h.epoch, releases=[ReleaseOp(2)])
    with pytest.raises(StaleEpoch):
        h.directory.renew_lease(h.pool_id, h.epoch)
    with pytest.raises(NotFound):
        h.directory.renew_lease("pool-unknown", 1)
    assert h.directory.unpin(pin.pin_id) == 0  # its blocks went with the pool
    info = h.directory.list_pools()[0]
    assert not info.is_live and info.lease_remaining_seconds < 0
    assert h.directory.lookup(A) == ()
    # re-registering the same id revives it under a newer epoch
    reg = h.directory.register_pool(16, 4, NAMESPACE, "worker-0:50052", pool_id=h.pool_id)
    assert reg.epoch > h.epoch
    h.epoch = reg.epoch
    assert h.admit(3, A).num_cached_tokens == 0
    kinds = [e.kind for e in h.directory.events.read(0)]
    assert kinds.count(EventKind.CLEARED) == 1


def test_a_lapsed_lease_is_refused_even_before_the_expiry_task_runs():
    h = harness(lease_ttl_seconds=5)
    h.clock.advance(6)
    with pytest.raises(StaleEpoch):
        h.directory.step(h.pool_id, h.epoch)
    check_invariants(h.directory)


def test_step_renews_the_lease():
    h = harness(lease_ttl_seconds=5)
    for _ in range(4):
        h.clock.advance(4)
        h.step()
    assert h.directory.expire_leases() == []


def test_reregister_resets_the_pool():
    h = harness()
    h.run(1, A)
    reg = h.directory.register_pool(8, 4, NAMESPACE, "w", pool_id=h.pool_id, pool_token=h.pool_token)
    assert reg.epoch == h.epoch + 1
    with pytest.raises(StaleEpoch, match="stale"):
        h.directory.step(h.pool_id, h.epoch)
    stats = h.directory.stats(h.pool_id).total
    assert (stats.num_blocks, stats.num_cached_blocks, stats.num_admissions) == (8, 0, 1)  # counters kept


def test_register_validation():
    h = harness()
    for num_blocks, block_size in ((0, 4), (16_777_217, 4), (8, 0), (8, 1025)):
        with pytest.raises(InvalidArgument):
            h.directory.register_pool(num_blocks, block_size, NAMESPACE, "w")
    with pytest.raises(InvalidArgument, match="pool_id"):
        h.directory.register_pool(8, 4, NAMESPACE, "w", pool_id="bad id/with spaces")
    reg = h.directory.register_pool(16_777_216, 1024, NAMESPACE, "w")  # the largest pool is cheap
    assert h.directory.stats(reg.pool_id).total.num_free_blocks == 16_777_216


def test_resync_restores_live_sequences():
    h = harness()
    shared = A[:8]
    r1 = h.admit(1, shared + [1, 2, 3])  # 2 full + tail
    h.commit_full(1, shared + [1, 2, 3])
    r2 = h.admit(2, shared + [4, 5, 6, 7, 8])  # shares 2 blocks, 1 full of its own + tail
    h.commit_full(2, shared + [4, 5, 6, 7, 8], r2.num_cached_tokens)
    declared = [
        _resync_of(1, r1.block_ids, shared + [1, 2, 3]),
        _resync_of(2, r2.block_ids, shared + [4, 5, 6, 7, 8]),
    ]
    # blockd restarts: a new directory, the worker registers under its id and resyncs
    h.directory = BlockDirectory(h.directory.config, clock=h.clock)
    reg = h.directory.register_pool(16, 4, NAMESPACE, "w", pool_id=h.pool_id)
    h.epoch = reg.epoch
    result = h.directory.resync(h.pool_id, h.epoch, declared)
    assert (result.num_sequences, result.num_committed_blocks) == (2, 3)
    check_invariants(h.directory)
    assert h.pool.blocks[r1.block_ids[0]].ref_count == 2
    # the sequences go on: commit the tail once filled, release, and the cache serves again
    h.step(commits=[CommitOp(1, r1.block_ids[2:3], [1, 2, 3, 9])])
    h.step(releases=[ReleaseOp(1), ReleaseOp(2)])
    assert h.admit(3, shared + [1, 2, 3, 9]).num_cached_tokens == 12
    # resync is idempotent: declaring the same state again is fine
    h.directory.resync(h.pool_id, h.epoch, [_resync_of(3, h.tables[3], shared + [1, 2, 3, 9])])
    check_invariants(h.directory)


def test_resync_validation():
    h = harness()
    before = snapshot(h.directory)
    bad = [
        [_resync_of(1, [0, 1], A)],  # 2 blocks cannot hold 12 tokens
        [_resync_of(1, [0, 1, 99], A)],  # out of range
        [_resync_of(1, [0, 0, 1], A)],  # duplicate id
        [_resync_of(1, [0, 1, 2], A), _resync_of(2, [0, 3, 4], B)],  # block 0 with other content
        [_resync_of(1, [0, 1, 2], A), _resync_of(1, [3, 4, 5], B)],  # sequence twice
        [_resync_of(1, [0, 1, 2], A[:9]), _resync_of(2, [0, 1, 2], A)],  # block 2 partial in one
    ]
    for sequences in bad:
        with pytest.raises(InvalidArgument):
            h.directory.resync(h.pool_id, h.epoch, sequences)
        assert snapshot(h.directory) == before


def test_route_prefers_longest_prefix_then_lower_load_and_skips_overloaded():
    h = harness(num_blocks=20, route_load_margin=0.25)
    other = h.directory.register_pool(20, 4, NAMESPACE, "worker-1:50052")
    h.run(1, A)  # pool 0 caches A
    route = h.directory.route(A)
    assert route.pool_id == h.pool_id and route.num_cached_tokens == 12
    assert [m.pool_id for m in route.candidates] == [h.pool_id, other.pool_id]
    # unrelated prompt: tie on 0 cached tokens -> the lower load wins
    h.admit(2, list(range(300, 316)))  # pool 0 now holds 4 of 20 blocks
    assert h.directory.route(B).pool_id == other.pool_id
    # pool 0 loaded 0.3 above pool 1: skipped even though it holds A
    h.admit(3, list(range(400, 416)))
    h.admit(4, [1] * 8)
    assert h.directory.stats(h.pool_id).total.num_referenced_blocks == 10
    route = h.directory.route(A)
    assert route.pool_id == other.pool_id and route.candidates[-1].pool_id == h.pool_id


def test_list_blocks_pages_in_order():
    h = harness(num_blocks=32)
    h.run(1, A)
    h.run(2, B)
    pages, token = [], None
    while True:
        page = h.directory.list_blocks(page_size=4, page_token=token)
        pages.append(page.blocks)
        token = page.next_page_token
        if token is None:
            break
    ids = [b.block_id for blocks in pages for b in blocks]
    assert [len(p) for p in pages] == [4, 2] and ids == sorted(ids) and len(ids) == 6
    first = next(b for b in pages[0] if b.block_index == 0)
    assert first.parent_hash is None and first.token_ids == tuple(A[:4])
    with pytest.raises(InvalidArgument, match="page_token"):
        h.directory.list_blocks(page_token="garbage")
    with pytest.raises(InvalidArgument, match="page_size"):
        h.directory.list_blocks(page_size=10_001)


def test_events_mirror_the_index():
    h = harness(num_blocks=8, block_size=2)
    h.run(1, [1, 2, 3, 4, 5])
    h.run(2, [1, 2, 7, 8])
    h.admit(3, list(range(20, 32)))  # evicts
    h.directory.flush()
    h.run(4, [9, 9, 9, 9], salt="s")
    index: set[bytes] = set()
    for event in h.directory.events.read(0):
        if event.kind is EventKind.STORED:
            index.update(event.block_hashes)
        elif event.kind is EventKind.REMOVED:
            index.difference_update(event.block_hashes)
        elif event.kind is EventKind.CLEARED:
            index.clear()
    assert index == set(h.pool.index)
    stored = next(e for e in h.directory.events.read(0) if e.kind is EventKind.STORED)
    assert stored.parent_hash is None and len(stored.token_bytes) == 2 * 2 * 4


def test_event_window_reports_a_gap():
    h = harness(event_log_capacity=2)
    for sequence_id in range(4):
        h.run(sequence_id, [sequence_id] * 4)  # one STORED each
    log = h.directory.events
    assert [e.sequence for e in log.read(0)] == [3, 4]
    gap = log.read(1)
    assert [(e.kind, e.sequence) for e in gap] == [(EventKind.GAP, 4)]
    assert [e.sequence for e in log.read(2)] == [3, 4]
    assert log.read(99)[0].kind is EventKind.GAP  # a number from another incarnation


def test_event_log_is_bounded_by_bytes_too():
    h = harness(num_blocks=64, event_log_max_bytes=600)
    for sequence_id in range(6):
        h.run(sequence_id, [sequence_id] * 16)  # STORED events of 4 blocks: 64 bytes of tokens each
    events = h.directory.events.read(0)
    assert 1 <= len(events) < 6 and events[-1].sequence == h.directory.events.last_sequence
    assert h.directory.events.read(1)[0].kind is EventKind.GAP


def test_stats_totals_and_unknown_pool():
    h = harness()
    h.directory.register_pool(8, 2, NAMESPACE, "w2")
    total = h.directory.stats().total
    assert total.pool_id is None and total.num_blocks == 24 and total.block_size == 0
    with pytest.raises(NotFound):
        h.directory.stats("nope")
    with pytest.raises(NotFound):
        h.directory.flush("nope")


def test_namespaces_do_not_share_hashes():
    h = harness()
    other = h.directory.register_pool(16, 4, Namespace("other-model"), "w2")
    h.run(1, A)
    matches = {m.pool_id: m.num_cached_tokens for m in h.directory.lookup(A)}
    assert matches == {h.pool_id: 12, other.pool_id: 0}
    assert h.directory._slots[other.pool_id].pool.seed != h.pool.seed


def _bytes(tokens: list[int]) -> bytes:
    return token_bytes(tokens)


def _resync_of(sequence_id, block_ids, tokens):
    return ResyncSequence(sequence_id, list(block_ids), list(tokens))


def _without_counters(snap: tuple) -> tuple:
    pools, pins, last = snap
    return tuple(p[:-1] for p in pools), pins, last


def test_pool_records_are_bounded_tombstones_forgotten_first():
    """Registering pools over and over cannot grow blockd without bound."""
    from blockd.config import DirectoryConfig
    from blockd.directory import BlockDirectory
    from blockd.types import Namespace, ResourceExhausted

    now = [0.0]
    d = BlockDirectory(DirectoryConfig(max_pools=3, lease_ttl_seconds=1.0), clock=lambda: now[0])
    first = d.register_pool(4, 4, Namespace("m"))
    now[0] = 0.5
    d.register_pool(4, 4, Namespace("m"))
    now[0] = 2.0  # the first lease lapsed; the second not yet renewed either
    d.expire_leases()
    third = d.register_pool(4, 4, Namespace("m"))
    fourth = d.register_pool(4, 4, Namespace("m"))  # forgets the oldest tombstone
    ids = {p.pool_id for p in d.list_pools()}
    assert first.pool_id not in ids and {third.pool_id, fourth.pool_id} <= ids
    d.register_pool(4, 4, Namespace("m"))  # forgets the other tombstone
    with pytest.raises(ResourceExhausted, match="live pools"):
        d.register_pool(4, 4, Namespace("m"))
