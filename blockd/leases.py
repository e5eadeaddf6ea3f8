"""Pool slots under leases: registration, epochs, expiry and tombstones.

A slot is a registered pool id with its current pool, lease and epoch. Invariants:
- an epoch only grows: registering a known id again bumps it, and so does a lapsed
  lease, so a worker call carrying an older epoch is refused (StaleEpoch) and
  changes nothing (fencing);
- a slot that is not live (its lease lapsed) holds an empty pool; it stays as a
  tombstone, so its old epoch is answered StaleEpoch rather than NotFound;
- slots are only ever deleted to stay within `max_pools`: the tombstone that lapsed
  first goes; with only live slots, a new id is ResourceExhausted;
- a slot's `pool_token` is its owner's secret: a live slot is re-registered only by
  a caller presenting it (PermissionDenied otherwise, and nothing changes), with or
  without a worker token on the API, so no caller can wipe another worker's cache. A live slot keeps its token; a new, unknown or lapsed one
  takes the token presented (a worker keeps one credential across blockd restarts)
  or a fresh random one.

Pure bookkeeping like the rest of the core: time comes from the injected clock.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from blockd.config import DirectoryConfig
from blockd.pool import BlockPool, PoolCounters
from blockd.types import (
    NO_HOST_TIER,
    HostSpec,
    Namespace,
    NotFound,
    PermissionDenied,
    PoolId,
    ResourceExhausted,
    StaleEpoch,
)
from blockd.validation import check_pool_id_given, shown

PoolFactory = Callable[[PoolId, int, int, Namespace, PoolCounters, HostSpec], BlockPool]
"""(pool id, num_blocks, block_size, namespace, counters, host tier) -> an empty pool."""


@dataclass
class PoolSlot:
    """A registered pool id: its current pool (empty while not live), lease and epoch."""

    pool: BlockPool
    namespace: Namespace
    worker_address: str
    epoch: int
    lease_expires_at: float
    is_live: bool
    pool_token: str = ""


class PoolLeases:
    """Every slot, by pool id. `on_reset(pool_id)` runs whenever a live pool's state is
    dropped (re-registered, resynced, lease lapsed), before its pool is replaced."""

    def __init__(
        self,
        config: DirectoryConfig,
        clock: Callable[[], float],
        new_pool: PoolFactory,
        on_reset: Callable[[PoolId], None],
    ) -> None:
        self.slots: dict[PoolId, PoolSlot] = {}
        self._config = config
        self._clock = clock
        self._new_pool = new_pool
        self._on_reset = on_reset

    # ------------------------------------------------------------ lifecycle

    def register(
        self,
        num_blocks: int,
        block_size: int,
        namespace: Namespace,
        worker_address: str,
        pool_id: PoolId | None,
        pool_token: str | None = None,
        host: HostSpec = NO_HOST_TIER,
    ) -> PoolSlot:
        """A live slot with an empty pool (arguments validated). A known id is reset
        (references, sequences and index dropped) under a bumped epoch, if the caller
        may (see the module docstring); an unknown id is created (a worker
        re-registering after a blockd restart)."""
        pool_id = pool_id if pool_id is not None else self._new_pool_id()
        old = self.slots.get(pool_id)
        # A lease that lapsed protects nothing, whether or not the expiry task ran yet.
        if old is not None and old.is_live and old.lease_expires_at > self._clock():
            self._check_owner(old, pool_id, pool_token)
            token = old.pool_token
        else:
            token = pool_token or secrets.token_urlsafe(24)
        if pool_id not in self.slots:
            self._make_room()
        if old is not None and old.is_live:
            self._on_reset(pool_id)
        epoch = old.epoch + 1 if old is not None else self._config.initial_epoch
        counters = old.pool.counters if old is not None else PoolCounters()
        pool = self._new_pool(pool_id, num_blocks, block_size, namespace, counters, host)
        slot = PoolSlot(pool, namespace, worker_address, epoch, self._lease_end(), True, token)
        self.slots[pool_id] = slot
        return slot

    def renew(self, slot: PoolSlot) -> None:
        slot.lease_expires_at = self._lease_end()

    def reset(self, slot: PoolSlot, fresh: BlockPool) -> None:
        """Replace a live slot's pool by `fresh` (Resync), keeping its epoch."""
        assert slot.is_live, "only a live pool is resynced"
        self._on_reset(fresh.pool_id)
        slot.pool = fresh
        self.renew(slot)

    def expire_lapsed(self) -> list[PoolId]:
        """Retire every live slot whose lease lapsed; answers their ids."""
        now = self._clock()
        expired = [pid for pid, slot in self.slots.items() if slot.is_live and slot.lease_expires_at <= now]
        for pool_id in expired:
            self._expire(self.slots[pool_id])
        return expired

    # ------------------------------------------------------------ lookups

    def worker_slot(self, pool_id: PoolId, epoch: int) -> PoolSlot:
        """The live pool a worker call addresses; a lapsed lease is retired on the spot,
        whether or not `expire_lapsed` has run yet."""
        check_pool_id_given(pool_id)
        slot = self.slots.get(pool_id)
        if slot is None:
            raise NotFound(
                f"unknown pool {shown(pool_id)}: call RegisterPool (pool_id={shown(pool_id)} keeps the id), "
                f"then Resync the live sequences"
            )
        if slot.is_live and slot.lease_expires_at <= self._clock():
            self._expire(slot)
        if not slot.is_live:
            raise StaleEpoch(
                f"the lease of pool {shown(pool_id)} lapsed and its blocks were dropped: call "
                f"RegisterPool with pool_id={shown(pool_id)}, then Resync"
            )
        if epoch != slot.epoch:
            raise StaleEpoch(
                f"epoch {epoch} of pool {shown(pool_id)} is stale (current: {slot.epoch}); "
                f"the pool was registered again: use the epoch RegisterPool returned"
            )
        return slot

    def known_slot(self, pool_id: PoolId) -> PoolSlot:
        slot = self.slots.get(pool_id)
        if slot is None:
            raise NotFound(f"unknown pool {shown(pool_id)}; ListPools shows the known ones")
        return slot

    def selected(self, pool_id: PoolId | None) -> list[PoolSlot]:
        """One known slot, or every slot when `pool_id` is None."""
        return [self.known_slot(pool_id)] if pool_id else list(self.slots.values())

    def live(self, pool_id: PoolId | None = None) -> list[PoolSlot]:
        return [slot for slot in self.selected(pool_id) if slot.is_live]

    # ------------------------------------------------------------ private helpers

    def _check_owner(self, slot: PoolSlot, pool_id: PoolId, pool_token: str | None) -> None:
        if pool_token and hmac.compare_digest(pool_token.encode(), slot.pool_token.encode()):
            return
        remaining = slot.lease_expires_at - self._clock()
        raise PermissionDenied(
            f"pool {shown(pool_id)} is live and belongs to the worker that registered it: to "
            f"re-register it, pass the pool_token its RegisterPool answered "
            f"({'a wrong one was given' if pool_token else 'none was given'}); a new worker "
            f"leaves pool_id empty, or waits for the lease to lapse (in {remaining:.1f} s)"
        )

    def _lease_end(self) -> float:
        return self._clock() + self._config.lease_ttl_seconds

    def _new_pool_id(self) -> PoolId:
        while True:
            pool_id = PoolId(f"pool-{secrets.token_hex(4)}")
            if pool_id not in self.slots:
                return pool_id

    def _make_room(self) -> None:
        if len(self.slots) < self._config.max_pools:
            return
        tombstones = [(slot.lease_expires_at, pid) for pid, slot in self.slots.items() if not slot.is_live]
        if not tombstones:
            raise ResourceExhausted(
                f"blockd already serves {len(self.slots)} live pools (its limit); retire a worker first"
            )
        del self.slots[min(tombstones)[1]]

    def _expire(self, slot: PoolSlot) -> None:
        """The worker is gone: drop its references, sequences and index under a new epoch."""
        assert slot.is_live, "only a live pool expires"
        old = slot.pool
        self._on_reset(old.pool_id)
        slot.pool = self._new_pool(
            old.pool_id, old.num_blocks, old.block_size, slot.namespace, old.counters, old.host_spec
        )
        slot.epoch += 1
        slot.is_live = False
