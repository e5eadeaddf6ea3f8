"""Operator queries: stats, pools, cached blocks, and cached-prefix matches.

Read-only: nothing here changes a pool. Functions of the directory's slots, so the
directory's methods stay one line each.
"""

from __future__ import annotations

from collections.abc import Iterable

from blockd.block import Block
from blockd.hashing import tokens_of
from blockd.leases import PoolSlot
from blockd.pool import BlockPool
from blockd.prompt import Prompt
from blockd.types import BlockInfo, BlockPage, PoolId, PoolInfo, PoolMatch, PoolStats
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
    )


def total(pools: Iterable[PoolStats]) -> PoolStats:
    """One pool's stats as they are; several summed (block size 0 when they differ)."""
    pools = list(pools)
    if len(pools) == 1:
        return pools[0]
    block_sizes = {p.block_size for p in pools}
    sums = {name: sum(getattr(p, name) for p in pools) for name in _SUMMED}
    return PoolStats(None, block_size=block_sizes.pop() if len(block_sizes) == 1 else 0, **sums)


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


def matches(slots: Iterable[PoolSlot], prompt: Prompt) -> list[PoolMatch]:
    """The prompt's cached prefix in each of the (live) slots' pools."""
    found = []
    for slot in slots:
        pool = slot.pool
        found.append(
            PoolMatch(
                pool.pool_id,
                slot.worker_address,
                len(pool.match(prompt)) * pool.block_size,
                pool.load,
                len(pool.sequences),
                len(pool.index) / pool.num_blocks,
            )
        )
    return found
