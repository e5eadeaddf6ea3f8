"""The admission gate decides for every tier (issue 44): with the device pool's gate
closed, a block seen once (on probation) is neither demoted to the host tier nor written
through to the shared tier; a block its key memory or a hit admits is, and a block held
back at commit is written through on the hit that admits it. With the gate open (its
start) every tier behaves as without a gate."""

from __future__ import annotations

from blockd.eviction import GatedPolicy
from blockd.types import AdmitOp, HostSpec
from tests.blockd.helpers import Harness, harness
from tests.blockd.test_host_tier import BS, _fill_with_b
from tests.blockd.test_shared_tier import SHARED, stored_on

A = [1, 2, 3, 4]  # two blocks (test_host_tier's A)


def _close_gate(h: Harness) -> GatedPolicy:
    policy = h.pool.leaves.policy
    assert isinstance(policy, GatedPolicy), "the default policy has the gate"
    policy.gate = GatedPolicy.MAX_PENALTY  # until a return or REFRESH evictions recompute it
    return policy


def test_a_closed_gate_keeps_a_once_seen_chain_out_of_the_host_tier():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8))
    _close_gate(h)
    step = _fill_with_b(h)  # A, used once, is evicted for B
    assert step.demotions == () and h.pool.host.counters.num_demotions == 0
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_cached_tokens == 0


def test_a_closed_gate_still_demotes_a_chain_a_hit_admitted():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8))
    _close_gate(h)
    h.run(1, A)
    h.run(3, A)  # hit: admitted
    step = _fill_with_b(h)
    assert len(step.demotions) == 2
    assert h.directory.lookup(A, pool_id=h.pool_id)[0].num_host_cached_tokens == 4


def test_an_open_gate_demotes_as_without_one():
    h = harness(num_blocks=4, block_size=BS, host=HostSpec(8))
    assert h.pool.leaves.policy.gate == 0.0  # it starts open
    assert len(_fill_with_b(h).demotions) == 2


def test_a_closed_gate_writes_a_block_through_on_the_hit_that_admits_it():
    h = harness(num_blocks=16, block_size=BS, host=SHARED)
    _close_gate(h)
    tokens = [1, 2, 3, 4, 5, 6]
    assert stored_on(h, 1, tokens) == ()  # seen once: on probation, not written
    step = h.step(admits=[AdmitOp(2, tokens + [9])])
    assert step.admits[0].num_cached_tokens == 6
    assert [s.depth for s in step.shared_stores] == [0, 1, 2]  # the hit admitted them
    h.tables[2] = step.admits[0].block_ids
    h.release(2)
    assert stored_on(h, 3, [7, 8, 7, 8]) == ()  # another once-seen chain stays out


def test_an_open_gate_writes_through_at_commit():
    h = harness(num_blocks=16, block_size=BS, host=SHARED)
    assert len(stored_on(h, 1, [1, 2, 3, 4, 5, 6])) == 3
