"""Belady's offline optimum for a prefix cache of blocks (a simulator; no blockd involved).

Requests run one at a time: the longest cached prefix of full blocks hits, the rest
of the prompt gets blocks (evicting if the pool is full), then its full blocks are
cached and the partial tail block is freed. Prefix-tree semantics: a block is usable
only while its whole prefix is cached, so only leaves (cached blocks without a cached
child) are evicted, and the victim is the leaf whose next use lies farthest in the
future (never used again first). A child is never used without its parent, so the
farthest leaf is also a farthest block: this is Belady's rule on the tree.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from bench.prefix_keys import PrefixKeys

NEVER = 1 << 62


@dataclass(frozen=True)
class ReplayResult:
    hit_tokens: int
    queried_tokens: int
    num_evictions: int
    hits: tuple[int, ...] = ()  # hit tokens of each request, in trace order

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class _Node:
    __slots__ = ("key", "next_use", "num_children", "parent")

    def __init__(self, key: int, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.num_children = 0
        self.next_use = NEVER


def replay_belady(trace: Sequence[Sequence[int]], num_blocks: int, block_size: int) -> ReplayResult:
    keys = PrefixKeys(block_size)
    chains = [keys.chain(prompt) for prompt in trace]
    uses: dict[int, list[int]] = {}
    for t, chain in enumerate(chains):
        for key in chain:
            uses.setdefault(key, []).append(t)

    def next_use(key: int, now: int) -> int:
        times = uses[key]
        i = bisect.bisect_right(times, now)
        return times[i] if i < len(times) else NEVER

    cached: dict[int, _Node] = {}
    heap: list[tuple[int, int, int]] = []  # (-next_use, key, next_use) of leaves; lazy
    hit_tokens = queried = evictions = 0
    hits_of: list[int] = []

    def push_if_leaf(node: _Node) -> None:
        if node.num_children == 0:
            heapq.heappush(heap, (-node.next_use, node.key, node.next_use))

    for t, (prompt, chain) in enumerate(zip(trace, chains)):
        num_hits = 0
        while num_hits < len(chain) and chain[num_hits] in cached:
            num_hits += 1
        hits = [cached[k] for k in chain[:num_hits]]
        protected = {node.key for node in hits}
        for node in hits:
            node.next_use = next_use(node.key, t)
            push_if_leaf(node)
        need = keys.num_blocks(len(prompt)) - num_hits
        assert keys.num_blocks(len(prompt)) <= num_blocks, "a prompt larger than the pool"
        set_aside = []
        while num_blocks - len(cached) < need:
            neg, key, stamp = heapq.heappop(heap)
            node = cached.get(key)
            if node is None or node.num_children or node.next_use != stamp:
                continue  # stale entry
            if key in protected:
                set_aside.append((neg, key, stamp))
                continue
            del cached[key]
            evictions += 1
            if node.parent is not None:
                node.parent.num_children -= 1
                push_if_leaf(node.parent)
        for entry in set_aside:
            heapq.heappush(heap, entry)
        parent = hits[-1] if hits else None
        for key in chain[num_hits:]:  # commit: the new full blocks become cached
            node = _Node(key, parent)
            node.next_use = next_use(key, t)
            cached[key] = node
            if parent is not None:
                parent.num_children += 1
            parent = node
        if parent is not None and len(chain) > num_hits:
            push_if_leaf(parent)
        hit_tokens += num_hits * block_size
        hits_of.append(num_hits * block_size)
        queried += len(prompt)
    return ReplayResult(hit_tokens, queried, evictions, tuple(hits_of))
