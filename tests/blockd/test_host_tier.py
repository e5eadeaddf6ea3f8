"""The host tier in the directory core: demotion on device eviction, loads on
admission (findable in the device pool only once committed), the cost rule, flush
per tier, and leases. The property tests (test_properties: Tiered*) run random
programs against the same invariants; these pin down the named cases."""

from __future__ import annotations

import pytest

from bench.tier_trace import ConversationSpec, conversation_trace
from blockd.events import EventKind
from blockd.types import AdmitOp, CommitOp, HostSpec, ReleaseOp, Tier
from tests.blockd.helpers import NAMESPACE, Harness, harness

BS = 2
A = [1, 2, 3, 4]  # two blocks
B = [5, 6, 7, 8, 9, 10, 11, 12]  # four blocks


def _fill_with_b(h: Harness) -> tuple:
    """Cache A, then run B through a 4-block pool: A's blocks are evicted."""
    h.run(1, A)
    result = h.directory.step(h.pool_id, h.epoch, admits=[])  # no-op step: nothing owed
    assert result.demotions == ()
    admitted = h.step(admits=[_admit(2, B)])
    assert admitted.admits[0].admitted
    h.tables[2] = admitted.admits[0].block_ids
    h.commit_full(2, B)
    h.release(2)
    return admitted


def _admit(sequence_id: int, tokens: list[int]) -> AdmitOp:
    return AdmitOp(sequence_id, tokens)


def test_device_eviction_demotes_and_an_admission_loads_it_back():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8))
    step = _fill_with_b(h)
    # B's admission evicted A's two blocks: each is copied out before B writes them.
    assert len(step.demotions) == 2
    assert {b for b, _ in step.demotions} <= set(step.admits[0].block_ids)
    assert h.pool.host.counters.num_demotions == 2
    match = h.directory.lookup(A, pool_id=h.pool_id)[0]
    assert (match.num_cached_tokens, match.num_host_cached_tokens) == (4, 4)

    again = h.step(admits=[_admit(3, A)]).admits[0]
    assert again.admitted and again.num_cached_tokens == 4
    assert [b for b, _ in again.loads] == list(again.block_ids)
    # Not findable in the device pool before its commit (the copy may still run).
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_host_cached_tokens == 4
    assert h.pool.host.num_referenced == 2
    h.step(commits=[CommitOp(3, again.block_ids, A)])
    match = h.directory.lookup(A, pool_id=h.pool_id)[0]
    assert (match.num_cached_tokens, match.num_host_cached_tokens) == (4, 0)
    assert h.pool.host.num_referenced == 0
    loaded = [e for e in h.directory.events.read(0) if e.kind is EventKind.LOADED]
    assert [e.block_ids for e in loaded] == [tuple(again.block_ids)]
    stats = h.directory.stats(h.pool_id).total
    assert stats.host.num_loads == 2 and stats.host.hit_tokens == 4
    h.release(3)


def test_release_before_commit_returns_the_host_blocks():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8))
    _fill_with_b(h)
    again = h.step(admits=[_admit(3, A)]).admits[0]
    assert again.loads
    h.step(releases=[ReleaseOp(3)])  # cancelled before its forward: nothing committed
    assert h.pool.host.num_referenced == 0
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_host_cached_tokens == 4


def test_a_copy_slower_than_recompute_is_not_loaded():
    slow_copy = HostSpec(8, load_seconds_per_block=1.0, prefill_seconds_per_token=0.001)
    h = harness(num_blocks=4, block_size=BS, host=slow_copy)
    _fill_with_b(h)
    again = h.step(admits=[_admit(3, A)]).admits[0]
    assert again.admitted and again.num_cached_tokens == 0 and again.loads == ()
    host = h.directory.stats(h.pool_id).total.host
    assert host.num_loads_skipped == 1
    assert host.load_seconds_per_block == 1.0 and host.recompute_seconds_per_block == BS * 0.001


def test_seen_twice_rule_drops_one_off_blocks():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8), demote_min_hits=1)
    step = _fill_with_b(h)
    assert step.demotions == ()  # A was never hit: a one-off, not worth a copy
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_cached_tokens == 0


def test_flush_per_tier():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8))
    _fill_with_b(h)
    device_only = h.directory.flush(tier=Tier.DEVICE)
    assert device_only.tiers == ((Tier.DEVICE, 4, 0),)
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_host_cached_tokens == 4
    everything = h.directory.flush()
    assert everything.tiers == ((Tier.DEVICE, 0, 0), (Tier.HOST, 2, 0))
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_cached_tokens == 0
    assert h.directory.stats(h.pool_id).total.host.num_free_blocks == 8


def test_a_lapsed_lease_loses_both_tiers():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8), lease_ttl_seconds=5.0)
    _fill_with_b(h)
    h.clock.advance(6.0)
    assert h.directory.expire_leases() == [h.pool_id]
    host = h.directory.stats(h.pool_id).total.host
    assert host.num_free_blocks == 8 and host.num_evictable_blocks == 0


def test_a_full_host_tier_evicts_its_own_leaves_first():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(2))
    _fill_with_b(h)  # A's two blocks fill the host tier
    h.run(4, [20, 21, 22, 23, 24, 25, 26, 27])  # evicts B into the host tier, A out of it
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_cached_tokens == 0
    removed = [e for e in h.directory.events.read(0) if e.kind is EventKind.REMOVED and e.tier is Tier.HOST]
    assert sum(len(e.block_hashes) for e in removed) >= 2


@pytest.mark.parametrize("host_blocks", [6, 48])
def test_a_conversation_trace_keeps_every_invariant(host_blocks):
    """Long chains evicted whole, some blocks already in the host tier, a host tier too
    small for them: the cases that orphan a chain when ordered wrong."""
    spec = ConversationSpec(
        num_families=4,
        family_tokens=(16, 48),
        num_conversations=24,
        turns=(2, 6),
        user_tokens=(4, 12),
        answer_tokens=(4, 16),
        active=5,
        seed=3,
    )
    trace = conversation_trace(spec)
    h = harness(num_blocks=max(len(p) for p in trace) // 4 + 2, block_size=4, host=HostSpec(host_blocks))
    for seq_id, prompt in enumerate(trace):  # harness.step checks every invariant
        result = h.step(admits=[_admit(seq_id, prompt)]).admits[0]
        first = result.num_cached_tokens // 4 - len(result.loads)
        last = len(prompt) // 4
        commits = (
            [CommitOp(seq_id, result.block_ids[first:last], prompt[first * 4 : last * 4])]
            if last > first
            else []
        )
        h.step(commits=commits, releases=[ReleaseOp(seq_id)])
    assert h.pool.host.counters.num_demotions > 0 and h.pool.host.counters.num_loads > 0


def test_seen_twice_counts_sightings_fleet_wide():
    """A prefix computed on this worker and again on another is no one-off: with the
    seen-twice rule it is demoted here although this pool never hit it."""
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8), demote_min_hits=1)
    other = h.directory.register_pool(16, BS, NAMESPACE, "worker-1:50052")
    h.run(1, A)  # A: computed here once
    h.directory.step(other.pool_id, other.epoch, admits=[AdmitOp(1, A)])  # ...and on the other worker
    h.directory.step(other.pool_id, other.epoch, commits=[CommitOp(1, [0, 1], A)], releases=[ReleaseOp(1)])
    h.run(2, [40, 41, 42, 43])  # a one-off, seen once
    step = h.step(admits=[_admit(3, B)])  # evicts both: only A is worth a copy
    assert len(step.demotions) == 2
    match = h.directory.lookup(A, pool_id=h.pool_id)[0]
    assert match.num_host_cached_tokens == 4, "A was seen twice across the fleet"
    assert h.directory.lookup([40, 41, 42, 43], pool_id=h.pool_id)[0].num_cached_tokens == 0
