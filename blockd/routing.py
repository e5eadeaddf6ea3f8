"""Cache-aware routing: order pools by the prefix they hold, then by load."""

from __future__ import annotations

from blockd.types import PoolMatch


def by_cached_prefix(matches: list[PoolMatch]) -> list[PoolMatch]:
    """Longest cached prefix first; then lower load, then lower cache occupancy (a new
    prefix spreads to the pool where it evicts least, instead of always the same one),
    then pool id."""
    return sorted(matches, key=lambda m: (-m.num_cached_tokens, m.load, m.occupancy, m.pool_id))


def rank_for_route(matches: list[PoolMatch], load_margin: float) -> list[PoolMatch]:
    """Best first. A pool whose load exceeds the least loaded pool's by more than
    `load_margin` goes behind every other pool, whatever prefix it holds: a worker
    that caches a hot prefix must not be swamped by every request sharing it."""
    if not matches:
        return []
    least_load = min(m.load for m in matches)
    eligible = [m for m in matches if m.load <= least_load + load_margin]
    overloaded = [m for m in matches if m.load > least_load + load_margin]
    return by_cached_prefix(eligible) + by_cached_prefix(overloaded)
