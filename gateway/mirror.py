"""A gateway-side mirror of blockd's block index: which worker caches which prefix (pure: no I/O).

Why: asking blockd's `Route` costs a gRPC round trip on the critical path of every
request (about 0.9-1.2 ms on the 2-core bench machine, where the gateway's budget is 1 ms
in all; `python -m bench.gateway`). blockd publishes every change of its index as
numbered events (`WatchEvents`), so the gateway keeps the same facts locally and
answers "how many of this prompt's tokens does each worker cache" in microseconds.
`gateway.mirror_feed` does the I/O (snapshot, then the event stream); this module is
the state machine it feeds.

What it holds: per pool, the set of block hashes findable in its device tier and in its
host tier; one set of the hashes in the shared tier (a shared tier is per namespace,
and the namespace seed is in every hash, so one set serves every namespace); per pool
its worker address, namespace seed and block size. Tokens are never kept.

Invariants:
- Applying, in order, every event numbered after a snapshot's sequence number to that
  snapshot gives blockd's device index of every pool: each event sets absolute facts
  about its hashes (STORED/LOADED add, REMOVED drops, DEMOTED adds to a lower tier,
  CLEARED empties a pool), so replaying one whose effect the snapshot already shows
  changes nothing.
- Event numbers grow by exactly one. A jump, a GAP, a number at or below the last one
  (blockd restarted) or more than `max_blocks` hashes in all put the mirror out of sync;
  out of sync it answers None (the caller asks `Route`) until `load` gives it a new
  snapshot. Memory is bounded by `max_blocks` hashes.
- A prompt's cached prefix is counted as blockd's Route counts it
  (`blockd.queries.matches`): the leading blocks found in the device or host tier, then,
  for a pool with a shared tier, the leading run found there if it is longer. Hashes
  decide here, unverified: blockd verifies every hit at admission, so a collision could
  only cost a worse placement, never wrong K/V.
- A worker whose address no known pool announces makes `cached_tokens` answer None:
  the mirror never guesses 0 for a worker it cannot see.

Known limit: blockd's snapshot (ListBlocks) lists the device tier only, so blocks that
already sat in a host or shared tier when the mirror (re)synced count from the next
event that mentions them (`lower_tiers_partial` says when that can be the case).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.prefix_hash import PromptChain, token_bytes


# Tier and Kind are the contract's enums (kvcache.v1.Tier, BlockEventKind) by name and
# number; the mirror stays free of generated code, and gateway.mirror_feed builds its
# mapping from the generated descriptors, so the two cannot drift apart.
class Tier(enum.Enum):
    DEVICE = 1
    HOST = 2
    SHARED = 3


class Kind(enum.Enum):
    STORED = 1
    REMOVED = 2
    CLEARED = 3
    GAP = 4
    DEMOTED = 5
    LOADED = 6


@dataclass(frozen=True, slots=True)
class MirrorEvent:
    """One of blockd's WatchEvents messages, as much of it as the mirror needs."""

    sequence: int
    kind: Kind
    pool_id: str
    block_hashes: tuple[bytes, ...] = ()
    tier: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class PoolDescription:
    """A pool as ListPools describes it; `worker_address` as the fleet spells addresses."""

    pool_id: str
    worker_address: str
    seed: bytes  # the namespace seed, h_{-1} (gateway.prefix_hash.namespace_seed)
    block_size: int
    has_shared_tier: bool = False


_EMPTY: frozenset[bytes] = frozenset()


class DirectoryMirror:
    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.in_sync = False
        self.why_out_of_sync = "not loaded yet"
        self.last_sequence = 0
        self.num_blocks = 0
        self.lower_tiers_partial = False
        self.unknown_pools: set[str] = set()
        self._pools: dict[str, PoolDescription] = {}
        self._by_address: dict[str, tuple[str, ...]] = {}
        self._device: dict[str, set[bytes]] = {}
        self._host: dict[str, set[bytes]] = {}
        self._shared: set[bytes] = set()

    # ------------------------------------------------------------ state

    def load(
        self,
        sequence: int,
        pools: Iterable[PoolDescription],
        device_blocks: Iterable[tuple[str, bytes]],
        lower_tiers_partial: bool = False,
    ) -> None:
        """Replace everything with a snapshot taken after event `sequence` (the snapshot may
        be newer: the events after `sequence` are applied on top of it)."""
        self._device, self._host, self._shared = {}, {}, set()
        self.num_blocks = 0
        self.unknown_pools = set()
        self.describe(pools)
        for pool_id, block_hash in device_blocks:
            blocks = self._device.setdefault(pool_id, set())
            if block_hash not in blocks:
                blocks.add(block_hash)
                self.num_blocks += 1
        self.last_sequence = sequence
        self.lower_tiers_partial = lower_tiers_partial
        self.in_sync, self.why_out_of_sync = True, ""
        self._check_bound()

    def describe(self, pools: Iterable[PoolDescription]) -> None:
        """The pools blockd knows now (ListPools): addresses, seeds, block sizes."""
        self._pools = {p.pool_id: p for p in pools}
        by_address: dict[str, list[str]] = {}
        for pool in self._pools.values():
            by_address.setdefault(pool.worker_address, []).append(pool.pool_id)
        self._by_address = {a: tuple(ids) for a, ids in by_address.items()}
        self.unknown_pools -= self._pools.keys()

    def lose_sync(self, why: str) -> None:
        self.in_sync, self.why_out_of_sync = False, why

    def apply(self, event: MirrorEvent) -> None:
        """One event, in order; out of order (or a GAP) puts the mirror out of sync."""
        if not self.in_sync:
            return
        if event.kind is Kind.GAP:
            self.lose_sync(f"gap: blockd no longer holds the events after {self.last_sequence}")
            return
        if event.sequence != self.last_sequence + 1:
            self.lose_sync(f"event {event.sequence} after {self.last_sequence}")
            return
        self.last_sequence = event.sequence
        pool_id, hashes, tier = event.pool_id, event.block_hashes, event.tier
        if pool_id and pool_id not in self._pools:
            self.unknown_pools.add(pool_id)
        if event.kind is Kind.CLEARED:
            self.num_blocks -= len(self._device.pop(pool_id, _EMPTY)) + len(self._host.pop(pool_id, _EMPTY))
            return
        if tier is Tier.SHARED:
            blocks = self._shared
        elif tier is Tier.HOST:
            blocks = self._host.setdefault(pool_id, set())
        else:
            blocks = self._device.setdefault(pool_id, set())
        before = len(blocks)
        if event.kind is Kind.REMOVED:
            blocks.difference_update(hashes)
        elif event.kind in (Kind.STORED, Kind.LOADED, Kind.DEMOTED):
            blocks.update(hashes)
        self.num_blocks += len(blocks) - before
        self._check_bound()

    def _check_bound(self) -> None:
        if self.num_blocks > self.max_blocks:
            self.lose_sync(f"{self.num_blocks} block hashes, more than max_blocks={self.max_blocks}")
            self._device, self._host, self._shared = {}, {}, set()
            self.num_blocks = 0

    # ------------------------------------------------------------ queries

    def knows(self, address: str) -> bool:
        return address in self._by_address

    def cached_tokens(
        self,
        addresses: Sequence[str],
        token_ids: Sequence[int],
        salt: str = "",
        public_prefix_tokens: int = 0,
    ) -> list[int] | None:
        """Per address, the prompt tokens its pool caches (the most over pools announcing
        that address), as Route would count them; None when out of sync or when an
        address is no known pool's."""
        if not self.in_sync:
            return None
        data = token_bytes(token_ids)
        chains: dict[tuple[bytes, int], PromptChain] = {}
        out = []
        for address in addresses:
            pool_ids = self._by_address.get(address)
            if pool_ids is None:
                return None
            best = 0
            for pool_id in pool_ids:
                pool = self._pools[pool_id]
                key = (pool.seed, pool.block_size)
                chain = chains.get(key)
                if chain is None:
                    chain = chains[key] = PromptChain(
                        pool.seed, data, pool.block_size, salt, public_prefix_tokens
                    )
                best = max(best, self._prefix_blocks(pool, chain) * pool.block_size)
            out.append(best)
        return out

    def _prefix_blocks(self, pool: PoolDescription, chain: PromptChain) -> int:
        device = self._device.get(pool.pool_id, _EMPTY)
        host = self._host.get(pool.pool_id, _EMPTY)
        count, total = 0, chain.num_blocks
        while count < total:
            block_hash = chain.hash(count)
            if block_hash not in device and block_hash not in host:
                break
            count += 1
        if pool.has_shared_tier and count < total:
            shared, run = self._shared, 0
            while run < total and chain.hash(run) in shared:
                run += 1
            count = max(count, run)
        return count
