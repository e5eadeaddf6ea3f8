"""A vLLM-style prefix cache (v1 block pool), simulated: the baseline for eviction quality.

What it copies from vLLM's block pool:
- one free queue of every unreferenced block, cached or not, least recently freed at
  the front; allocation pops from the front and, if that block carries a hash,
  evicts it from the hash map (whatever its position in a chain);
- a finished request frees its blocks tail first, so a chain's tail sits ahead of its
  head in the queue;
- a hit on a block in the free queue takes it out of the queue ("touch");
- lookups walk the prompt's block hashes until the first miss; several physical
  blocks may carry the same hash (the map holds a set per hash).
Unlike blockd it may evict a block whose children stay cached: those children keep
their pool slots but cannot be hit until the parent is computed again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from bench.belady import ReplayResult
from bench.prefix_keys import PrefixKeys


def replay_vllm(trace: Sequence[Sequence[int]], num_blocks: int, block_size: int) -> ReplayResult:
    keys = PrefixKeys(block_size)
    free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
    key_of: list[int | None] = [None] * num_blocks
    ref_count = [0] * num_blocks
    by_key: dict[int, dict[int, None]] = {}  # key -> physical blocks carrying it (insertion order)
    hit_tokens = queried = evictions = 0
    hits_of: list[int] = []
    for prompt in trace:
        chain = keys.chain(prompt)
        table: list[int] = []
        for key in chain:  # longest cached prefix
            holders = by_key.get(key)
            if not holders:
                break
            table.append(next(iter(holders)))
        num_hits = len(table)
        for block in table:  # touch
            if ref_count[block] == 0:
                del free[block]
            ref_count[block] += 1
        need = keys.num_blocks(len(prompt)) - num_hits
        assert need <= len(free), "a prompt larger than the pool"
        for _ in range(need):
            block, _ = free.popitem(last=False)
            old = key_of[block]
            if old is not None:
                del by_key[old][block]
                if not by_key[old]:
                    del by_key[old]
                key_of[block] = None
                evictions += 1
            ref_count[block] = 1
            table.append(block)
        for i in range(num_hits, len(chain)):  # cache the new full blocks
            block, key = table[i], chain[i]
            key_of[block] = key
            by_key.setdefault(key, {})[block] = None
        for block in reversed(table):  # free tail first
            ref_count[block] -= 1
            if ref_count[block] == 0:
                free[block] = None
        hit_tokens += num_hits * block_size
        hits_of.append(num_hits * block_size)
        queried += len(prompt)
    return ReplayResult(hit_tokens, queried, evictions, tuple(hits_of))
