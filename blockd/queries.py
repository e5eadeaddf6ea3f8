"""Operator queries: stats, pools, cached blocks, and cached-prefix matches.

Read-only: nothing here changes a pool. Functions of the directory's slots, so the
directory's methods stay one line each.
"""

from __future__ import annotations

from collections.abc import Iterable

from blockd.block import Block
from blockd.ghosts import MissReason
from blockd.hashing import tokens_of
from blockd.leases import PoolSlot
from blockd.pool import BlockPool
from blockd.prompt import Prompt
from blockd.types import (
    BlockInfo,
    BlockPage,
    MissExplanation,
    PoolId,
    PoolInfo,
    PoolMatch,
    PoolStats,
    Tier,
    TierStats,
)
from blockd.validation import encode_page_token

_SUMMED = (
    "num_blocks",
    "num_free_blocks",
    "num_evictable_blocks",
    "num_referenced_blocks",
    "num_pinned_blocks",
    "num_cached_blocks",
    "num_sequences",
    "queried_tokens",
    "hit_tokens",
    "num_evictions",
    "num_admissions",
    "num_admissions_deferred",
    "num_ghosts",
    "max_ghosts",
)


def host_stats(pool: BlockPool) -> TierStats | None:
    host = pool.host
    if host is None:
        return None
    c = host.counters
    return TierStats(
        Tier.HOST,
        host.num_blocks,
        len(host.free),
        host.num_evictable,
        host.num_referenced,
        c.hit_tokens,
        c.num_demotions,
        c.num_loads,
        c.num_evictions,
        c.num_loads_skipped,
        host.load_seconds_per_block,
        host.recompute_seconds_per_block,
    )


def shared_stats(pool: BlockPool) -> TierStats | None:
    """The shared tier as this pool uses it: its namespace's resident blocks, and this
    pool's writes (demotions), fetches (loads) and records found gone (evictions)."""
    shared = pool.shared
    if shared is None:
        return None
    c = pool.counters.shared
    return TierStats(
        Tier.SHARED,
        len(shared),
        0,
        len(shared),
        0,
        c.hit_tokens,
        c.num_stores,
        c.num_loads,
        c.num_missing,
        c.num_loads_skipped,
        pool.host_spec.shared_load_seconds_per_block,
        pool.host_spec.prefill_seconds_per_token * pool.block_size,
    )


def pool_stats(pool: BlockPool) -> PoolStats:
    c = pool.counters
    return PoolStats(
        pool.pool_id,
        pool.num_blocks,
        pool.block_size,
        pool.num_free,
        pool.num_evictable,
        pool.num_referenced,
        pool.num_pinned,
        len(pool.index),
        len(pool.sequences),
        c.queried_tokens,
        c.hit_tokens,
        c.num_evictions,
        c.num_admissions,
        c.num_admissions_deferred,
        host_stats(pool),
        tuple(sorted(c.miss_tokens.items())),
        len(pool.ghosts),
        pool.ghosts.capacity,
        pool.leaves.policy.name,
        shared_stats(pool),
    )


def total(pools: Iterable[PoolStats]) -> PoolStats:
    """One pool's stats as they are; several summed (block size 0 when they differ)."""
    pools = list(pools)
    if len(pools) == 1:
        return pools[0]
    block_sizes = {p.block_size for p in pools}
    sums = {name: sum(getattr(p, name) for p in pools) for name in _SUMMED}
    hosts = [p.host for p in pools if p.host is not None]
    host = None
    if hosts:
        host = TierStats(
            Tier.HOST,
            **{name: sum(getattr(h, name) for h in hosts) for name in _TIER_SUMMED},
            load_seconds_per_block=0.0,
            recompute_seconds_per_block=0.0,
        )
    shareds = [p.shared for p in pools if p.shared is not None]
    shared = None
    if shareds:
        # Pools of one namespace see the same store: its size is counted once (the
        # largest namespace's), the per-pool counters are summed.
        tier_sums = {name: sum(getattr(s, name) for s in shareds) for name in _TIER_SUMMED}
        tier_sums["num_blocks"] = tier_sums["num_evictable_blocks"] = max(s.num_blocks for s in shareds)
        shared = TierStats(
            Tier.SHARED, **tier_sums, load_seconds_per_block=0.0, recompute_seconds_per_block=0.0
        )
    misses: dict[str, int] = {}
    for p in pools:
        for reason, num_tokens in p.miss_tokens:
            misses[reason] = misses.get(reason, 0) + num_tokens
    policies = {p.eviction_policy for p in pools}
    return PoolStats(
        None,
        block_size=block_sizes.pop() if len(block_sizes) == 1 else 0,
        host=host,
        shared=shared,
        miss_tokens=tuple(sorted(misses.items())),
        eviction_policy=policies.pop() if len(policies) == 1 else "",
        **sums,
    )


_TIER_SUMMED = (
    "num_blocks",
    "num_free_blocks",
    "num_evictable_blocks",
    "num_referenced_blocks",
    "hit_tokens",
    "num_demotions",
    "num_loads",
    "num_evictions",
    "num_loads_skipped",
)


def pool_infos(slots: dict[PoolId, PoolSlot], now: float) -> tuple[PoolInfo, ...]:
    return tuple(
        PoolInfo(
            pid,
            slot.epoch,
            slot.namespace,
            slot.pool.block_size,
            slot.pool.num_blocks,
            slot.worker_address,
            slot.lease_expires_at - now,
            slot.is_live,
            pool_stats(slot.pool),
        )
        for pid, slot in sorted(slots.items())
    )


def block_page(
    slots: dict[PoolId, PoolSlot], pool_ids: list[PoolId], page_size: int, after: tuple[str, int]
) -> BlockPage:
    """Cached blocks of `pool_ids` (sorted) after (pool id, block id), ordered by both."""
    infos: list[BlockInfo] = []
    for pid in pool_ids:
        if pid < after[0]:
            continue
        pool = slots[pid].pool
        floor = after[1] if pid == after[0] else -1
        for block_id in sorted(b.block_id for b in pool.index.values() if b.block_id > floor):
            if len(infos) == page_size:
                last = infos[-1]
                return BlockPage(tuple(infos), encode_page_token(last.pool_id, last.block_id))
            infos.append(block_info(pid, pool.blocks[block_id]))
    return BlockPage(tuple(infos), None)


def block_info(pool_id: PoolId, block: Block) -> BlockInfo:
    parent = block.parent
    return BlockInfo(
        pool_id,
        block.block_id,
        block.block_hash,
        parent.block_hash if parent is not None else None,
        tokens_of(block.token_bytes),
        block.ref_count,
        block.pin_count > 0,
        block.depth,
        block.mixed_salt is not None,
    )


def explain(
    slots: list[PoolSlot], all_live: list[PoolSlot], prompt: Prompt, now: float
) -> list[MissExplanation]:
    """Why each of `slots` misses the prompt past its cached prefix. A miss that the pool
    cannot explain (never seen) is OTHER_NAMESPACE when a live pool of another namespace
    holds more of the prompt: K/V of another model is not K/V of this one."""
    found = []
    for slot in slots:
        pool = slot.pool
        hits = pool.match(prompt)
        miss = pool.explain(prompt, hits)
        reason = miss.reason
        others: tuple[PoolId, ...] = ()
        if reason is MissReason.NEVER_SEEN:
            others = tuple(
                other.pool.pool_id
                for other in all_live
                if other.namespace != slot.namespace
                and other.pool.block_size == pool.block_size
                and len(other.pool.match(prompt)) > len(hits)
            )
            if others:
                reason = MissReason.OTHER_NAMESPACE
        ghost = miss.ghost
        found.append(
            MissExplanation(
                pool.pool_id,
                slot.worker_address,
                len(hits) * pool.block_size,
                reason.value if reason is not None else None,
                miss.num_tokens,
                miss.num_partial_tokens,
                miss.first_missing_block,
                ghost.cause if ghost is not None else "",
                now - ghost.at if ghost is not None else 0.0,
                others,
            )
        )
    return found


def matches(slots: Iterable[PoolSlot], prompt: Prompt) -> list[PoolMatch]:
    """The prompt's cached prefix in each of the (live) slots' pools."""
    found = []
    shared_chains: dict[bytes, int] = {}  # namespace seed -> its shared chain's length (walked once)
    for slot in slots:
        pool = slot.pool
        device, host = pool.match_tiers(prompt)
        num_shared = 0
        if pool.shared is not None and len(device) + len(host) < prompt.num_tokens // pool.block_size:
            chain = shared_chains.get(pool.seed)
            if chain is None:
                chain = shared_chains[pool.seed] = len(pool.shared.match(prompt, pool.block_size))
            num_shared = max(0, chain - len(device) - len(host))
        found.append(
            PoolMatch(
                pool.pool_id,
                slot.worker_address,
                (len(device) + len(host) + num_shared) * pool.block_size,
                pool.load,
                len(pool.sequences),
                num_host_cached_tokens=len(host) * pool.block_size,
                num_shared_cached_tokens=num_shared * pool.block_size,
                occupancy=len(pool.index) / pool.num_blocks,
            )
        )
    return found
