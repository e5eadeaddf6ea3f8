"""Retention: the policies (adaptive, lfuda, seen-twice), retention priority, the ghost
table, miss reasons and per-request cache_policy, on the pure directory core."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockd.block import Block
from blockd.config import DirectoryConfig
from blockd.eviction import POLICY_NAMES, AdaptivePolicy, LfuDaPolicy, LruPolicy, SeenTwice, make_policy
from blockd.ghosts import GhostTable, MissReason
from blockd.types import AdmitOp, CachePolicy, CommitOp, InvalidArgument, ReleaseOp
from blockd.validation import make_prompt
from tests.blockd.helpers import harness


def _block(last_tick: int = 0, hits: int = 0, seen: int = 1, retention: int = 0) -> Block:
    block = Block(0, b"h" * 16, None, b"", None, b"")
    block.last_tick, block.num_hits, block.num_seen, block.retention = last_tick, hits, seen, retention
    return block


# ---------------------------------------------------------------- policies


def test_every_registered_policy_name_builds():
    for name in POLICY_NAMES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("mru")
    with pytest.raises(ValueError, match="eviction_policy must be one of"):
        DirectoryConfig(eviction_policy="lru+seen3")


def test_adaptive_is_lru_until_evictions_teach_it():
    policy = AdaptivePolicy()
    old_hot, new_cold = _block(last_tick=1, hits=9), _block(last_tick=2)
    assert policy.priority(old_hot) < policy.priority(new_cold)  # recency alone decides


def _teach(policy: AdaptivePolicy, returns_by_uses: dict[int, float], evictions: int = 2_000) -> None:
    """Evict `evictions` blocks of each use class at ticks far apart; a share of them
    come back (ghost hits) per `returns_by_uses`."""
    for i in range(evictions):
        for uses, share in returns_by_uses.items():
            tick = i * 10
            policy.now = tick + 50  # one-use victims are 50 ticks old: horizon -> 50
            policy.evicted((float(tick), tick, uses, 0))
            if (i * share) % 1 + share >= 1:
                policy.returned(uses)


def test_adaptive_earns_a_frequency_bonus_only_where_frequent_blocks_return_more():
    zipf_like = AdaptivePolicy()
    _teach(zipf_like, {1: 0.1, 2: 0.8, 5: 0.9})
    assert zipf_like.horizon == pytest.approx(50, rel=0.05)
    assert zipf_like.bonus[0] == 0
    assert zipf_like.bonus[1] > 2 and zipf_like.bonus[4] > 2  # log2(8) - margin
    # a block used five times, released 100 ticks ago, outlives a one-use block released now
    now = zipf_like.now
    assert zipf_like.priority(_block(last_tick=now - 100, seen=5)) > zipf_like.priority(_block(last_tick=now))

    chat_like = AdaptivePolicy()
    _teach(chat_like, {1: 0.5, 2: 0.5, 5: 0.5})
    assert chat_like.bonus == [0.0] * AdaptivePolicy.NUM_CLASSES  # frequency predicts nothing: LRU
    now = chat_like.now
    assert chat_like.priority(_block(last_tick=now - 1, seen=5)) < chat_like.priority(_block(last_tick=now))


def test_adaptive_shortens_the_life_of_one_use_blocks_of_runs_whose_victims_never_return():
    """Scan resistance by run length: one-use blocks computed in long runs (pasted
    one-shot documents) never come back, short runs (a conversation's next turn) do."""
    policy = AdaptivePolicy()
    for i in range(2_000):
        for run_length, share in ((100, 0.0), (2, 0.5)):
            policy.now = i * 10 + 50
            run = min(AdaptivePolicy.NUM_RUNS - 1, run_length.bit_length())
            policy.evicted((float(i * 10), i * 10, 1, run))
            if (i * share) % 1 + share >= 1:
                policy.returned(1, run_length)
    policy.bonus  # noqa: B018 (recomputes the tables)
    assert policy._run_bonus[7] < -2  # never returns: aged
    assert policy._run_bonus[2] == AdaptivePolicy.RUN_MAX_BONUS  # returns more than the rest
    assert policy._run_bonus[0] == 0  # no evidence
    now = policy.now
    scan, turn = _block(last_tick=now), _block(last_tick=now - int(AdaptivePolicy.MIN_UNIT))
    scan.run_length, turn.run_length = 100, 2
    assert policy.priority(scan) < policy.priority(turn)
    hot = _block(last_tick=now, seen=3)
    hot.run_length = 100  # a block used again is ranked by its uses alone
    assert policy.priority(hot)[3] == 0


def test_a_run_class_that_is_most_of_the_one_use_victims_is_compared_with_the_rest():
    """The 64+ class of the conversation trace is most of its one-use victims, so it is
    never far from their average: against the rest it is aged all the same."""
    policy = AdaptivePolicy()
    for i in range(4_000):
        run_length, share = (100, 0.05) if i % 10 else (2, 0.5)
        run = min(AdaptivePolicy.NUM_RUNS - 1, run_length.bit_length())
        policy.now = i + 50
        policy.evicted((float(i), i, 1, run))
        if (i // 10 * share) % 1 + share >= 1:
            policy.returned(1, run_length)
    policy.bonus  # noqa: B018 (recomputes the tables)
    assert policy._run_bonus[7] < -1  # 1/10 of the rest's rate, 1/2 of the average's
    assert policy._run_bonus[2] > 0


def test_blocks_carry_their_sequences_run_length_into_the_ghost_table():
    h = harness(num_blocks=8, block_size=2, eviction_policy="lru")
    h.run(1, [1, 2, 3, 4, 5, 6, 7])  # 3 full blocks uncached at admission
    assert {b.run_length for b in h.pool.index.values()} == {3}
    h.run(2, [1, 2, 3, 4, 5, 6, 8, 8])  # 3 hits, 1 new
    assert sorted(b.run_length for b in h.pool.index.values()) == [1, 3, 3, 3]
    turn = next(b for b in h.pool.index.values() if b.run_length == 1)
    document = turn.parent
    h.run(3, [9, 9, 9, 9, 9, 9, 9, 9])  # 4 blocks, all free
    h.run(4, [10, 10, 10, 10])  # evicts the oldest chain's tail: [8 8], then [5 6]
    ghosts = h.pool.ghosts
    assert ghosts.get(turn.block_hash).run_length == 1
    assert ghosts.get(document.block_hash).run_length == 3


def test_a_bonus_horizon_is_worth_min_unit_ticks_where_one_use_victims_die_young():
    """A small pool evicts one-use blocks within a release or two: a bonus measured in
    their age alone would protect a hot block for less than one release."""
    policy = AdaptivePolicy()
    for i in range(2_000):
        for uses, share in {1: 0.1, 5: 0.9}.items():
            policy.now = i + 1  # victims are one tick old
            policy.evicted((float(i), i, uses, 0))
            if (i * share) % 1 + share >= 1:
                policy.returned(uses)
    assert policy.horizon < 2
    assert policy.bonus[4] > 2
    now = policy.now
    hot = _block(last_tick=now - int(AdaptivePolicy.MIN_UNIT), seen=5)
    assert policy.priority(hot) > policy.priority(_block(last_tick=now))


def test_lfuda_ages_old_frequency_away():
    policy = LfuDaPolicy()
    stale = policy.priority(_block(last_tick=1, hits=3))  # value 4 at age 0
    policy.evicted((10.0, 5))  # the victims are now worth 10
    fresh = policy.priority(_block(last_tick=9))  # one use, but at age 10
    assert stale < fresh


def test_seen_twice_puts_one_use_blocks_first_whatever_the_inner_order():
    policy = SeenTwice(LruPolicy())
    assert policy.priority(_block(last_tick=100)) < policy.priority(_block(last_tick=1, hits=1))
    assert policy.priority(_block(last_tick=1)) < policy.priority(_block(last_tick=2))


def _survival(policy: str, retention: int, flood: int = 40) -> int:
    """How many one-off requests (default priority) a prompt released with `retention`
    stays cached through, in a pool of 8 blocks."""
    h = harness(num_blocks=8, block_size=2, eviction_policy=policy)
    system = [7, 7, 8, 8]
    h.tables[1] = h.step(admits=[AdmitOp(1, system, retention_priority=retention)]).admits[0].block_ids
    h.commit_full(1, system)
    h.release(1)
    for i in range(flood):
        h.run(2 + i, [i, i, i + 100, i + 100])
        if h.directory.lookup(system)[0].num_cached_tokens < 4:
            return i
    return flood


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfuda", "adaptive"])
def test_retention_priority_is_weighed_by_every_policy(policy):
    assert _survival(policy, 100) > _survival(policy, 0) >= _survival(policy, 1)


def test_under_lru_retention_classes_are_strict():
    assert _survival("lru", 100) == 40  # never evicted while lower classes remain


def test_low_retention_priority_goes_first_under_lru():
    h = harness(num_blocks=4, block_size=2, eviction_policy="lru")
    low = [1, 1]
    h.tables[1] = h.step(admits=[AdmitOp(1, low, retention_priority=1)]).admits[0].block_ids
    h.commit_full(1, low)
    h.release(1)
    h.run(2, [2, 2])  # newer... but default priority
    h.run(3, [3, 3, 4, 4, 5, 5])  # three blocks: one free, then evicts the low one, not [2 2]
    assert h.directory.lookup(low)[0].num_cached_tokens == 0
    assert h.directory.lookup([2, 2])[0].num_cached_tokens == 2


def test_retention_priority_out_of_range_is_refused_and_changes_nothing():
    h = harness()
    with pytest.raises(InvalidArgument, match="retention_priority must be 1 .. 100"):
        h.step(admits=[AdmitOp(1, [1, 2, 3, 4], retention_priority=101)])
    assert not h.pool.sequences


# ---------------------------------------------------------------- ghosts and miss reasons


def test_ghost_table_is_bounded_and_forgets_the_oldest():
    ghosts = GhostTable(3, lambda: 5.0)
    ghosts.remember([(bytes([i]) * 16, i, 0) for i in range(5)], "lru")
    assert len(ghosts) == 3
    assert bytes([0]) * 16 not in ghosts and bytes([4]) * 16 in ghosts
    assert ghosts.recall(bytes([4]) * 16) == 4 and bytes([4]) * 16 not in ghosts
    assert ghosts.recall(bytes([9]) * 16) == 0


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 6),
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("remember"), st.lists(st.integers(0, 12), max_size=8)),
            st.tuples(st.just("recall"), st.integers(0, 12)),
        ),
        max_size=80,
    ),
)
def test_ghost_table_forgets_in_the_order_an_ordered_dict_would(capacity, ops):
    """The table against a model: an OrderedDict whose re-remembered hash moves to the
    young end and whose oldest entries go past the capacity. Recalls leave stale FIFO
    entries behind, re-remembers younger ones: neither may change what is forgotten."""
    ghosts = GhostTable(capacity, lambda: 1.0)
    model: OrderedDict[bytes, int] = OrderedDict()
    for step, (op, arg) in enumerate(ops):
        if op == "remember":
            hashes = [bytes([i]) * 16 for i in arg]
            ghosts.remember([(h, step, 0) for h in hashes], "lru")
            for h in hashes:
                model.pop(h, None)
                model[h] = step
            while len(model) > capacity:
                model.popitem(last=False)
        else:
            h = bytes([arg]) * 16
            expected = model.pop(h, None)
            uses = ghosts.recall(h)
            if expected is not None:
                assert uses == expected
        assert len(ghosts) == len(model) <= capacity
        assert all(bytes([i]) * 16 in ghosts for i in range(13) if bytes([i]) * 16 in model)
        assert all(ghosts.get(h).num_uses == uses for h, uses in model.items())


def _misses(h) -> dict[str, int]:
    return dict(h.pool.counters.miss_tokens)


def test_miss_reasons_partial_never_seen_evicted_flushed():
    h = harness(num_blocks=4, block_size=2, eviction_policy="lru")
    h.run(1, [1, 2, 3, 4, 5])  # 2 full blocks never seen, 1 partial token
    assert _misses(h) == {"never_seen": 4, "partial_block": 1}
    h.run(2, [1, 2, 3, 4, 9])  # 4 hits, 1 partial token
    assert _misses(h) == {"never_seen": 4, "partial_block": 2}
    evicted_at = h.clock()
    h.run(3, [6, 6, 7, 7, 8, 8])  # 3 blocks: 2 free, evicts [3 4]
    h.clock.advance(7)
    h.run(4, [1, 2, 3, 4])  # [1 2] hits, [3 4] was evicted 7 s ago by lru
    miss = h.pool.last_miss
    assert miss.reason is MissReason.EVICTED and miss.ghost.cause == "lru" and miss.num_tokens == 2
    assert h.clock() - miss.ghost.at == 7 and miss.ghost.at == evicted_at
    assert _misses(h)["evicted"] == 2
    h.directory.flush()
    h.run(5, [6, 6])
    assert h.pool.last_miss.reason is MissReason.FLUSHED


def test_miss_reason_other_salt_both_ways():
    h = harness(num_blocks=16, block_size=2)
    h.run(1, [1, 2, 3, 4], salt="tenant-a")
    h.run(2, [1, 2, 3, 4])  # cached only under a salt
    assert h.pool.last_miss.reason is MissReason.OTHER_SALT
    h.run(3, [1, 2, 3, 4], salt="tenant-b")  # cached without salt (and under another)
    assert h.pool.last_miss.reason is MissReason.OTHER_SALT
    h.run(4, [5, 6], salt="tenant-b")
    assert h.pool.last_miss.reason is MissReason.NEVER_SEEN


# ---------------------------------------------------------------- cache_policy


def _run(h, sequence_id: int, tokens: list[int], cache_policy: CachePolicy) -> int:
    result = h.step(admits=[AdmitOp(sequence_id, tokens, cache_policy=cache_policy)]).admits[0]
    bs = h.block_size
    first, last = result.num_cached_tokens // bs, len(tokens) // bs
    commits = [CommitOp(sequence_id, result.block_ids[first:last], tokens[first * bs : last * bs])]
    h.step(commits=commits if last > first else [], releases=[ReleaseOp(sequence_id)])
    return result.num_cached_tokens


def test_read_only_reuses_but_never_indexes_its_new_blocks():
    h = harness(num_blocks=16, block_size=2)
    h.run(1, [1, 2, 3, 4])
    assert _run(h, 2, [1, 2, 3, 4, 5, 6, 7, 8], CachePolicy.READ_ONLY) == 4
    assert h.directory.lookup([1, 2, 3, 4, 5, 6, 7, 8])[0].num_cached_tokens == 4
    assert h.pool.num_free == 16 - 2  # its own blocks went back to free
    assert _run(h, 3, [1, 2, 3, 4, 5, 6], CachePolicy.STORE) == 4
    assert h.pool.last_miss.reason is MissReason.NOT_STORED


def test_cache_policy_none_neither_reads_nor_writes():
    h = harness(num_blocks=16, block_size=2)
    h.run(1, [1, 2, 3, 4])
    events = h.directory.events.last_sequence
    assert _run(h, 2, [1, 2, 3, 4, 5, 6], CachePolicy.NONE) == 0
    assert h.pool.last_miss.reason is MissReason.BYPASSED
    assert h.directory.events.last_sequence == events  # nothing stored or removed
    assert h.directory.lookup([1, 2, 3, 4, 5, 6])[0].num_cached_tokens == 4


def test_a_block_that_comes_back_gets_its_uses_back():
    h = harness(num_blocks=2, block_size=2, eviction_policy="lru")
    for i in range(3):
        h.run(10 + i, [1, 1])  # commit + 2 hits: 3 uses
    h.run(20, [2, 2, 3, 3])  # evicts [1 1]
    h.run(21, [1, 1])  # committed again: its 3 earlier uses + this one
    (block,) = h.pool.match(make_prompt([1, 1], "", 0, 16, "test"))
    assert block.num_seen + block.num_hits == 4
