"""The admission gate: its key memory (blockd.admission), the ghost table's long memory
(blockd.ghosts) and the gated default policy (blockd.eviction.GatedPolicy)."""

from __future__ import annotations

import random

import pytest

from blockd.admission import BYTES_PER_KEY, KeyMemory
from blockd.block import Block
from blockd.eviction import DEFAULT_POLICY, AdaptivePolicy, GatedPolicy
from blockd.ghosts import KEYS_PER_GHOST, GhostTable, MissReason
from tests.blockd.helpers import harness


def _hash(rng: random.Random) -> bytes:
    return rng.randbytes(16)


def _block(last_tick: int, seen: int = 1, hits: int = 0) -> Block:
    block = Block(0, b"h" * 16, None, b"", None, b"")
    block.last_tick, block.num_seen, block.num_hits = last_tick, seen, hits
    return block


# ---------------------------------------------------------------- key memory


def test_key_memory_remembers_the_last_half_capacity_without_false_negatives():
    rng = random.Random(0)
    memory = KeyMemory(2_000)
    keys = [_hash(rng) for _ in range(5_000)]
    for key in keys:
        memory.add(key)
    assert all(key in memory for key in keys[-1_000:])  # at least capacity / 2
    # at most `capacity` insertions back: the oldest keys are forgotten (a false
    # positive may still answer yes for a few)
    assert sum(key in memory for key in keys[:2_000]) < 100


def test_key_memory_false_positives_and_bytes_per_key_are_bounded():
    rng = random.Random(1)
    memory = KeyMemory(100_000)
    for _ in range(100_000):
        memory.add(_hash(rng))
    false_positives = sum(_hash(rng) in memory for _ in range(20_000)) / 20_000
    assert false_positives < 0.04, false_positives  # ~1.2% per generation, two generations
    assert memory.bytes_per_key == BYTES_PER_KEY
    assert memory.nbytes <= 4 * 100_000  # against ~160 B per ghost


def test_an_empty_key_memory_knows_nothing_and_costs_nothing_per_query():
    memory = KeyMemory(0)
    memory.add(b"x" * 16)
    assert b"x" * 16 not in memory and memory.num_added == 0


def test_ghost_table_remembers_keys_long_after_their_ghosts():
    rng = random.Random(2)
    ghosts = GhostTable(10, lambda: 0.0)
    assert ghosts.keys.capacity == KEYS_PER_GHOST * 10
    first = _hash(rng)
    ghosts.remember([(first, 3, 0)], "adaptive")
    ghosts.remember([(_hash(rng), 1, 0) for _ in range(15)], "adaptive")
    assert first not in ghosts  # the ghost is gone (10 kept) ...
    assert ghosts.recall(first) == 1  # ... the key memory still says: seen before
    assert ghosts.recall(_hash(rng)) == 0


def test_the_pools_key_memory_is_several_times_the_pool():
    h = harness(num_blocks=64, block_size=2)
    assert h.pool.ghosts.keys.capacity >= 4 * 64


# ---------------------------------------------------------------- the gate


def test_the_default_policy_is_the_gated_one():
    assert DEFAULT_POLICY == GatedPolicy.name
    assert harness().pool.leaves.policy.name == GatedPolicy.name


def test_the_gate_starts_open():
    policy = GatedPolicy()
    assert policy.penalty == 0
    assert policy.priority(_block(last_tick=10, seen=2)) < policy.priority(_block(last_tick=11))


def test_a_block_on_probation_goes_before_older_admitted_blocks():
    policy = GatedPolicy()
    policy.gate = 8.0  # horizons
    assert policy.penalty > 0
    admitted_old = _block(last_tick=10, seen=2)
    hit_old = _block(last_tick=10, hits=1)
    one_off_new = _block(last_tick=11)
    assert policy.priority(one_off_new) < policy.priority(admitted_old)
    assert policy.priority(one_off_new) < policy.priority(hit_old)
    # ... but not before blocks released more than `penalty` ticks earlier
    ancient = _block(last_tick=int(11 - policy.penalty) - 2, seen=2)
    assert policy.priority(ancient) < policy.priority(one_off_new)


def _victims(policy: GatedPolicy, probation_returns: float, admitted_returns: float, n: int = 2_000) -> None:
    for i in range(n):
        for uses, share in ((1, probation_returns), (2, admitted_returns)):
            policy.evicted((float(i), i, uses, 0))
            if (i * share) % 1 + share >= 1:
                policy.returned(uses)


def test_the_gate_closes_where_one_offs_never_come_back():
    policy = GatedPolicy()
    _victims(policy, probation_returns=0.0, admitted_returns=0.3)
    assert policy.gate == GatedPolicy.MAX_PENALTY


def test_the_gate_opens_where_probation_victims_come_back():
    policy = GatedPolicy()
    _victims(policy, probation_returns=0.5, admitted_returns=0.05)
    assert policy.gate == 0.0
    policy.gate = 0.0  # fully open: the inner policy's order
    inner = AdaptivePolicy()
    blocks = [_block(last_tick=t, seen=s) for t, s in ((5, 1), (4, 2), (6, 1), (3, 3))]
    assert sorted(range(4), key=lambda i: policy.priority(blocks[i])) == sorted(
        range(4), key=lambda i: inner.priority(blocks[i])
    )


def test_the_gate_stays_open_where_both_sides_return_about_as_often():
    # the conversation trace: admitted victims return a little more often than probation
    # ones; an ARC-like walk drifted closed there and cost 3-6% of lru's hits
    policy = GatedPolicy()
    _victims(policy, probation_returns=0.1, admitted_returns=0.15, n=20_000)
    assert policy.gate == 0.0
    _victims(policy, probation_returns=0.025, admitted_returns=0.15, n=20_000)
    assert 0.0 < policy.gate < GatedPolicy.MAX_PENALTY  # 6x as often: partly closed


def test_the_gate_closes_where_the_pool_thrashes():
    # long-conversation at 5-10%: reuse gaps a little longer than the pool, a third or more
    # of all victims come back, admitted ones ~1.15x as often as probation ones; a stable
    # admitted set that outlives the gap is what hits (lru+seen2's gain)
    policy = GatedPolicy()
    _victims(policy, probation_returns=0.32, admitted_returns=0.37, n=20_000)
    assert policy.gate == GatedPolicy.THRASH_GATE
    # the same ratio where few victims return: no thrashing, the gate stays open
    quiet = GatedPolicy()
    _victims(quiet, probation_returns=0.08, admitted_returns=0.092, n=20_000)
    assert quiet.gate == 0.0
    # probation victims returning more often (chat at 2%): open, however many return
    chat = GatedPolicy()
    _victims(chat, probation_returns=0.63, admitted_returns=0.58, n=20_000)
    assert chat.gate == 0.0


def test_under_pressure_one_offs_go_before_a_reused_prefix_released_earlier():
    h = harness(num_blocks=6, block_size=2)  # three 2-block chains fit
    h.pool.leaves.policy.gate = GatedPolicy.MAX_PENALTY  # closed, as one-off traffic leaves it
    reused = [1, 1, 2, 2]
    h.run(1, reused)
    h.run(2, [9, 9, 8, 8])
    h.run(3, [7, 7, 6, 6])
    h.run(4, [5, 5, 4, 4])  # evicts `reused`, the least recent (all are one-offs so far)
    assert h.run(5, reused).num_cached_tokens == 0  # a miss; its hashes are remembered
    (block,) = h.pool.match(_prompt(reused[:2]))
    assert block.num_seen == 2  # seen before: admitted
    h.run(6, [3, 3, 3, 3])
    h.run(7, [0, 0, 0, 0])  # plain recency would now give up `reused` (released before these)
    assert h.directory.lookup(reused + [0])[0].num_cached_tokens == 4
    assert h.pool.counters.num_evictions == 8  # runs 4-7: two blocks each


def test_without_pressure_the_gate_evicts_nothing_and_never_refuses_a_sequence():
    h = harness(num_blocks=64, block_size=2)
    for i in range(10):  # one-offs only, all fit
        assert h.run(i, [100 + i] * 6).admitted
    assert h.pool.counters.num_evictions == 0
    assert all(h.directory.lookup([100 + i] * 6)[0].num_cached_tokens == 6 for i in range(10))
    small = harness(num_blocks=3, block_size=2)
    for i in range(20):  # a one-off that needs the whole pool is always admitted
        assert small.run(i, [200 + i] * 6).admitted


def _prompt(tokens: list[int]):
    from blockd.validation import make_prompt

    return make_prompt(tokens, "", 0, 16, "test")


def test_a_miss_on_a_block_the_gate_never_admitted_says_so():
    h = harness(num_blocks=4, block_size=2)
    h.pool.leaves.policy.gate = GatedPolicy.MAX_PENALTY
    h.run(1, [1, 1, 2, 2])  # used once: on probation
    h.run(2, [3, 3, 4, 4])
    h.run(3, [5, 5, 6, 6])  # evicts [1 1 2 2], never admitted
    h.run(4, [1, 1, 2, 2])
    miss = h.pool.last_miss
    assert miss.ghost is not None and miss.ghost.not_admitted
    assert miss.reason is MissReason.NOT_ADMITTED  # the reason stats, metrics and `kvctl why` give
    h.run(5, [1, 1, 2, 2])  # a hit: admitted
    h.run(6, [3, 3, 4, 4])  # seen before (evicted by run 4): admitted, evicts [5 5 6 6]
    h.run(7, [5, 5, 6, 6])  # seen before: admitted, evicts the least recent admitted chain
    h.run(8, [1, 1, 2, 2])
    ghost = h.pool.last_miss.ghost
    assert ghost is not None and ghost.num_uses >= 2 and not ghost.not_admitted
    assert h.pool.last_miss.reason is MissReason.EVICTED


def test_a_host_tier_decides_with_the_device_pools_gate():
    from blockd.eviction import admits, make_host_policy, make_policy

    device = make_policy(DEFAULT_POLICY)
    host = make_host_policy(device)
    assert host is not device and host.name == device.name
    one_off, reused = _block(last_tick=11), _block(last_tick=10, seen=2)
    assert admits(device, one_off) and admits(host, one_off)  # open: everything is kept
    device.gate = GatedPolicy.MAX_PENALTY  # the device's ghost returns closed it
    assert host.priority(one_off) < host.priority(reused)
    assert not admits(host, one_off) and admits(host, reused)
    assert admits(make_policy("lru"), one_off)  # no gate: no refusal


def test_a_probation_victim_that_returns_opens_the_gate():
    # a NOT_ADMITTED ghost is still the policy's victim: its return must teach the gate
    policy = GatedPolicy()
    _victims(policy, probation_returns=0.0, admitted_returns=0.3)
    assert policy.penalty > 0 and policy.gate == GatedPolicy.MAX_PENALTY
    ghosts = GhostTable(1_000, lambda: 0.0, policy.returned)
    one_offs = [bytes([i % 256, i // 256]) * 8 for i in range(600)]
    ghosts.remember([(h, 1, 0) for h in one_offs], GatedPolicy.name)
    ghosts.remember([(b"f" * 16, 1, 0)], "flush")
    assert ghosts.get(one_offs[0]).reason is MissReason.NOT_ADMITTED
    returns = policy._returns[0]
    assert ghosts.recall(b"f" * 16) == 1  # a flush says nothing about the policy
    assert policy._returns[0] == returns
    for h in one_offs:
        assert ghosts.recall(h) == 1
    assert policy.penalty == 0  # as many probation victims came back as admitted ones


def test_decayed_counters_in_inflated_units_match_per_eviction_decay():
    policy = AdaptivePolicy()
    evictions, returns = [0.0] * 5, [0.0] * 5
    rng = random.Random(3)
    for i in range(30_000):
        uses = rng.choice((1, 1, 1, 2, 3, 7))
        policy.evicted((float(i), i, uses, 0))
        evictions = [e * AdaptivePolicy.DECAY for e in evictions]
        returns = [r * AdaptivePolicy.DECAY for r in returns]
        evictions[min(uses, 5) - 1] += 1
        if rng.random() < 0.1:
            policy.returned(uses)
            returns[min(uses, 5) - 1] += 1
    assert policy.evictions == [pytest.approx(e, rel=1e-9) for e in evictions]
    assert policy.returns == [pytest.approx(r, rel=1e-9) for r in returns]
    policy._scale = AdaptivePolicy.RENORMALISE  # the next eviction renormalises
    before = policy.evictions
    policy.evicted((0.0, 0, 1, 0))
    assert policy._scale == 1.0
    assert policy.evictions[1:] == [pytest.approx(e * AdaptivePolicy.DECAY, rel=1e-9) for e in before[1:]]


def test_the_bonus_table_is_recomputed_after_a_return_or_refresh_evictions():
    policy = AdaptivePolicy()
    for i in range(2_000):
        policy.evicted((float(i), i, 1 if i % 2 else 3, 0))
        if i % 2 == 0 and i % 10 == 0:
            policy.returned(3)
        if i % 50 == 1:  # one-use victims return too, 1/5 as often: a bonus below the cap
            policy.returned(1)
    assert 0 < policy.bonus[2] < AdaptivePolicy.MAX_BONUS  # 3-use victims return more often
    fresh = AdaptivePolicy()
    fresh._evictions, fresh._returns, fresh._scale = policy._evictions, policy._returns, policy._scale
    fresh._update()
    assert policy.bonus == fresh._bonus  # read after a return: up to date
    table = list(policy.bonus)
    for i in range(AdaptivePolicy.REFRESH - 1):
        policy.evicted((0.0, 0, 3, 0))
    assert policy.bonus == table  # fewer than REFRESH evictions, no return: the same table
    policy.evicted((0.0, 0, 3, 0))
    assert policy.bonus != table  # the REFRESH-th: recomputed (3-use victims without returns)
