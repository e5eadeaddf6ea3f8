"""The directory's Step path leaves no reference cycles behind.

blockd.server._tune_gc collects young objects only: a survivor of one young collection is
never scanned again, so a cycle that outlives one is never freed. That is sound only while
the directory's records (blocks, sequences, pins, ghosts, events) free themselves by
reference counting, which these tests check under eviction, host demotion and pins.
"""

from __future__ import annotations

import gc
import random

import pytest

from blockd.eviction import POLICY_NAMES
from blockd.server import GC_THRESHOLDS
from blockd.types import CommitOp, HostSpec, Tier
from tests.blockd.helpers import NAMESPACE, harness

BS = 4


@pytest.fixture
def collector_off():
    """Automatic collection off, the heap clean at the start; restored after."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _cycles_left() -> list[str]:
    """Type names of what a full collection finds unreachable (the cycles left behind)."""
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return sorted({type(obj).__name__ for obj in gc.garbage})
    finally:
        gc.garbage.clear()
        gc.set_debug(flags)


def _churn(h, seed: int, rounds: int, write_shared: bool = False) -> None:
    """Requests over a few shared prefixes with unique tails, through a pool far smaller
    than what they touch: hits, misses, evictions and grows of the tables."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(3 * BS)] for _ in range(4)]
    for sequence_id in range(rounds):
        tokens = prefixes[sequence_id % 4] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 4 * BS))]
        result = h.admit(sequence_id, tokens)
        assert result.admitted
        # blocks loaded from a lower tier are committed with the prefill's
        loaded = len(result.loads) + len(result.shared_loads)
        first, last = result.num_cached_tokens // BS - loaded, len(tokens) // BS
        if last > first:
            table = h.tables[sequence_id]
            step = h.step(commits=[CommitOp(sequence_id, table[first:last], tokens[first * BS : last * BS])])
            if write_shared and step.shared_stores:  # the worker wrote them: now findable
                h.step(shared_written=[store.block_hash for store in step.shared_stores])
        h.release(sequence_id)


def test_the_step_path_leaves_no_cycles(collector_off):
    h = harness(num_blocks=12, block_size=BS)
    _churn(h, 0, 200)
    stats = h.directory.stats().total
    assert stats.num_evictions > 100 and stats.hit_tokens > 0  # the churn did evict and hit
    assert _cycles_left() == []


def test_with_a_host_tier_the_step_path_leaves_no_cycles(collector_off):
    h = harness(num_blocks=8, block_size=BS, host=HostSpec(16))
    _churn(h, 1, 200)
    assert h.directory.stats().total.host.num_evictions > 0  # the host tier took and dropped blocks
    assert _cycles_left() == []


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("host", [None, HostSpec(16)], ids=["device", "host-tier"])
def test_resetting_a_pool_leaves_no_cycles(collector_off, host, policy):
    """A re-registration by its owner and a resync each replace the pool's state: the old
    one must go by reference counting (its eviction policy once referred to itself)."""
    h = harness(
        num_blocks=8, block_size=BS, eviction_policy=policy, **({} if host is None else {"host": host})
    )
    _churn(h, 2, 50)
    reg = h.directory.register_pool(
        8,
        BS,
        NAMESPACE,
        "worker-0:50052",
        pool_id=h.pool_id,
        pool_token=h.pool_token,
        **({} if host is None else {"host": host}),
    )
    assert reg.epoch > h.epoch
    h.epoch = reg.epoch
    h.tables.clear()
    _churn(h, 3, 50)
    h.directory.resync(h.pool_id, h.epoch, [])
    _churn(h, 4, 50)
    assert _cycles_left() == []


def test_with_the_shared_tier_neither_the_step_path_nor_a_flush_leaves_cycles(collector_off):
    """Shared records link parent and children both ways while resident: leaving the
    index (evicted past its bound, flushed, reset) must undo it."""
    h = harness(num_blocks=8, block_size=BS, host=HostSpec(16, has_shared_tier=True))
    _churn(h, 5, 100, write_shared=True)
    assert h.directory.stats().total.shared.num_blocks > 0  # the shared tier held blocks
    h.directory.flush(tier=Tier.SHARED)
    h.directory.resync(h.pool_id, h.epoch, [])
    h.tables.clear()
    _churn(h, 6, 50, write_shared=True)
    assert _cycles_left() == []


def test_a_cycle_is_found(collector_off):
    """The check can fail: a cycle made on purpose is reported."""
    a: list = []
    a.append(a)
    del a
    assert _cycles_left() == ["list"]


def test_older_generations_are_never_collected_automatically():
    assert GC_THRESHOLDS[0] <= 5_000  # a young collection's pause stays short
    assert min(GC_THRESHOLDS[1:]) >= 10**9  # survivors are never scanned again
