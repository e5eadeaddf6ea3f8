"""Miniature simulations (blockd.minisim) and the policy that follows them
(blockd.eviction.SimulatedPolicy, `adaptive-sim`), through the real directory core."""

from __future__ import annotations

from types import SimpleNamespace

from blockd.config import DirectoryConfig
from blockd.directory import BlockDirectory
from blockd.eviction import LruPolicy, SimulatedPolicy, _make_candidate
from blockd.minisim import MiniCache, PolicyChooser
from blockd.types import AdmitOp, CommitOp, Namespace, ReleaseOp
from tests.blockd.invariants import check_invariants

BLOCK_SIZE = 4


def _chain(name: str, length: int) -> list[SimpleNamespace]:
    """What a MiniCache reads of a released sequence's blocks, root first."""
    return [
        SimpleNamespace(
            block_hash=f"{name}/{d}".encode(), depth=d, is_cached=True, retention=0, run_length=length
        )
        for d in range(length)
    ]


def _check_tree(cache: MiniCache) -> None:
    assert len(cache.entries) <= cache.capacity
    for entry in cache.entries.values():
        assert entry.parent is None or cache.entries.get(entry.parent.block_hash) is entry.parent
        children = sum(1 for other in cache.entries.values() if other.parent is entry)
        assert entry.num_children == children


def test_a_miniature_cache_evicts_leaves_first_and_hits_only_a_prefix():
    cache = MiniCache(LruPolicy(), 3)
    assert cache.access(_chain("a", 3), tick=1) == 0
    assert cache.access(_chain("b", 1), tick=2) == 0  # evicts a's leaf (a/2), not its root
    _check_tree(cache)
    assert set(cache.entries) == {b"a/0", b"a/1", b"b/0"}
    # a/0 and a/1 hit; a/2 (evicted) ends the walk
    assert cache.access(_chain("a", 3), tick=3) == 2
    _check_tree(cache)
    assert b"b/0" not in cache.entries  # the least recent leaf went


def test_a_miniature_cache_never_stores_what_the_pool_did_not_index():
    cache = MiniCache(LruPolicy(), 8)
    blocks = _chain("a", 3)
    blocks[1].is_cached = False  # e.g. cache_policy READ_ONLY
    cache.access(blocks, tick=1)
    assert set(cache.entries) == {b"a/0"}


def _cycle(num_keys: int, rounds: int) -> list[list[SimpleNamespace]]:
    """Single-block requests: 10 keys used 5 times each, then `num_keys` in a loop.
    Recency never hits a loop longer than the pool; frequency keeps the 10 that got ahead."""
    warm = [_chain(f"k{i}", 1) for i in range(10) for _ in range(5)]
    return warm + [_chain(f"k{i}", 1) for _ in range(rounds) for i in range(num_keys)]


def test_the_chooser_picks_lfu_on_a_loop_longer_than_the_pool():
    chooser = PolicyChooser(20, SimulatedPolicy.CANDIDATES, _make_candidate)
    assert chooser.rate == 1 and chooser.capacity == 20
    changes = [tick for tick, blocks in enumerate(_cycle(30, 40)) if chooser.observe(blocks, tick)]
    assert SimulatedPolicy.CANDIDATES[chooser.best] == "lfu"
    assert changes, "it left the adaptive order"
    lfu = SimulatedPolicy.CANDIDATES.index("lfu")
    assert chooser.hits[lfu] > 1.5 * max(h for i, h in enumerate(chooser.hits) if i != lfu)
    for cache in chooser.caches:
        _check_tree(cache)


def test_the_chooser_samples_every_rate_th_block_of_a_chain_from_its_roots_offset():
    chooser = PolicyChooser(4 * PolicyChooser.MINI_BLOCKS, SimulatedPolicy.CANDIDATES, _make_candidate)
    assert chooser.rate == 4 and chooser.capacity == PolicyChooser.MINI_BLOCKS
    blocks = _chain("a", 10)
    sampled = chooser.sample(blocks)
    offset = blocks[0].block_hash[0] % 4
    assert [b.depth for b in sampled] == list(range(offset, 10, 4))
    assert chooser.sample(blocks[1:]) == ()  # not from the root: its depths are not known here


def _replay(policy: str, prompts: list[list[int]], num_blocks: int, check: bool = False):
    directory = BlockDirectory(DirectoryConfig(eviction_policy=policy), clock=lambda: 0.0)
    reg = directory.register_pool(num_blocks, BLOCK_SIZE, Namespace("minisim"), "sim:0")
    pool = directory._slots[reg.pool_id].pool
    hit_tokens = 0
    modes = []
    for seq_id, prompt in enumerate(prompts):
        result = directory.step(reg.pool_id, reg.epoch, admits=[AdmitOp(seq_id, prompt)]).admits[0]
        first = result.num_cached_tokens // BLOCK_SIZE
        last = len(prompt) // BLOCK_SIZE
        commits = [
            CommitOp(seq_id, result.block_ids[first:last], prompt[first * BLOCK_SIZE : last * BLOCK_SIZE])
        ]
        directory.step(
            reg.pool_id, reg.epoch, commits=commits if last > first else [], releases=[ReleaseOp(seq_id)]
        )
        hit_tokens += result.num_cached_tokens
        policy_now = pool.leaves.policy
        if isinstance(policy_now, SimulatedPolicy):
            modes.append(policy_now.mode)
        if check:
            check_invariants(directory)
            _check_heap(pool)
    return hit_tokens, modes, pool


def _check_heap(pool) -> None:
    """Every valid heap entry carries the priority the policy gives its block now, up to
    the policy's own drift (an order change re-keys them all): entries of another order
    would compare on another scale."""
    policy = pool.leaves.policy
    for priority, key, block in pool.leaves._heap:
        valid = block.heap_key == key and block.is_evictable_leaf
        if valid and isinstance(policy, SimulatedPolicy) and policy.mode in ("lfu", "lru+seen2"):
            assert priority == policy.priority(block), (policy.mode, priority, policy.priority(block))


def _loop_prompts(num_keys: int, rounds: int) -> list[list[int]]:
    """Two-block prompts: `num_keys` others once (the pool is under pressure: simulations
    start), 10 used 5 times each, then `num_keys` in a loop (as `_cycle`)."""

    def prompt(k: int) -> list[int]:
        return [k * 100 + t for t in range(2 * BLOCK_SIZE)]

    fill = [prompt(k) for k in range(num_keys, 2 * num_keys)]
    warm = [prompt(k) for k in range(10) for _ in range(5)]
    return fill + warm + [prompt(k) for _ in range(rounds) for k in range(num_keys)]


def test_a_pool_follows_the_simulations_to_lfu_and_keeps_its_invariants():
    prompts = _loop_prompts(30, 30)
    simulated, modes, pool = _replay("adaptive-sim", prompts, 40, check=True)
    adaptive, _, _ = _replay("adaptive", prompts, 40)
    assert modes[-1] == "lfu" and modes[0] == "adaptive"
    assert simulated > 1.5 * adaptive  # recency never hits a loop longer than the pool
    assert pool.num_free + pool.num_evictable + pool.num_referenced == pool.num_blocks


def test_the_simulations_are_deterministic():
    prompts = _loop_prompts(30, 20)
    assert _replay("adaptive-sim", prompts, 40)[:2] == _replay("adaptive-sim", prompts, 40)[:2]


def test_without_pressure_nothing_is_simulated():
    prompts = _loop_prompts(5, 10)
    hits, modes, pool = _replay("adaptive-sim", prompts, 64)
    assert pool.counters.num_evictions == 0 and pool.leaves.policy._chooser is None
    assert set(modes) == {"adaptive"}
    assert hits == _replay("adaptive", prompts, 64)[0]
