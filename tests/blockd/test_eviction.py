"""Eviction order: the chain fast path (a parent evicted at once when the heap would
answer it next) must evict exactly what the heap alone would, in the same order."""

from __future__ import annotations

import random

import pytest

from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.events import EventKind
from blockd.eviction import AdaptivePolicy, EvictableLeaves
from blockd.types import AdmitOp, CommitOp, ReleaseOp
from tests.blockd.helpers import NAMESPACE, harness, patches_blockd
from tests.blockd.invariants import FakeClock, check_invariants, snapshot

BLOCK_SIZE = 2


def _workload(directory: BlockDirectory, seed: int) -> list[tuple]:
    """Random admissions of long prompts over shared prefixes under pressure, commits,
    releases and pins held for a while (an unpin stamps a parent newer than its
    leaves, and LFU ranks parents by their hits, so a parent is not always next);
    answers the REMOVED events."""
    rng = random.Random(seed)
    reg = directory.register_pool(40, BLOCK_SIZE, NAMESPACE, "w")
    bases = [[rng.randrange(3) for _ in range(30)] for _ in range(4)]
    live: dict[int, tuple[list[int], tuple[int, ...], int]] = {}
    pins: list[str] = []
    for sequence_id in range(400):
        roll = rng.random()
        if roll < 0.45 or not live:
            base = rng.choice(bases)
            tokens = base[: rng.randint(1, 30)] + [rng.randrange(3) for _ in range(rng.randint(0, 6))]
            admit = directory.step(reg.pool_id, reg.epoch, admits=[AdmitOp(sequence_id, tokens)]).admits[0]
            if admit.admitted:
                live[sequence_id] = (tokens, admit.block_ids, admit.num_cached_tokens)
        elif roll < 0.85:
            victim = rng.choice(sorted(live))
            tokens, table, cached = live.pop(victim)
            first, last = cached // BLOCK_SIZE, len(tokens) // BLOCK_SIZE
            commits = []
            if last > first and rng.random() < 0.9:
                run = tokens[first * BLOCK_SIZE : last * BLOCK_SIZE]
                commits = [CommitOp(victim, table[first:last], run)]
            directory.step(reg.pool_id, reg.epoch, commits=commits, releases=[ReleaseOp(victim)])
        elif roll < 0.93 or not pins:
            pins.append(directory.pin(rng.choice(bases)[: rng.randint(2, 30)]).pin_id)
        else:
            directory.unpin(pins.pop(rng.randrange(len(pins))))
        check_invariants(directory)
    return [
        (e.kind, e.block_hashes, e.block_ids) for e in directory.events.read(0) if e.kind is EventKind.REMOVED
    ]


@pytest.mark.parametrize(
    ("policy", "seed"),
    [(p, seed) for p in ("lru", "lfu") for seed in range(8)]
    + [(p, seed) for p in ("adaptive", "lfuda", "lru+seen2") for seed in range(4)],
)
@patches_blockd
def test_chain_fast_path_evicts_what_the_heap_would(policy, seed, monkeypatch):
    config = DirectoryConfig(eviction_policy=policy, event_log_capacity=100_000, pin_budget=1.0)
    fast = BlockDirectory(config, clock=FakeClock())
    fast_events = _workload(fast, seed)
    # () sorts before every priority: no parent is ever taken past the heap
    monkeypatch.setattr(EvictableLeaves, "first_priority", lambda self: ())
    heap_only = BlockDirectory(config, clock=FakeClock())
    assert _workload(heap_only, seed) == fast_events
    assert fast_events, "the workload must evict"
    assert _without_pins(snapshot(fast)) == _without_pins(snapshot(heap_only))


def _without_pins(snap: tuple) -> tuple:
    pools, _, last = snap  # pin ids are random
    return tuple(p[1:] for p in pools), last  # so are pool ids


def test_a_parent_newer_than_another_leaf_waits_its_turn():
    h = harness(num_blocks=3, block_size=2)
    h.run(1, [1, 2, 3, 4])  # a0 <- a1, released at tick 1
    h.run(2, [5, 6])  # b0, released at tick 2
    h.directory.unpin(h.directory.pin([1, 2]).pin_id)  # a0 unpinned at tick 3: newer than b0
    # leaves: a1 (t1), b0 (t2); a0 (t3) becomes a leaf once a1 goes, but b0 is older
    seen = h.directory.events.last_sequence
    h.admit(3, [7, 8, 9, 10])  # two blocks: evicts a1, then b0 (not a0)
    removed = [e for e in h.directory.events.read(seen) if e.kind is EventKind.REMOVED]
    assert [e.block_ids for e in removed] == [(h.tables[3][0], h.tables[3][1])]
    assert h.directory.lookup([1, 2, 3, 4])[0].num_cached_tokens == 2  # a0 stays
    assert h.directory.lookup([5, 6])[0].num_cached_tokens == 0


def test_a_use_class_bonus_is_linear_in_its_return_ratio():
    # 2-use victims come back 8x as often as one-use victims (enough of both that the
    # prior is negligible): they live 8 / 2^MARGIN - 1 horizons longer (log2 would give
    # 3 - MARGIN), and a ratio past the cap gives MAX_BONUS.
    policy = AdaptivePolicy()
    for i in range(40_000):
        policy.evicted((float(i), i, 1, 0))
        policy.evicted((float(i), i, 2, 0))
        if i % 10 == 0:
            policy.returned(1)
        if i % 10 < 8:
            policy.returned(2)
    ratio = 8.0
    assert policy.bonus[1] == pytest.approx(ratio / 2**AdaptivePolicy.MARGIN - 1, rel=0.02)
    assert policy.bonus[0] == 0.0  # the one-use class earns nothing against itself
    for i in range(40_000):
        policy.evicted((float(i), i, 1, 0))
        policy.evicted((float(i), i, 3, 0))
        policy.returned(3)  # every 3-use victim returns, one-use ones almost never
    assert policy.bonus[2] == AdaptivePolicy.MAX_BONUS
