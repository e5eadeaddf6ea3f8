"""Miniature simulations: which eviction policy would hit most on this pool's traffic.

Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations"
(USENIX ATC'17): a cache's hit rate under a policy is estimated by simulating that
policy on a *sample of the keys* with a cache scaled by the same factor. The sample is
spatial (a key is in or out for good), so every sampled key's reuse is seen whole and
the scaled cache holds its share of the sampled keys as the full one would.

Here the keys are block hashes and the sample is every `rate`-th block of a chain,
from an offset the chain's first block's hash picks (`sample`): a function of the key
(a block's depth and root are fixed by its hash chain), stratified over depths, and
one slice of the released sequence's blocks instead of a hash test per block. (A
sample by a hash byte instead ranked the candidates no better on
bench.eviction_quality's one-off and long-conversation traces at 2%.)

`MiniCache` is one candidate policy on the sampled blocks: a tree as the pool's (an
entry hangs under its sampled ancestor; leaves are evicted first, deeper first among
equal priorities) of `capacity` = pool ÷ rate entries, with its own ghosts and key
memory (the uses a recommitted hash gets back, as `GhostTable` gives the pool), fed
each released sequence's sampled blocks in order: those before the first one not
cached are hits (a prefix is walked from the root).

Pure: no I/O; deterministic (no randomness: the sample is a function of the hashes).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any, ClassVar

from blockd.admission import KeyMemory
from blockd.types import BlockHash

GHOSTS_PER_BLOCK = 2  # as the pool's default (DirectoryConfig.ghosts_per_block)
KEYS_PER_GHOST = 4  # as blockd.ghosts: a key memory of 8x the (mini) pool


class MiniBlock:
    """What a policy may read of a block (`EvictionPolicy.priority`), for a simulated one;
    `parent` is the sampled ancestor it was stored under (None for the first sampled)."""

    __slots__ = (
        "block_hash",
        "depth",
        "heap_key",
        "last_tick",
        "num_children",
        "num_hits",
        "num_seen",
        "parent",
        "retention",
        "run_length",
    )

    def __init__(
        self, block_hash: BlockHash, depth: int, num_seen: int, run_length: int, parent: MiniBlock | None
    ) -> None:
        self.block_hash = block_hash
        self.depth = depth
        self.num_seen = num_seen
        self.num_hits = 0
        self.retention = 0
        self.run_length = run_length
        self.last_tick = 0
        self.heap_key: int | None = None
        self.parent = parent
        self.num_children = 0


class MiniCache:
    """One policy on the sampled blocks, `capacity` entries (see the module docstring).

    A tree, as the pool's: each entry hangs under its sampled ancestor and only leaves
    (no cached sampled child) are evicted, so no entry outlives its ancestor. Measured
    flat (any entry evictable), the simulations ranked lru+seen2 above the adaptive
    policy on long-conversation and one-off at 2% where the pool ranks it below
    (bench.eviction_quality): a flat cache keeps descendants of evicted prefixes, which
    no walk reaches, and each policy wastes a different share of it.

    Invariants: len(entries) <= capacity after each `access`; an entry's parent is an
    entry; `num_children` counts the entries under it; each leaf has exactly one valid
    heap entry (its `heap_key`); a hash is never both an entry and a ghost."""

    def __init__(self, policy: Any, capacity: int) -> None:
        assert capacity >= 1, "a miniature cache holds at least one block"
        self.policy = policy
        self.capacity = capacity
        self.entries: dict[BlockHash, MiniBlock] = {}
        self._heap: list[tuple[Any, int, int, MiniBlock]] = []
        self._keys = count()
        self._ghosts: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()
        self._ghost_capacity = GHOSTS_PER_BLOCK * capacity
        self._memory = KeyMemory(KEYS_PER_GHOST * self._ghost_capacity)
        self.num_evictions = 0

    def access(self, blocks: Sequence[Any], tick: int) -> int:
        """One released sequence's sampled blocks, root first (each with `block_hash`,
        `depth`, `is_cached`, `retention`, `run_length`); answers how many hit: those
        before its first sampled block not cached here (the walk ends there)."""
        entries = self.entries
        num_hits = 0
        parent: MiniBlock | None = None
        touched = []
        for block in blocks:
            block_hash = block.block_hash
            entry = entries.get(block_hash)
            if entry is None:
                if not block.is_cached:  # never indexed (cache_policy, or its prefix was not)
                    break
                ghost = self._ghosts.pop(block_hash, None)
                if ghost is not None:
                    self.policy.returned(*ghost)
                    seen = 1 + ghost[0]
                else:
                    seen = 2 if block_hash in self._memory else 1
                entry = entries[block_hash] = MiniBlock(
                    block_hash, block.depth, seen, block.run_length, parent
                )
                if parent is not None:
                    parent.num_children += 1
            else:
                num_hits += 1
                entry.num_hits += 1
            entry.last_tick = tick
            entry.retention = max(entry.retention, block.retention)
            touched.append(entry)
            parent = entry
        push = self._push
        for entry in touched:
            if not entry.num_children:
                push(entry)
        if len(entries) > self.capacity:
            self._evict(len(entries) - self.capacity)
        if len(self._heap) > 2 * len(entries) + 64:
            self._heap = [item for item in self._heap if item[3].heap_key == item[2]]
            heapq.heapify(self._heap)
        return num_hits

    def _push(self, entry: MiniBlock) -> None:
        key = next(self._keys)
        entry.heap_key = key
        heapq.heappush(self._heap, (self.policy.priority(entry), -entry.depth, key, entry))

    def _evict(self, num: int) -> None:
        heap, entries, ghosts, policy = self._heap, self.entries, self._ghosts, self.policy
        victims = []
        while num:
            priority, _, key, entry = heapq.heappop(heap)
            if entry.heap_key != key or entry.num_children:
                continue
            policy.evicted(priority)
            entry.heap_key = None
            block_hash = entry.block_hash
            del entries[block_hash]
            ghosts[block_hash] = (entry.num_seen + entry.num_hits, entry.run_length)
            victims.append(block_hash)
            num -= 1
            parent = entry.parent
            if parent is not None:
                parent.num_children -= 1
                if not parent.num_children:
                    self._push(parent)  # a leaf now: ranked as the pool ranks a new leaf
        self.num_evictions += len(victims)
        excess = len(ghosts) - self._ghost_capacity
        for _ in range(max(0, excess)):
            ghosts.popitem(last=False)
        self._memory.add_many(victims)


class PolicyChooser:
    """Miniature simulations of `candidates` (policy names) on one pool's released
    sequences; `best` is the index of the candidate that has hit most lately.

    Hits are counted per candidate and halved every HALF_LIFE sampled blocks, so the
    choice follows a changing workload. The choice moves from the current candidate only
    once every simulation has evicted MIN_EVICTIONS x its capacity (the caches are warm
    and their rates mean something) and another has hit more than (1 + MARGIN) x as
    often (hysteresis: where candidates are within MARGIN the live pool gains nothing
    from a switch, which costs a re-key of its heap).

    Memory (estimated from object sizes, not measured): per candidate, `capacity` entries
    (a MiniBlock, a dict and a heap entry: ~350 B), 2x as many ghosts (~120 B) and a key
    memory of 8x (3 B a key): ~620 B per block of `capacity` (`nbytes_per_block`). CPU
    (bench.blockd_inprocess, 4,096-block pools, rate 4 at MINI_BLOCKS 1024; one slice per
    release, then each candidate's `access` on 1/rate of the sequence's blocks): with four
    candidates ~1,270-1,360 us per admission against ~560-610 for `adaptive`; with three,
    ~1,050 (at MINI_BLOCKS 256: ~695).
    """

    # Target capacity of each simulation (rate = pool / MINI_BLOCKS). Measured on
    # bench.eviction_quality's 28 cells, worst ratio to the best other shipped policy, with
    # adaptive, lfu and lru+seen2 as candidates: 1024, 0.968 (long-conversation 2%, where
    # lfuda is best: with it a candidate, 0.971 at one-off 2%); 256, 0.944 (one-off 2%: at
    # rate ~10 the candidates, 5% apart in the pool, came out within 2% in the wrong order);
    # the adaptive default 0.955. A MARGIN of 0.03 instead of 0.01: 0.943 (an early wrong
    # choice held); hits halved every 128 x capacity instead of 32: 0.968; a switch that also
    # needs a lead over 2 x sqrt(the two counts): 0.959.
    MINI_BLOCKS: ClassVar[int] = 1024
    HALF_LIFE_POOLS: ClassVar[int] = 32  # hits halved every this many x capacity sampled blocks
    MIN_EVICTIONS: ClassVar[int] = 2  # x capacity, per simulation, before the choice moves
    MARGIN: ClassVar[float] = 0.01

    def __init__(self, num_blocks: int, candidates: Sequence[str], make: Callable[[str, float], Any]) -> None:
        assert candidates, "at least one candidate"
        self.rate = max(1, round(num_blocks / self.MINI_BLOCKS))
        self.capacity = max(1, num_blocks // self.rate)
        self.candidates = tuple(candidates)
        self.caches = [MiniCache(make(name, self.rate), self.capacity) for name in self.candidates]
        self.hits = [0.0] * len(self.candidates)
        self.best = 0
        self._half_life = self.HALF_LIFE_POOLS * self.capacity
        self._since = 0  # sampled blocks since the last halving

    @property
    def nbytes_per_block(self) -> float:
        """Approximate bytes of simulation state per block of the real pool."""
        return len(self.caches) * 620 * self.capacity / max(1, self.capacity * self.rate)

    def sample(self, blocks: Sequence[Any]) -> Sequence[Any]:
        """The sampled blocks of a released sequence (root first): those at depths
        congruent to an offset its root's hash picks, modulo `rate`."""
        rate = self.rate
        if rate == 1:
            return blocks
        if not blocks or blocks[0].depth != 0:
            return ()  # not from the root (a resync's tail): its depths are unknown here
        return blocks[blocks[0].block_hash[0] % rate :: rate]

    def observe(self, blocks: Sequence[Any], tick: int) -> bool:
        """A sequence was released at `tick` with `blocks` (root first); answers whether
        `best` changed."""
        sampled = self.sample(blocks)
        if not sampled:
            return False
        hits = self.hits
        for i, cache in enumerate(self.caches):
            hits[i] += cache.access(sampled, tick)
        self._since += len(sampled)
        if self._since >= self._half_life:
            self._since = 0
            self.hits = hits = [h / 2 for h in hits]
        return self._choose()

    def _choose(self) -> bool:
        hits, best = self.hits, self.best
        leader = max(range(len(hits)), key=hits.__getitem__)
        if leader == best or hits[leader] <= hits[best] * (1 + self.MARGIN):
            return False
        warm = self.MIN_EVICTIONS * self.capacity
        if any(cache.num_evictions < warm for cache in self.caches):
            return False
        self.best = leader
        return True
