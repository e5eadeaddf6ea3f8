"""Cache-aware routing: order pools by the prefix they hold, then by load."""

from __future__ import annotations

from blockd.types import PoolMatch

# A host tier hit saves the prefill but pays a copy into the device pool first, so it
# counts for less than a device hit of the same length when pools are compared.
HOST_HIT_WEIGHT = 0.75
# A shared tier hit pays a network fetch (and a miss there costs a recompute after a
# timeout): it counts for less than a host hit. Every pool of a namespace sees the same
# shared blocks, so this only orders pools whose device or host prefixes differ.
SHARED_HIT_WEIGHT = 0.5


def weighted_prefix(match: PoolMatch) -> float:
    device_tokens = match.num_cached_tokens - match.num_host_cached_tokens - match.num_shared_cached_tokens
    return (
        device_tokens
        + HOST_HIT_WEIGHT * match.num_host_cached_tokens
        + SHARED_HIT_WEIGHT * match.num_shared_cached_tokens
    )


def by_cached_prefix(matches: list[PoolMatch]) -> list[PoolMatch]:
    """Longest cached prefix first (host tier tokens weighed below device ones); then
    lower load, then lower cache occupancy (a new prefix spreads to the pool where it
    evicts least, instead of always the same one), then pool id."""
    return sorted(matches, key=lambda m: (-weighted_prefix(m), m.load, m.occupancy, m.pool_id))


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
