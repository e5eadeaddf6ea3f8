"""The block directory: pools under leases, prefix lookups, pins, stats and events.

Pure bookkeeping: no gRPC, no I/O, no threads. Time comes from the injected
`clock` (seconds, monotonic), so tests drive leases and pins by hand. Not
thread-safe: the server calls it from its event loop only, which serialises calls.

Every call either raises a `DirectoryError` and changes nothing, or applies fully.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from blockd.config import MAX_BLOCK_SIZE, MAX_POOL_BLOCKS, DirectoryConfig
from blockd.events import EventKind, EventLog
from blockd.eviction import make_policy
from blockd.hashing import DEFAULT_HASHER, BlockHasher, tokens_of
from blockd.pins import PinTable
from blockd.pool import BlockPool, PoolCounters
from blockd.prompt import Prompt, check_salt, make_prompt
from blockd.routing import by_cached_prefix, rank_for_route
from blockd.types import (
    AdmitOp,
    BlockInfo,
    BlockPage,
    CommitOp,
    FlushResult,
    GrowOp,
    InvalidArgument,
    Namespace,
    NotFound,
    PinId,
    PinResult,
    PoolId,
    PoolInfo,
    PoolMatch,
    PoolStats,
    Registration,
    ReleaseOp,
    ResourceExhausted,
    ResyncResult,
    ResyncSequence,
    Route,
    StaleEpoch,
    Stats,
    StepResult,
)
from blockd.validation import plan_resync, plan_step

MAX_NAME_CHARS = 256
MAX_PIN_TTL_SECONDS = 30 * 86_400
DEFAULT_PIN_TTL_SECONDS = 3_600.0
DEFAULT_PAGE_SIZE = 1_000
MAX_PAGE_SIZE = 10_000
_POOL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass
class PoolSlot:
    """A registered pool id: its current pool (empty while not live), lease and epoch.
    Slots are never deleted: a lapsed pool stays as a tombstone so its old epoch is
    answered StaleEpoch rather than NotFound."""

    pool: BlockPool
    namespace: Namespace
    worker_address: str
    epoch: int
    lease_expires_at: float
    is_live: bool


class BlockDirectory:
    """Every registered pool (live, or a tombstone after its lease lapsed), the pins
    over them, and one event log. Worker calls need the pool's current epoch."""

    def __init__(
        self,
        config: DirectoryConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        hasher: BlockHasher = DEFAULT_HASHER,
    ) -> None:
        self.config = config or DirectoryConfig()
        self.events = EventLog(self.config.event_log_capacity, self.config.event_log_max_bytes)
        self._clock = clock
        self._hasher = hasher
        self._slots: dict[PoolId, PoolSlot] = {}
        self._pins = PinTable()

    # ------------------------------------------------------------ workers

    def register_pool(
        self,
        num_blocks: int,
        block_size: int,
        namespace: Namespace,
        worker_address: str = "",
        pool_id: PoolId | None = None,
    ) -> Registration:
        """Declare a pool. With the id of a known pool, that pool is reset (references,
        sequences and index dropped) under a bumped epoch; an unknown id is created
        (a worker re-registering after a blockd restart)."""
        if not 1 <= num_blocks <= MAX_POOL_BLOCKS:
            raise InvalidArgument(f"num_blocks must be 1 .. {MAX_POOL_BLOCKS}, got {num_blocks}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise InvalidArgument(f"block_size must be 1 .. {MAX_BLOCK_SIZE}, got {block_size}")
        for name, value in (
            ("namespace.model_id", namespace.model_id),
            ("namespace.model_revision", namespace.model_revision),
            ("namespace.dtype", namespace.dtype),
            ("namespace.adapter_id", namespace.adapter_id),
            ("worker_address", worker_address),
        ):
            if len(value) > MAX_NAME_CHARS:
                raise InvalidArgument(f"{name} is longer than {MAX_NAME_CHARS} characters")
        if pool_id is not None and not _POOL_ID.fullmatch(pool_id):
            raise InvalidArgument(
                f"pool_id {_shown(pool_id)} must be 1-128 characters of A-Z a-z 0-9 . _ : - "
                f"starting with a letter or digit (or empty to get a new id)"
            )
        pool_id = pool_id if pool_id is not None else self._new_pool_id()
        if pool_id not in self._slots:
            self._make_room_for_a_pool()
        old = self._slots.get(pool_id)
        if old is not None:
            self._retire(old)
        epoch = old.epoch + 1 if old is not None else self.config.initial_epoch
        counters = old.pool.counters if old is not None else PoolCounters()
        pool = self._new_pool(pool_id, num_blocks, block_size, namespace, counters)
        self._slots[pool_id] = PoolSlot(
            pool, namespace, worker_address, epoch, self._clock() + self.config.lease_ttl_seconds, True
        )
        return Registration(pool_id, epoch, self.config.lease_ttl_seconds, self.config.max_sequence_tokens)

    def renew_lease(self, pool_id: PoolId, epoch: int) -> float:
        slot = self._worker_slot(pool_id, epoch)
        slot.lease_expires_at = self._clock() + self.config.lease_ttl_seconds
        return self.config.lease_ttl_seconds

    def step(
        self,
        pool_id: PoolId,
        epoch: int,
        commits: Seq[CommitOp] = (),
        releases: Seq[ReleaseOp] = (),
        grows: Seq[GrowOp] = (),
        admits: Seq[AdmitOp] = (),
    ) -> StepResult:
        """One scheduler step: every op is validated first (any bad op raises and
        nothing changes), then commits, releases, grows and admits apply in that order.
        A grow or admit that finds too few blocks answers False and changes nothing."""
        slot = self._worker_slot(pool_id, epoch)
        pool = slot.pool
        plan = plan_step(pool, self.config, commits, releases, grows, admits)
        slot.lease_expires_at = self._clock() + self.config.lease_ttl_seconds
        for sequence_id, block_ids, data in plan.commits:
            pool.commit(sequence_id, block_ids, data)
        for sequence_id in plan.releases:
            pool.release(sequence_id)
        grown = tuple(pool.grow(sequence_id, num_tokens) for sequence_id, num_tokens in plan.grows)
        admitted = tuple(pool.admit(sequence_id, prompt) for sequence_id, prompt in plan.admits)
        pool.leaves.compact(pool.num_evictable)
        return StepResult(grown, admitted, pool.num_free, pool.num_evictable)

    def resync(self, pool_id: PoolId, epoch: int, sequences: Seq[ResyncSequence]) -> ResyncResult:
        """Make the worker's declared live sequences the whole state of the pool: it is
        emptied, then each sequence re-references its exact blocks and its full blocks
        are committed and indexed again. Idempotent, so a worker may retry it."""
        slot = self._worker_slot(pool_id, epoch)
        old = slot.pool
        fresh = self._new_pool(pool_id, old.num_blocks, old.block_size, slot.namespace, old.counters)
        plans = plan_resync(fresh, self.config, sequences)
        self._clear(slot)
        slot.pool = fresh
        slot.lease_expires_at = self._clock() + self.config.lease_ttl_seconds
        num_indexed = fresh.resync(plans)
        return ResyncResult(len(plans), num_indexed)

    def expire_leases(self) -> list[PoolId]:
        """Retire every live pool whose lease lapsed; answers their ids."""
        now = self._clock()
        expired = [pid for pid, slot in self._slots.items() if slot.is_live and slot.lease_expires_at <= now]
        for pool_id in expired:
            self._expire(self._slots[pool_id])
        return expired

    # ------------------------------------------------------------ operators

    def stats(self, pool_id: PoolId | None = None) -> Stats:
        slots = [self._known_slot(pool_id)] if pool_id else list(self._slots.values())
        pools = tuple(_pool_stats(slot.pool, len(slot.pool.sequences)) for slot in slots)
        return Stats(_total(pools), pools, self.events.last_sequence)

    def list_pools(self) -> tuple[PoolInfo, ...]:
        now = self._clock()
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
                _pool_stats(slot.pool, len(slot.pool.sequences)),
            )
            for pid, slot in sorted(self._slots.items())
        )

    def list_blocks(
        self, pool_id: PoolId | None = None, page_size: int = 0, page_token: str | None = None
    ) -> BlockPage:
        """Cached blocks ordered by (pool_id, block_id), one page at a time."""
        if page_size == 0:
            page_size = DEFAULT_PAGE_SIZE
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size must be 1 .. {MAX_PAGE_SIZE} (or 0 for {DEFAULT_PAGE_SIZE})")
        after = _decode_page_token(page_token) if page_token else ("", -1)
        pool_ids = [pool_id] if pool_id else sorted(self._slots)
        if pool_id:
            self._known_slot(pool_id)
        infos: list[BlockInfo] = []
        for pid in pool_ids:
            if pid < after[0]:
                continue
            pool = self._slots[pid].pool
            floor = after[1] if pid == after[0] else -1
            for block_id in sorted(b.block_id for b in pool.index.values() if b.block_id > floor):
                if len(infos) == page_size:
                    last = infos[-1]
                    return BlockPage(tuple(infos), _encode_page_token(last.pool_id, last.block_id))
                infos.append(_block_info(pid, pool.blocks[block_id]))
        return BlockPage(tuple(infos), None)

    def lookup(
        self,
        token_ids: Seq[int],
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        pool_id: PoolId | None = None,
    ) -> tuple[PoolMatch, ...]:
        """Cached prefix of the prompt in each live pool, longest first."""
        prompt = make_prompt(
            token_ids, cache_salt, public_prefix_tokens, self.config.max_sequence_tokens, "lookup"
        )
        return tuple(by_cached_prefix(self._matches(prompt, pool_id)))

    def route(self, token_ids: Seq[int], cache_salt: str = "", public_prefix_tokens: int = 0) -> Route:
        """The live pool with the longest cached prefix, lower load breaking ties; a pool
        loaded more than `route_load_margin` above the least loaded one is skipped."""
        prompt = make_prompt(
            token_ids, cache_salt, public_prefix_tokens, self.config.max_sequence_tokens, "route"
        )
        ranked = tuple(rank_for_route(self._matches(prompt, None), self.config.route_load_margin))
        if not ranked:
            return Route(None, None, 0, ())
        best = ranked[0]
        return Route(best.pool_id, best.worker_address, best.num_cached_tokens, ranked)

    def flush(self, pool_id: PoolId | None = None, cache_salt: str | None = None) -> FlushResult:
        """Drop every unreferenced cached block (of one pool, of one salt); referenced
        ones are counted busy and stay until released. Never refuses."""
        check_salt(cache_salt or "", "flush")
        slots = [self._known_slot(pool_id)] if pool_id else list(self._slots.values())
        dropped = busy = 0
        for slot in slots:
            pool_dropped, pool_busy = slot.pool.flush(cache_salt or None)
            dropped += pool_dropped
            busy += pool_busy
        return FlushResult(dropped, busy)

    def pin(
        self,
        token_ids: Seq[int],
        cache_salt: str = "",
        public_prefix_tokens: int = 0,
        ttl_seconds: float = 0.0,
        pool_id: PoolId | None = None,
    ) -> PinResult:
        """Reference the currently cached blocks of the prefix in each live pool (or
        one) until `unpin` or the TTL (0: one hour; at most 30 days)."""
        if ttl_seconds == 0:
            ttl_seconds = DEFAULT_PIN_TTL_SECONDS
        if not (math.isfinite(ttl_seconds) and 0 < ttl_seconds <= MAX_PIN_TTL_SECONDS):
            raise InvalidArgument(
                f"ttl_seconds must be in (0, {MAX_PIN_TTL_SECONDS}] (0 means "
                f"{DEFAULT_PIN_TTL_SECONDS:.0f}), got {ttl_seconds}"
            )
        prompt = make_prompt(
            token_ids, cache_salt, public_prefix_tokens, self.config.max_sequence_tokens, "pin"
        )
        held = {}
        num_tokens = 0
        for slot in self._live_slots(pool_id):
            hits = slot.pool.match(prompt)
            if hits:
                slot.pool.pin(hits)
                held[slot.pool.pool_id] = hits
                num_tokens += len(hits) * slot.pool.block_size
        pin = self._pins.add(self._clock() + ttl_seconds, held)
        return PinResult(pin.pin_id, num_tokens, sum(len(b) for b in held.values()), ttl_seconds)

    def unpin(self, pin_id: PinId) -> int:
        """Drop a pin; answers how many blocks it still held."""
        pin = self._pins.pop(pin_id)
        if pin is None:
            raise NotFound(f"unknown pin {pin_id!r} (it expired, was unpinned, or blockd restarted)")
        for pid, blocks in pin.blocks.items():
            self._slots[pid].pool.unpin(blocks)
        return sum(len(blocks) for blocks in pin.blocks.values())

    def expire_pins(self) -> list[PinId]:
        expired = [pin.pin_id for pin in self._pins.expired(self._clock())]
        for pin_id in expired:
            self.unpin(pin_id)
        return expired

    # ------------------------------------------------------------ private helpers

    def _new_pool_id(self) -> PoolId:
        while True:
            pool_id = PoolId(f"pool-{secrets.token_hex(4)}")
            if pool_id not in self._slots:
                return pool_id

    def _new_pool(
        self, pool_id: PoolId, num_blocks: int, block_size: int, namespace: Namespace, counters: PoolCounters
    ) -> BlockPool:
        seed = self._hasher.namespace_seed(namespace, block_size)
        return BlockPool(
            pool_id,
            num_blocks,
            block_size,
            seed,
            self._hasher,
            make_policy(self.config.eviction_policy),
            self.events,
            counters,
        )

    def _worker_slot(self, pool_id: PoolId, epoch: int) -> PoolSlot:
        """The live pool a worker call addresses; a lapsed lease is retired on the spot,
        whether or not `expire_leases` has run yet."""
        if not pool_id:
            raise InvalidArgument("pool_id is empty: call RegisterPool first and pass its pool_id")
        slot = self._slots.get(pool_id)
        if slot is None:
            raise NotFound(
                f"unknown pool {_shown(pool_id)}: call RegisterPool (pool_id={_shown(pool_id)} keeps the id), "
                f"then Resync the live sequences"
            )
        if slot.is_live and slot.lease_expires_at <= self._clock():
            self._expire(slot)
        if not slot.is_live:
            raise StaleEpoch(
                f"the lease of pool {_shown(pool_id)} lapsed and its blocks were dropped: call "
                f"RegisterPool with pool_id={_shown(pool_id)}, then Resync"
            )
        if epoch != slot.epoch:
            raise StaleEpoch(
                f"epoch {epoch} of pool {_shown(pool_id)} is stale (current: {slot.epoch}); "
                f"the pool was registered again: use the epoch RegisterPool returned"
            )
        return slot

    def _known_slot(self, pool_id: PoolId) -> PoolSlot:
        slot = self._slots.get(pool_id)
        if slot is None:
            raise NotFound(f"unknown pool {_shown(pool_id)}; ListPools shows the known ones")
        return slot

    def _live_slots(self, pool_id: PoolId | None) -> list[PoolSlot]:
        slots = [self._known_slot(pool_id)] if pool_id else list(self._slots.values())
        return [slot for slot in slots if slot.is_live]

    def _matches(self, prompt: Prompt, pool_id: PoolId | None) -> list[PoolMatch]:
        matches = []
        for slot in self._live_slots(pool_id):
            pool = slot.pool
            num_cached_tokens = len(pool.match(prompt)) * pool.block_size
            matches.append(
                PoolMatch(
                    pool.pool_id,
                    slot.worker_address,
                    num_cached_tokens,
                    pool.load,
                    len(pool.sequences),
                    len(pool.index) / pool.num_blocks,
                )
            )
        return matches

    def _make_room_for_a_pool(self) -> None:
        if len(self._slots) < self.config.max_pools:
            return
        tombstones = [(slot.lease_expires_at, pid) for pid, slot in self._slots.items() if not slot.is_live]
        if not tombstones:
            raise ResourceExhausted(
                f"blockd already serves {len(self._slots)} live pools (its limit); retire a worker first"
            )
        del self._slots[min(tombstones)[1]]

    def _expire(self, slot: PoolSlot) -> None:
        """The worker is gone: drop its references, sequences and index under a new epoch."""
        self._retire(slot)
        old = slot.pool
        slot.pool = self._new_pool(old.pool_id, old.num_blocks, old.block_size, slot.namespace, old.counters)
        slot.epoch += 1
        slot.is_live = False

    def _retire(self, slot: PoolSlot) -> None:
        """Before a slot's pool is replaced by an empty one."""
        if slot.is_live:
            self._clear(slot)

    def _clear(self, slot: PoolSlot) -> None:
        self._pins.forget_pool(slot.pool.pool_id)
        self.events.append(EventKind.CLEARED, slot.pool.pool_id)


def _pool_stats(pool: BlockPool, num_sequences: int) -> PoolStats:
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
        num_sequences,
        c.queried_tokens,
        c.hit_tokens,
        c.num_evictions,
        c.num_admissions,
        c.num_admissions_deferred,
    )


def _total(pools: Iterable[PoolStats]) -> PoolStats:
    pools = list(pools)
    block_sizes = {p.block_size for p in pools}
    fields = (
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
    sums = {name: sum(getattr(p, name) for p in pools) for name in fields}
    if len(pools) == 1:
        return pools[0]
    return PoolStats(None, block_size=block_sizes.pop() if len(block_sizes) == 1 else 0, **sums)


def _block_info(pool_id: PoolId, block) -> BlockInfo:
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


def _encode_page_token(pool_id: PoolId, block_id: int) -> str:
    return base64.urlsafe_b64encode(json.dumps([pool_id, block_id]).encode()).decode()


def _decode_page_token(token: str) -> tuple[str, int]:
    try:
        pool_id, block_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        if isinstance(pool_id, str) and isinstance(block_id, int):
            return pool_id, block_id
    except (ValueError, TypeError, binascii.Error):
        pass
    raise InvalidArgument("page_token is not one this server issued; pass the previous next_page_token")


def _shown(pool_id: str) -> str:
    """A client-sent id as it appears in messages: never long enough to drown them."""
    return repr(pool_id) if len(pool_id) <= 64 else f"{pool_id[:32]!r}... ({len(pool_id)} characters)"
